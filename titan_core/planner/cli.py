"""``python -m titan_core.planner [--hardware NAME|FILE] <the overrides of a run>``: one rank's memory and step
time for that job on that hardware, before launch and without a device (``--recommend``: the fastest plans that
fit; ``--calibrate FILE``: this machine's profile from a short run, :mod:`titan_core.planner.calibrate`;
``--expert-load X``: a mixture of experts routed as unevenly as a run that logged ``expert_rank_load_max`` X;
``--expert-load-peak Y``: its memory planned at the busiest micro-batch's, logged as ``expert_rank_load_peak`` Y).

The job is composed and checked exactly as ``python -m titan_core.run`` checks it (same one-line errors),
except that the devices are the hardware profile's, not this machine's: ``launch.world_size`` (or the
degrees) sizes the world, whatever this machine holds.
"""

from __future__ import annotations

import math
import signal
import sys

from pathlib import Path
from typing import Any, NamedTuple

from titan_core.data import load_tokenizer
from titan_core.errors import EXIT_BAD_INPUT, ConfigError
from titan_core.planner.calibrate import calibrate
from titan_core.planner.costs import composed_job, planned_job, report
from titan_core.planner.hardware import hardware_profile
from titan_core.planner.recommend import recommend
from titan_core.preemption import exit_code

DEFAULT_HARDWARE = "h100"

USAGE = ("usage: python -m titan_core.planner [--hardware h100|a100|...|cpu-measured|FILE.yaml] "
         "[--recommend | --calibrate FILE.yaml] [--expert-load X [--expert-load-peak Y]] [overrides ...]")
# Each load option: the field of Flags it sets and the metric a run logs it as.
LOAD_FLAGS = {"--expert-load": ("expert_load", "expert_rank_load_max"),
              "--expert-load-peak": ("expert_load_peak", "expert_rank_load_peak")}


class Flags(NamedTuple):
    """The plan command's own options, and the overrides of the job."""

    hardware: str | None  # --hardware (None: not given)
    recommend: bool
    calibrate: Path | None  # --calibrate FILE.yaml: the profile to write
    expert_load: float  # --expert-load X: the busiest rank's expert rows per copy routed (1: even routing)
    expert_load_peak: float | None  # --expert-load-peak Y: the same over the busiest micro-batch (None: X)
    overrides: list[str]


def split_flags(argv: list[str]) -> Flags:
    """The plan command's options and the remaining arguments (the overrides)."""
    flags: dict[str, Any] = {"hardware": None, "recommend": False, "calibrate": None, "expert_load": 1.0,
                             "expert_load_peak": None}  # Flags' fields, each of its own type
    rest, args = [], iter(argv)
    examples = {"--hardware": "--hardware h100 (or another profile)", "--calibrate": "--calibrate mydevice.yaml",
                "--expert-load": "--expert-load 1.3 (the expert_rank_load_max a run of this job logged)",
                "--expert-load-peak": "--expert-load-peak 1.5 (the expert_rank_load_peak a run of this job logged)"}
    for arg in args:
        name = arg.partition("=")[0]
        if name in examples:
            value = arg.partition("=")[2] or next(args, None)
            if not value:
                raise ConfigError(name, "needs a value", f"give {examples[name]}")
            if name == "--hardware":
                flags["hardware"] = value
            elif name == "--calibrate":
                flags["calibrate"] = Path(value)
            else:
                flags[LOAD_FLAGS[name][0]] = _expert_load(name, value)
        elif arg == "--recommend":
            flags["recommend"] = True
        elif arg.startswith("-"):
            raise ConfigError(arg, "is not an option of the plan command", USAGE)
        else:
            rest.append(arg)
    if flags["recommend"] and flags["calibrate"]:
        raise ConfigError("--calibrate", "cannot be given with --recommend", USAGE)
    for name, (field, _) in LOAD_FLAGS.items():
        if flags["calibrate"] and flags[field] not in (1, None):
            raise ConfigError(name, "plans a job, which --calibrate does not", USAGE)
    peak = flags["expert_load_peak"]
    if peak is not None and peak < flags["expert_load"]:
        raise ConfigError("--expert-load-peak", f"{peak} is below --expert-load "
                          f"{flags['expert_load']}: the busiest micro-batch is at least as loaded as the step",
                          "give the expert_rank_load_peak the same run logged beside its expert_rank_load_max")
    return Flags(**flags, overrides=rest)


