"""Turn a checkpoint's weights into one torch file or a Hugging Face folder, on one process.

    python -m titan_checkpoint.convert outputs/<run>/checkpoints/step-200 model.pt
    python -m titan_checkpoint.convert outputs/<run>/checkpoints/step-200 hf-out --format hf --dtype bfloat16

The model's shape comes from the run's ``config.yaml`` (two folders above the checkpoint, or
``--config``). Every tensor is gathered whole into this process's memory: it needs as much RAM as
the model has bytes in the chosen dtype. (A run's own export, ``export_hf``, splits the work over its ranks.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors.torch import save_file as save_safetensors

from titan_core import FLOAT_DTYPES, ConfigError, HFAdapter, ModelDescription, lacks, load_tokenizer, model_description
from titan_checkpoint.files import Deletions, partial_of, save_file, swap_in
from titan_checkpoint.hf import file_names, file_tensor, write_hf_index
from titan_checkpoint.state import allocate, read_metadata


def read_model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Full tensors of every model parameter, by canonical name."""
    tensors = allocate(read_metadata(checkpoint), "model.")
    load_in_this_process(tensors, checkpoint)
    return {k[len("model."):]: v for k, v in tensors.items()}


def load_in_this_process(tensors: dict[str, torch.Tensor], checkpoint: Path) -> None:
    """Fill ``tensors`` from the checkpoint without collectives (each rank of an export reads its own share)."""
    with warnings.catch_warnings():
        # DCP warns that it loads "in a single process": what this asks of it.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=str(checkpoint), no_dist=True)


def export_shares(metadata: dict, ranks: int) -> list[list[str]]:
    """The model tensors of a checkpoint split over ``ranks`` writers by bytes, largest first to the least
    loaded (each rank computes the same split from the same metadata)."""
    sizes = {k: m.size.numel() * m.properties.dtype.itemsize for k, m in metadata.items() if k.startswith("model.")}
    shares: list[list[str]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        least = loads.index(min(loads))
        shares[least].append(name)
        loads[least] += sizes[name]
    return [share for share in shares if share]


def write_hf_share(checkpoint: Path, folder: Path, dtype: torch.dtype, metadata: dict, adapter: HFAdapter,
                   rank: int, ranks: int) -> tuple[dict[str, str], int, int]:
    """Write rank ``rank``'s share of the checkpoint's weights as one safetensors file of the folder, reading
    only those tensors. Returns the whole folder's weight map and size in ``dtype`` (the same on every rank),
    and the bytes this rank read."""
    shares = export_shares(metadata, ranks)
    files = file_names(len(shares))
    weight_map = {adapter.to_hf(k[len("model."):]): file for share, file in zip(shares, files) for k in share}
    total = sum(metadata[k].size.numel() for share in shares for k in share) * dtype.itemsize
    if rank >= len(shares):  # more ranks than tensors
        return weight_map, total, 0
    tensors = allocate({k: metadata[k] for k in shares[rank]}, "model.")
    load_in_this_process(tensors, checkpoint)
    save_safetensors({adapter.to_hf(k[len("model."):]): file_tensor(adapter, k[len("model."):], t.to(dtype))
                      for k, t in tensors.items()},
                     folder / files[rank], metadata={"format": "pt"})
    return weight_map, total, sum(t.nbytes for t in tensors.values())


def hf_adapter(config, description: ModelDescription | None) -> HFAdapter:
    description = description or model_description(config, load_tokenizer(config.tokenizer).vocab_size)
    if description.hf is None:
        raise ConfigError("model.name", lacks(description, "hf", "Hugging Face export"), "export --format torch")
    return description.hf


def export_hf_from_checkpoint(checkpoint: Path, target: Path, dtype: torch.dtype, config,
                              description: ModelDescription | None = None) -> None:
    """Write the checkpoint's weights as a Hugging Face folder, with the run's tokenizer.json if it has one."""
    adapter = hf_adapter(config, description)
    target.mkdir(parents=True, exist_ok=True)
    metadata = read_metadata(checkpoint)
    weight_map, total, _ = write_hf_share(checkpoint, target, dtype, metadata, adapter, 0, 1)
    write_hf_index(target, weight_map, total, adapter, dtype, config.tokenizer)


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
            deletions = Deletions()
            swap_in(partial_of(args.output), args.output, deletions)
            deletions.close()
        except ConfigError as error:
            sys.exit(f"titan-checkpoint: error: {error}")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
