"""Step time of each TP / CP / FSDP combination relative to one process, from the real command line.

    python bench/parallel_step_time.py [--out DIR] [override ...]

Every combination trains the same model on the same global batches; the table gives the median
``step_time_s`` of ``metrics.jsonl`` after the warm-up steps and its ratio to the single-process run
(> 1: slower than one process), beside the ratio the planner predicts (``python -m titan_core.planner
--hardware cpu-measured``) and its step time; the errors are of tokens/s, relative to one process and as
printed, the figures of ``titan_core/planner/accuracy.py``'s CPU bands. Extra arguments are Hydra overrides for every run (e.g. ``model=tiny``).
On a shared machine run it alone (``flock /tmp/titan-cpu.lock python bench/parallel_step_time.py``):
the figures are wall-clock times, and several processes share the machine's cores.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from titan_core.planner.cli import job_estimate
from titan_core.planner.hardware import cpu_measured
from titan_core.testing import run_job

COMBINATIONS = {
    "1 process": [],
    "tp 2": ["+plugins=[tp]", "plugins.tp.degree=2"],
    "tp 2, no sequence parallel": ["+plugins=[tp]", "plugins.tp.degree=2", "plugins.tp.sequence_parallel=false"],
    "fsdp 2 x tp 2": ["+plugins=[fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2"],
    "cp 2, allgather": ["+plugins=[cp]", "plugins.cp.degree=2", "plugins.cp.rotate_method=allgather"],
    "cp 2, alltoall": ["+plugins=[cp]", "plugins.cp.degree=2", "plugins.cp.rotate_method=alltoall"],
    "cp 2 x fsdp 2": ["+plugins=[cp,fsdp]", "plugins.cp.degree=2", "plugins.fsdp.degree=2"],
    "tp 2 x cp 2": ["+plugins=[tp,cp]", "plugins.tp.degree=2", "plugins.cp.degree=2"],
    # Eight workers, four to a core of this machine's two.
    "fsdp 8": ["+plugins=[fsdp]", "plugins.fsdp.degree=8"],
    "fsdp 4 x tp 2": ["+plugins=[fsdp,tp]", "plugins.fsdp.degree=4", "plugins.tp.degree=2"],
}
DEFAULTS = ("model=debug", "tokenizer.path=bytes", "training.seq_len=256", "training.global_batch_size=8",
            "training.steps=12", "metrics.log_every=1", "metrics.tensorboard=false", "metrics.peak_tflops=1")
WARMUP_STEPS = 2  # the first steps pay for allocator growth and DTensor's sharding-propagation caches


def median_step_time(overrides: list[str], run_dir: Path) -> float:
    metrics = run_job([*DEFAULTS, *overrides], run_dir).metrics
    return statistics.median(m["step_time_s"] for m in metrics[WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="parallel_step_time_"))
    times = {name: median_step_time([*combination, *overrides], out / str(i))
             for i, (name, combination) in enumerate(COMBINATIONS.items())}
    single = times["1 process"]
    # The planner's prediction of the same ratios, on this CPU as one worker measures it.
    cpu = cpu_measured()
    predicted = {name: job_estimate([*DEFAULTS, *combination, *overrides, "launch.device=cpu"], cpu)[1]
                 .most_loaded().step_seconds()["step"] for name, combination in COMBINATIONS.items()}
    # Errors of tokens/s (predicted / measured - 1, as accuracy.py's bands): relative to one process (what a
    # profile calibrated on one process would show) and as the cpu-measured profile prints them.
    print(f"{'combination':<28} {'median s/step':>14} {'vs 1 process':>13} {'planner':>9} {'error':>7} "
          f"{'planner s/step':>15} {'error':>7}   ({out})")
    relative_errors, printed_errors = [], []
    for name, seconds in times.items():
        planned = predicted[name] / predicted["1 process"]
        relative = (seconds / single) / planned - 1
        printed = seconds / predicted[name] - 1
        printed_errors.append(printed)
        if name != "1 process":
            relative_errors.append(relative)
        print(f"{name:<28} {seconds:>14.4f} {seconds / single:>12.2f}x {planned:>8.2f}x {relative:>+7.0%} "
              f"{predicted[name]:>15.4f} {printed:>+7.0%}")
    for what, errors in (("relative to one process", relative_errors), ("as printed", printed_errors)):
        worst = max(errors, key=abs)
        print(f"tokens/s {what}: mean |error| {statistics.mean(map(abs, errors)):.0%}, worst {worst:+.0%}, "
              f"{len(errors)} plans")


if __name__ == "__main__":
    main()