def _expert_load(flag: str, value: str) -> float:
    metric = LOAD_FLAGS[flag][1]
    try:
        load = float(value)
    except ValueError:
        load = float("nan")
    if not 1 <= load < math.inf:  # nan fails both
        raise ConfigError(flag, f"'{value}' is not a number of 1 or more: the busiest rank computes at least an "
                          f"even share", f"give the {metric} a run of this job logged, or 1 (even routing)")
    return load


def job_estimate(argv: list[str], hardware=None):
    """The plan and the :class:`~titan_core.planner.estimate.Estimate` of a command line (``--hardware`` and
    the overrides of a run), or of its overrides on ``hardware`` when given; raises ConfigError on bad input."""
    flags = split_flags(argv)
    return planned_job(flags.overrides, hardware or hardware_profile(flags.hardware or DEFAULT_HARDWARE),
                       flags.expert_load, flags.expert_load_peak)


def plan_costs(argv: list[str]) -> str:
    """What the plan command prints for a command line."""
    flags = split_flags(argv)
    if flags.recommend:
        return recommendations(argv)
    if flags.calibrate:
        return calibrate(flags.calibrate, flags.hardware, flags.overrides)
    plan, result = job_estimate(argv)
    return plan.describe() + "\n" + report(result)


def recommendations(argv: list[str]) -> str:
    """The best plans for the cluster of a command line, as the command lines that run them."""
    flags = split_flags(argv)
    overrides, hardware = flags.overrides, hardware_profile(flags.hardware or DEFAULT_HARDWARE)
    config = composed_job(overrides)
    best, tried = recommend(config, hardware, load_tokenizer(config.tokenizer).vocab_size, flags.expert_load,
                            flags.expert_load_peak)
    world = config.launch.world_size
    if not best:
        raise ConfigError("launch.world_size", f"none of the {tried} plans of these plugins fits {world} x "
                          f"{hardware.name} ({hardware.usable_gib:.1f} GiB usable each)",
                          "add devices, shorten training.seq_len or the batch, or enable more plugins (ac, tp, pp)")
    lines = [f"titan-core: the {len(best)} fastest of {tried} plans that fit {world} x {hardware.name} "
             f"({hardware.usable_gib:.1f} of {hardware.memory_gib:.1f} GiB each), predicted:"]
    for candidate in best:
        enabled = candidate.overrides[0][len("+plugins=["):-1].split(",")
        chosen = {o.partition("=")[0] for o in candidate.overrides[1:]}
        # The user's own settings stay, those of a plugin the plan leaves out or sets otherwise excepted, and those
        # that would do nothing in it (ac's every beside a mode other than selective_layer), which run refuses.
        kept = [o for o in overrides if not o.startswith(("+plugins", "plugins.")) or (
            o.startswith("plugins.") and o.split(".")[1] in enabled and o.partition("=")[0] not in chosen
            and o.partition("=")[0] not in candidate.inert)]
        lines.append(f"  {candidate.tokens_per_device:,.0f} tokens/s/device, {candidate.memory_gib:.1f} GiB: "
                     f"python -m titan_core.run {' '.join([*kept, *candidate.overrides])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Plan a job before launch: memory per rank, step time and tokens/s on a given accelerator."""
    try:
        print(plan_costs(sys.argv[1:] if argv is None else argv))
    except ConfigError as error:
        print(f"titan-core: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:  # Ctrl-C while planning or calibrating: nothing was written
        print("titan-core: stopped by SIGINT; nothing written", file=sys.stderr)
        sys.exit(exit_code(signal.SIGINT))
