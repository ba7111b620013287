"""Turn a checkpoint's weights into one torch file or a Hugging Face folder, on one process.

    python -m titan_checkpoint.convert outputs/<run>/checkpoints/step-200 model.pt
    python -m titan_checkpoint.convert outputs/<run>/checkpoints/step-200 hf-out --format hf --dtype bfloat16

The model's shape comes from the run's ``config.yaml`` (two folders above the checkpoint, or
``--config``). Every tensor is gathered whole into this process's memory: it needs as much RAM as
the model has bytes in the chosen dtype.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from titan_core import ConfigError
from titan_core.data import load_tokenizer, tokenizer_file
from titan_core.description import ModelDescription, lacks
from titan_core.options import FLOAT_DTYPES
from titan_core.plan import model_description
from titan_checkpoint.files import partial_of, save_file, swap_in
from titan_checkpoint.hf import export_hf
from titan_checkpoint.state import allocate, read_metadata


def read_model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Full tensors of every model parameter, by canonical name."""
    tensors = allocate(read_metadata(checkpoint), "model.")
    dcp.load(tensors, checkpoint_id=str(checkpoint), no_dist=True)
    return {k[len("model."):]: v for k, v in tensors.items()}


def export_hf_from_checkpoint(checkpoint: Path, target: Path, dtype: torch.dtype, config,
                              description: ModelDescription | None = None) -> None:
    """Write the checkpoint's weights as a Hugging Face folder, with the run's tokenizer.json if it has one."""
    description = description or model_description(config, load_tokenizer(config.tokenizer).vocab_size)
    if description.hf is None:
        raise ConfigError("model.name", lacks(description, "hf", "Hugging Face export"), "export --format torch")
    export_hf(read_model_weights(checkpoint), description.hf, target, dtype, tokenizer_file(config.tokenizer))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m titan_checkpoint.convert", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step-N or weights-step-N folder")
    parser.add_argument("output", type=Path, help="the .pt file, or the folder for --format hf")
    parser.add_argument("--format", choices=("torch", "hf"), default="torch")
    parser.add_argument("--dtype", choices=tuple(FLOAT_DTYPES), default="float32")
    parser.add_argument("--config", type=Path, help="the run's config.yaml (default: two folders up)")
    args = parser.parse_args(argv)
    if not (args.checkpoint / ".metadata").is_file():
        parser.error(f"{args.checkpoint} is not a complete checkpoint (it has no .metadata)")
    dtype = FLOAT_DTYPES[args.dtype]
    if args.format == "torch":
        save_file({k: v.to(dtype) for k, v in read_model_weights(args.checkpoint).items()}, args.output)
    else:
        config_path = args.config or args.checkpoint.parent.parent / "config.yaml"
        if not config_path.is_file():
            parser.error(f"{config_path} does not exist: pass the run's config.yaml with --config")
        try:
            shutil.rmtree(partial_of(args.output), ignore_errors=True)
            export_hf_from_checkpoint(args.checkpoint, partial_of(args.output), dtype, OmegaConf.load(config_path))
            swap_in(partial_of(args.output), args.output)
        except ConfigError as error:
            sys.exit(f"titan-checkpoint: error: {error}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
