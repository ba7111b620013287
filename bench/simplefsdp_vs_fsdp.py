"""Step time and memory of SimpleFSDP against FSDP2, same model, data and world, one run of each.

    flock /tmp/titan-cpu.lock python bench/simplefsdp_vs_fsdp.py [--world 2] [--compile]

Step time is the median over the steps after the first (which holds compilation and warm-up).
Memory is rank 0's peak: allocated CUDA memory on GPUs, resident set size on the CPU, where the
interpreter and torch themselves take most of it, so the CPU ratio understates the difference in
model state. Nothing here is a GPU figure.
"""

import statistics
import tempfile
from pathlib import Path

from paired_runs import paired_arguments, paired_job

from titan_core.testing import run_job


def measure(plugins: list[str], world: int, common: list[str], run_dir: Path) -> dict:
    sharder = plugins[0]
    result = run_job([*common, f"+plugins=[{','.join(plugins)}]", f"plugins.{sharder}.degree={world}"], run_dir)
    metrics = result.metrics
    return {"step_s": statistics.median(m["step_time_s"] for m in metrics[1:]),
            "first_step_s": metrics[0]["step_time_s"],
            "memory_gib": max(m["memory_gib"] for m in metrics),
            "final_loss": metrics[-1]["loss"]}


def main() -> None:
    args = paired_arguments(__doc__.splitlines()[0], world=2)
    common = paired_job(args, seq_len=128)
    extra = ["compile"] if args.compile else []
    with tempfile.TemporaryDirectory() as tmp:
        fsdp = measure(["fsdp", *extra], args.world, common, Path(tmp) / "fsdp")
        simple = measure(["simplefsdp", *extra], args.world, common, Path(tmp) / "simplefsdp")
    print(f"model {args.model}, world {args.world}, {args.steps} steps{', compiled' if args.compile else ', eager'}")
    for name, r in (("fsdp (FSDP2)", fsdp), ("simplefsdp", simple)):
        print(f"  {name:<13} step {r['step_s'] * 1e3:7.1f} ms (first {r['first_step_s']:.1f} s)  "
              f"peak memory {r['memory_gib']:.3f} GiB  final loss {r['final_loss']:.6f}")
    print(f"  simplefsdp / fsdp: step time {simple['step_s'] / fsdp['step_s']:.2f}x, "
          f"peak memory {simple['memory_gib'] / fsdp['memory_gib']:.2f}x, "
          f"final loss diff {abs(simple['final_loss'] - fsdp['final_loss']):.1e}")


if __name__ == "__main__":
    main()
