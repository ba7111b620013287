"""Does a long run stay flat? Resident memory and step time of the first and the last hundred steps.

    python bench/long_run.py                         # 1,000 steps of the tiny Llama, saving every 50
    python bench/long_run.py --steps 2000 -- +plugins=[fsdp,checkpoint] plugins.fsdp.degree=2

A leak anywhere in a step (data loader, metrics, optimizer state, checkpoint saves, collectives) shows as
resident memory or step time that grows with training progress. The run logs every 10 steps; each logged
line carries the process's peak resident memory and the mean step time since the previous line. Peak,
not current, memory: a save's temporary buffers raise it once, early (the first saves fall in the first
hundred steps), while a leak raises it again and again. Prints both windows and their ratios. Not a
test: step time on this shared machine is noisy, so read the ratio of one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from titan_core.testing import TINY, run_job

WINDOW = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("overrides", nargs="*", help="overrides replacing the default stack (tiny Llama, saving every 50)")
    args = parser.parse_args()
    if args.steps < 3 * WINDOW:
        parser.error(f"--steps must be at least {3 * WINDOW}: two windows of {WINDOW} and a gap between them")
    stack = args.overrides or ["+plugins=[checkpoint]", "plugins.checkpoint.interval=50", "plugins.checkpoint.keep_latest_k=2"]
    with tempfile.TemporaryDirectory() as scratch:
        result = run_job([*TINY, f"training.steps={args.steps}", "metrics.log_every=10",
                          "testing.save_final_weights=false", *stack], Path(scratch) / "run", timeout=3600)
        metrics = result.metrics  # read from the run dir, before it goes
    logged = [m for m in metrics if m["step"] > 10]  # the first line includes start-up and compilation
    first = [m for m in logged if m["step"] <= WINDOW + 10]
    last = [m for m in logged if m["step"] > args.steps - WINDOW]
    memory = (max(m["memory_gib"] for m in first), max(m["memory_gib"] for m in last))
    step_time = (statistics.median(m["step_time_s"] for m in first), statistics.median(m["step_time_s"] for m in last))
    print(f"{args.steps} steps, {' '.join(stack)}")
    print(f"peak resident memory: steps 11-{WINDOW + 10} {memory[0] * 1024:.1f} MiB, last {WINDOW} "
          f"{memory[1] * 1024:.1f} MiB (last/first {memory[1] / memory[0]:.3f})")
    print(f"median step time: steps 11-{WINDOW + 10} {step_time[0] * 1e3:.1f} ms, last {WINDOW} "
          f"{step_time[1] * 1e3:.1f} ms (last/first {step_time[1] / step_time[0]:.3f})")


if __name__ == "__main__":
    main()
