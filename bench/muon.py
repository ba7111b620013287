"""Muon across data-parallel ranks: each rank's Newton–Schulz work and traffic as dp grows, and the step against AdamW's.

    flock /tmp/titan-cpu.lock python bench/muon.py [--worlds 1 2 4 8] [--steps 6]

For each world, the same model, data and global batch under FSDP, once with Muon and once with the core's AdamW.
Newton–Schulz GFLOP and MiB received are the busiest rank's in one step, counted by the optimizer (they do not
depend on the machine); step times are medians over the steps after the first, on this shared CPU, so compare
the ratios of one run only. Nothing here is a GPU figure.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from titan_core.testing import run_job


def measure(common: list[str], world: int, muon: bool, run_dir: Path) -> dict:
    plugins = "fsdp,muon" if muon else "fsdp"
    metrics = run_job([*common, f"+plugins=[{plugins}]", f"plugins.fsdp.degree={world}"], run_dir).metrics
    return {"step_s": statistics.median(m["step_time_s"] for m in metrics[1:]), **metrics[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="debug", help="a model config name (debug: dim 256, 6 layers)")
    args = parser.parse_args()
    common = [f"model={args.model}", f"training.steps={args.steps}", "training.seq_len=128",
              "training.global_batch_size=8", "metrics.log_every=1", "metrics.tensorboard=false",
              "metrics.peak_tflops=1", "launch.device=cpu"]
    print(f"model {args.model}, FSDP over dp ranks, {args.steps} steps; per step, on the busiest rank:")
    print(f"  {'dp':>3} {'NS GFLOP':>9} {'NS share':>9} {'MiB received':>13} {'step Muon / AdamW':>18}")
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            muon = measure(common, world, True, Path(tmp) / f"muon{world}")
            adamw = measure(common, world, False, Path(tmp) / f"adamw{world}")
            print(f"  {world:>3} {muon['muon_ns_gflop_busiest']:>9.3f} {muon['muon_ns_busiest_share']:>9.2f} "
                  f"{muon['muon_received_mib_busiest']:>13.2f} {muon['step_s'] / adamw['step_s']:>17.2f}x")


if __name__ == "__main__":
    main()
