"""Two replica groups on the built-in data: every step synchronous, LocalSGD and DiLoCo, their losses side by side.

    flock /tmp/titan-cpu.lock python bench/ft_semi_sync.py [--steps 200] [--sync-every 20] [--plot docs/plugins/ft_semi_sync.png]

Each mode runs groups 0 and 1 of the ft plugin (one process each, torchft's lighthouse in this process) on the same
global batch; a step's loss is the mean of the two groups' (each its own rows). Prints the mean loss over the last
fifth of the steps of each mode and its ratio to sync's; with ``--plot``, writes the curves (matplotlib).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import titan_ft  # noqa: F401  (quiets torchft's Rust logs, before torchft is imported)
from torchft._torchft import LighthouseServer

MODES = ("sync", "local_sgd", "diloco")


def run_groups(common: list[str], mode: str, address: str, folder: Path) -> list[float]:
    """Both groups of ``mode`` to the end; the mean of their losses, step by step."""
    jobs = [subprocess.Popen([sys.executable, "-m", "titan_core.run", *common, f"plugins.ft.mode={mode}",
                              f"plugins.ft.lighthouse={address}", f"plugins.ft.replica_group={index}",
                              f"hydra.run.dir={folder / f'{mode}{index}'}"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for index in (0, 1)]
    for job in jobs:
        _, errors = job.communicate()
        if job.returncode:
            sys.exit(f"{mode}: a group exited {job.returncode}: {errors[-2000:]}")
    losses = [[json.loads(line)["loss"] for line in (folder / f"{mode}{index}" / "metrics.jsonl").open()]
              for index in (0, 1)]
    return [(a + b) / 2 for a, b in zip(*losses)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--model", default="debug", help="a model config name (debug: dim 256, 6 layers)")
    parser.add_argument("--plot", type=Path, help="write the loss curves here (a .png)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    common = [f"model={args.model}", f"training.steps={args.steps}", "training.seq_len=128",
              "training.global_batch_size=8", "metrics.log_every=1", "metrics.tensorboard=false",
              "metrics.peak_tflops=1", "launch.device=cpu", "+plugins=[ft]"]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=1000)
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            every = [] if mode == "sync" else [f"plugins.ft.sync_every={args.sync_every}"]
            curves[mode] = run_groups([*common, *every], mode, lighthouse.address(), Path(tmp))
    lighthouse.shutdown()
    tail = max(1, args.steps // 5)
    base = sum(curves["sync"][-tail:]) / tail
    print(f"model {args.model}, 2 groups, {args.steps} steps, sync_every {args.sync_every}; "
          f"mean loss over the last {tail} steps:")
    for mode, losses in curves.items():
        mean = sum(losses[-tail:]) / tail
        print(f"  {mode:<10} {mean:.4f}  ({mean / base:.3f}x sync's)")
    if args.plot:
        matplotlib.use("Agg")
        figure, axes = plt.subplots(figsize=(7, 4))
        for mode, losses in curves.items():
            axes.plot(range(1, len(losses) + 1), losses, label=mode, linewidth=1)
        axes.set_xlabel("step")
        axes.set_ylabel("training loss (mean of 2 groups)")
        axes.set_title(f"2 replica groups, {args.model} model, built-in data; sync_every={args.sync_every}")
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
