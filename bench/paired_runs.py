"""What the benchmarks comparing two recipes on one model share: their command line and the job both runs train."""

import argparse


def paired_arguments(description: str, world: int) -> argparse.Namespace:
    """``--world`` (default ``world``), ``--steps``, ``--model`` and ``--compile``, parsed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--world", type=int, default=world)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="debug", help="a model config name (debug: dim 256, 6 layers)")
    parser.add_argument("--compile", action="store_true", help="also compile every block, in both runs")
    return parser.parse_args()


def paired_job(args: argparse.Namespace, seq_len: int) -> list[str]:
    """The overrides both runs share: the model, the steps, a small batch, every step logged."""
    return [f"model={args.model}", f"training.steps={args.steps}", f"training.seq_len={seq_len}",
            "training.global_batch_size=8", "metrics.log_every=1", "metrics.tensorboard=false", "metrics.peak_tflops=1"]
