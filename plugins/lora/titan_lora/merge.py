"""Fold a PEFT LoRA adapter into its base model's Hugging Face folder, on one process.

    python -m titan_lora.merge /models/Qwen3-0.6B outputs/<run>/adapter-step-500 qwen3-0.6B-tuned

Every adapted weight becomes ``W + scale * B @ A`` (scale ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA); the
other tensors and files (config.json, tokenizer) are copied. The output is written as ``<out>.partial`` and
renamed when complete. It needs as much memory as the largest safetensors file of the base.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titan_core import EXIT_BAD_INPUT, peft_updates


def check_base(base: Path, adapter: Path, updates: dict[str, torch.Tensor]) -> None:
    """Every weight the adapter changes is in ``base`` with the shape of its update, read from the files' headers
    before anything is written."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            shapes |= {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    trained_on = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    on = f" (it was trained on {trained_on})" if trained_on else ""
    missing = sorted(updates.keys() - shapes.keys())
    if missing:
        raise ValueError(f"{base} lacks the weights the adapter changes (e.g. {missing[0]}): is it the adapter's "
                         f"base{on}?")
    for name, update in sorted(updates.items()):
        if shapes[name] != tuple(update.shape):
            raise ValueError(f"{base}'s {name} is {list(shapes[name])}, the adapter's update of it "
                             f"{list(update.shape)}: {adapter} was trained on another model{on}")


def merge(base: Path, adapter: Path, out: Path) -> int:
    """Write the merged folder; returns how many weights the adapter changed."""
    updates = peft_updates(adapter)
    check_base(base, adapter, updates)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    merged: set[str] = set()
    for file in sorted(base.iterdir()):
        if file.suffix != ".safetensors":
            if file.is_file() and file.name != "config.json":
                shutil.copyfile(file, partial / file.name)
            continue
        with safe_open(file, "pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        for name in tensors.keys() & updates.keys():
            tensors[name] = (tensors[name].double() + updates[name]).to(tensors[name].dtype)
            merged.add(name)
        save_file(tensors, partial / file.name, metadata=metadata)
    shutil.copyfile(base / "config.json", partial / "config.json")  # last: a folder with it is complete
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return len(merged)


def main(argv: list[str] | None = None) -> None:
    """Merge a PEFT LoRA adapter into its base model's Hugging Face folder."""
    parser = argparse.ArgumentParser(prog="python -m titan_lora.merge", description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="the base model's Hugging Face folder")
    parser.add_argument("adapter", type=Path, help="a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)")
    parser.add_argument("out", type=Path, help="the merged folder to write")
    args = parser.parse_args(argv)
    try:
        for folder, file in ((args.base, "config.json"), (args.adapter, "adapter_config.json")):
            if not (folder / file).is_file():
                raise ValueError(f"{folder} has no {file}")
        merged = merge(args.base, args.adapter, args.out)
    except ValueError as error:  # bad input: one line and the launcher's exit code for it, nothing written
        print(f"titan-lora: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    print(f"wrote {args.out} ({merged} weights merged)")


if __name__ == "__main__":
    main()
