"""``python -m titan_core.planner --recommend``: the fastest plans that fit a cluster, as command lines.

The candidates are the plugins the command line enables: each says, through its ``plan_options`` hook, which
settings are worth trying on this cluster (and whether it may be left out). Every combination is checked as
``run`` would check it (a plan a plugin refuses is dropped), estimated, kept if it fits the devices' memory,
and ranked by predicted tokens/s/device. The core knows no plugin: a third party's options are tried as ours.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from omegaconf import OmegaConf

from titan_core.errors import ConfigError
from titan_core.job.checks import check_job
from titan_core.planner.costs import PRICING, estimate, on_hardware
from titan_core.planner.estimate import GIB
from titan_core.planner.hardware import Hardware
from titan_core.plugins import Registry, build_plan, enabled_plugin_names


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # what the plan sets, as command-line overrides
    tokens_per_device: float
    memory_gib: float
    inert: frozenset[str] = frozenset()  # the options that would do nothing in this plan (Declaration.acts_only)


def candidate_overrides(choice: dict[str, dict | None]) -> tuple[str, ...]:
    """``+plugins=[...]`` and the options of a choice ``{plugin: options, or None when left out}``."""
    kept = {name: options for name, options in choice.items() if options is not None}
    return (f"+plugins=[{','.join(kept)}]",
            *(f"plugins.{name}.{key}={_value(value)}" for name, options in kept.items() for key, value in options.items()))


def _value(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def recommend(config, hardware: Hardware, vocab_size: int, expert_load: float = 1.0,
              expert_load_peak: float | None = None, top: int = 5) -> tuple[list[Candidate], int]:
    """The ``top`` fitting plans by predicted tokens/s/device (experts routed as unevenly as ``expert_load`` and
    ``expert_load_peak`` say), and how many combinations were tried."""
    world = config.launch.world_size
    if not world:
        raise ConfigError("launch.world_size", "--recommend plans for a cluster and needs its size",
                          "set launch.world_size=<devices in the cluster>")
    names = enabled_plugin_names(config)
    if not names:
        raise ConfigError("plugins", "--recommend chooses among the plugins the command line enables, and it "
                          "enables none", "list the candidates, e.g. +plugins=[fsdp,tp,pp,ac,compile,float8]")
    config = on_hardware(config, hardware)
    registry = Registry(config)
    registry.open_room(PRICING)
    model = registry.describe_model(config, vocab_size)
    alternatives = {name: registry.call(name, "plan_options", config=config, plugin_config=config.plugins[name],
                                        model=model, world_size=world, hardware=hardware) or [{}] for name in names}
    combinations = [dict(zip(alternatives, values)) for values in itertools.product(*alternatives.values())]
    traced: dict = {}  # the model's facts, measured once for every candidate
    estimated = (_estimated(config, choice, registry, hardware, vocab_size, traced, expert_load, expert_load_peak)
                 for choice in combinations)
    fitting = [c for c in estimated if c is not None and c.memory_gib <= hardware.usable_gib]
    return sorted(fitting, key=lambda c: -c.tokens_per_device)[:top], len(combinations)


def _estimated(config, choice: dict, registry: Registry, hardware: Hardware, vocab_size: int,
               traced: dict, expert_load: float, expert_load_peak: float | None) -> Candidate | None:
    values = OmegaConf.to_container(config)
    values["plugins"] = {name: {**values["plugins"][name], **options} for name, options in choice.items()
                         if options is not None}
    job = OmegaConf.create(values)
    try:
        plan = build_plan(job, registry, None, vocab_size)
        check_job(job, plan)
        result = estimate(job, plan, registry, hardware, traced=traced, expert_load=expert_load,
                          expert_load_peak=expert_load_peak)
    except ConfigError as error:
        if error.field in ("model.name", "--expert-load", "--expert-load-peak"):  # the model itself cannot be planned: no candidate can
            raise
        return None  # a plan some plugin or the core refuses is not a candidate
    rank = result.most_loaded()
    inert = frozenset(f"plugins.{p.name}.{option}" for p in plan.plugins
                      for option, (_, acts) in p.declaration.acts_only.items() if not acts(job.plugins[p.name], job))
    return Candidate(candidate_overrides(choice), rank.tokens_per_device(), sum(rank.memory().values()) / GIB, inert)
