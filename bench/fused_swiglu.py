"""Step time of the fused SwiGLU override against the model's own SwiGLU, same model, data and plan, one run each.

    flock /tmp/titan-cpu.lock python bench/fused_swiglu.py [--world 2] [--compile] [--model debug]

Step time is the median over the steps after the first (which holds compilation and warm-up). On this CPU the
figures are a CPU's: one product of twice the width against two products, and the weights' concatenation.
"""

import statistics
import tempfile
from pathlib import Path

from paired_runs import paired_arguments, paired_job

from titan_core.testing import run_job


def measure(plugins: list[str], world: int, common: list[str], run_dir: Path) -> dict:
    plugins = [*plugins, *(["fsdp"] if world > 1 else [])]
    enabled = [f"+plugins=[{','.join(plugins)}]"] if plugins else []
    sharded = [f"plugins.fsdp.degree={world}"] if world > 1 else []
    metrics = run_job([*common, *enabled, *sharded], run_dir).metrics
    return {"step_s": statistics.median(m["step_time_s"] for m in metrics[1:]), "losses": [m["loss"] for m in metrics]}


def main() -> None:
    args = paired_arguments(__doc__.splitlines()[0], world=1)  # --world: the FSDP degree (1: one process)
    common = paired_job(args, seq_len=256)
    extra = ["compile"] if args.compile else []
    with tempfile.TemporaryDirectory() as tmp:
        plain = measure(extra, args.world, common, Path(tmp) / "plain")
        fused = measure(["overrides", *extra], args.world, common, Path(tmp) / "fused")
    diff = max(abs(a - b) for a, b in zip(plain["losses"], fused["losses"]))
    print(f"model {args.model}, world {args.world}, {args.steps} steps{', compiled' if args.compile else ', eager'}")
    for name, r in (("own SwiGLU", plain), ("fused_swiglu", fused)):
        print(f"  {name:<13} step {r['step_s'] * 1e3:7.1f} ms")
    print(f"  fused / own: step time {fused['step_s'] / plain['step_s']:.2f}x, max loss diff {diff:.1e}")


if __name__ == "__main__":
    main()
