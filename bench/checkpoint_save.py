"""How long saving a checkpoint holds up the training loop: synchronous against asynchronous saves.

    flock /tmp/titan-cpu.lock python bench/checkpoint_save.py [--steps 30] [--interval 5]

Three runs of the debug Llama on one process, one after the other: without checkpoints, saving the
whole training state every ``interval`` steps synchronously, and asynchronously (the state is copied
to memory, a background thread writes it). A step's logged time includes the save it triggered, so
(mean step time - mean without saves) x interval is what one save holds up the loop. On 2 CPU cores
the background writer competes with training for the cores, which a GPU job would not. Not a test:
this machine is shared and noisy, so compare figures from one run only.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from titan_core.testing import run_job


def mean_step(overrides: list[str], run_dir: Path) -> float:
    result = run_job(overrides, run_dir)
    return statistics.mean(m["step_time_s"] for m in result.metrics[1:])  # after the first (warm-up)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=31)
    parser.add_argument("--interval", type=int, default=5)
    args = parser.parse_args()
    common = [f"training.steps={args.steps}", "metrics.log_every=1", "metrics.tensorboard=false"]
    saving = ["+plugins=[checkpoint]", f"plugins.checkpoint.interval={args.interval}", "plugins.checkpoint.keep_latest_k=2"]
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        plain = mean_step(common, scratch / "plain")
        sync = mean_step([*common, *saving], scratch / "sync")
        asynchronous = mean_step([*common, *saving, "plugins.checkpoint.async_save=true"], scratch / "async")
    print(f"mean step without saves {plain:.3f} s; loop held up per save: synchronous "
          f"{(sync - plain) * args.interval:.3f} s, asynchronous {(asynchronous - plain) * args.interval:.3f} s "
          f"(async/sync {(asynchronous - plain) / (sync - plain):.2f})")


if __name__ == "__main__":
    main()
