"""Step time of every pipeline schedule, measured by one Hydra multirun of the real command line.

    python bench/pp_schedules.py [--sweep-dir DIR] [override ...]

Each schedule trains the same model on the same batches; the table gives the median and the fastest
``step_time_s`` of ``metrics.jsonl`` after the warm-up steps. Extra arguments are Hydra overrides
(e.g. ``plugins.pp.degree=4 model.n_layers=16``). On a shared machine run it alone
(``flock /tmp/titan-cpu.lock python bench/pp_schedules.py``): the figures are wall-clock times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# 8 blocks give 2 stages per rank at pp 2 for the looped and V schedules; 4 micro-batches for every
# schedule so that they differ only in their order of work.
DEFAULTS = ("model=debug", "model.n_layers=8", "tokenizer.path=bytes", "training.seq_len=256",
            "training.global_batch_size=8", "training.steps=12", "metrics.log_every=1", "metrics.tensorboard=false",
            "plugins.pp.degree=2", "plugins.pp.microbatches=4")
WARMUP_STEPS = 2  # the first steps pay for shape inference and allocator growth


def run_sweep(sweep_dir: Path, overrides: list[str]) -> None:
    command = [sys.executable, "-m", "titan_core.run", "-m", "+plugins=[pp]",
               f"plugins.pp.schedule={','.join(SCHEDULES)}", *DEFAULTS, *overrides, f"hydra.sweep.dir={sweep_dir}"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def step_times(job_dir: Path) -> tuple[str, list[float]]:
    schedule = OmegaConf.load(job_dir / "config.yaml").plugins.pp.schedule
    metrics = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return schedule, [m["step_time_s"] for m in metrics[WARMUP_STEPS:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep-dir", type=Path, default=None)
    args, overrides = parser.parse_known_args()
    sweep_dir = args.sweep_dir or Path(tempfile.mkdtemp(prefix="pp_schedules_"))
    run_sweep(sweep_dir, overrides)
    jobs = sorted((d for d in sweep_dir.iterdir() if d.name.isdigit()), key=lambda d: int(d.name))
    print(f"{'schedule':<22} {'median s/step':>14} {'fastest':>9}   ({sweep_dir})")
    for schedule, times in map(step_times, jobs):
        print(f"{schedule:<22} {statistics.median(times):>14.4f} {min(times):>9.4f}")


if __name__ == "__main__":
    main()
