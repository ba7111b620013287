"""PEFT's adapter format: the names of our adapters' tensors in ``adapter_model.safetensors`` (through the model's
Hugging Face names), reading an adapter folder into the model and writing one from it.

PEFT keeps a linear's pair as ``<module>.lora_A.weight`` (rank, in) and ``.lora_B.weight`` (out, rank); an expert
stack's (``target_parameters``) as ``lora_A`` (experts x rank, in) and ``lora_B`` (out, rank x experts).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from titan_core import (ADAPTER_FILES, CP, DP_REPLICATE, DP_SHARD, PEFT_PREFIX, TP, ConfigError, HFAdapter,
                        ModelDescription, uncomputed_field)

from titan_lora.adapters import FIELD, adapters, copy_box, expert_adapters

log = logging.getLogger("titan_core")


def hf_names(description: ModelDescription) -> HFAdapter:
    """The model's Hugging Face names, through which PEFT names the adapters."""
    # validate refuses to read or write a PEFT adapter for a model without them (ModelDescription.hf)
    assert description.hf is not None
    return description.hf


def peft_name(adapter: str, which: str, description: ModelDescription) -> str:
    """PEFT's file name of an adapter's ``lora_A``/``lora_B`` weight (through the model's Hugging Face names)."""
    return PEFT_PREFIX + hf_names(description).to_hf(f"{adapter}.weight").removesuffix(".weight") + f".{which}.weight"


def peft_stack_name(experts: str, stacks: tuple[str, ...], stack: str, which: str,
                    description: ModelDescription) -> str:
    """PEFT's file name of a stacked linear's ``lora_A``/``lora_B``: PEFT wraps the module once per adapted
    stack, the first listed innermost, so each earlier stack sits one ``base_layer`` deeper."""
    module = hf_names(description).to_hf(f"{experts}.{stack}").rpartition(".")[0]
    depth = len(stacks) - 1 - stacks.index(stack)
    return PEFT_PREFIX + module + ".base_layer" * depth + f".{which}.weight"


def peft_stack_target(experts: str, stack: str, description: ModelDescription) -> str:
    """The block-relative Hugging Face path of a stacked linear (PEFT's ``target_parameters`` entry)."""
    index = experts.removeprefix(f"{description.blocks}.").split(".", 1)[0]
    return hf_names(description).to_hf(f"{experts}.{stack}").split(f".{index}.", 1)[1]


def to_peft_stack(factor: torch.Tensor, which: str) -> torch.Tensor:
    """Our (experts, rank, in) A as PEFT's (experts x rank, in); our (experts, out, rank) B as its (out, rank x
    experts), whose column ``i * experts + e`` is expert e's i-th."""
    if which == "lora_A":
        return factor.reshape(-1, factor.shape[-1])
    return factor.permute(1, 2, 0).reshape(factor.shape[1], -1)


def from_peft_stack(stored: torch.Tensor, which: str, count: int) -> torch.Tensor:
    if which == "lora_A":
        return stored.reshape(count, -1, stored.shape[-1])
    return stored.reshape(stored.shape[0], -1, count).permute(2, 0, 1)


def read_peft_config(folder: Path) -> dict:
    for file in ADAPTER_FILES:
        if not (folder / file).is_file():
            raise ConfigError(f"{FIELD}.init_from", f"{folder} has no {file}", "point it at a PEFT adapter folder")
    return json.loads((folder / "adapter_config.json").read_text())


def check_peft_config(peft: dict, options, folder: Path) -> None:
    """A PEFT adapter is read only into adapters of its own rank and scale, and only when every field that changes its
    math is one titan-core's adapters compute."""
    uncomputed = uncomputed_field(peft, folder)
    if uncomputed:
        raise ConfigError(f"{FIELD}.init_from", uncomputed, "start from a plain LoRA adapter, or merge this one into "
                          "its base with PEFT (merge_and_unload, save_pretrained) and train from the merged folder")
    mine = {"r": options.rank, "lora_alpha": options.alpha, "use_rslora": options.rslora}
    for key, value in mine.items():
        if peft.get(key, False if key == "use_rslora" else None) != value:
            option = {"r": "rank", "lora_alpha": "alpha", "use_rslora": "rslora"}[key]
            raise ConfigError(f"{FIELD}.{option}", f"{value!r} disagrees with {peft.get(key)!r} in "
                              f"{folder / 'adapter_config.json'}", f"set {FIELD}.{option}={peft.get(key)}")


@torch.no_grad()
def read_peft(model_parts, folder: Path, description: ModelDescription) -> None:
    with safe_open(folder / "adapter_model.safetensors", "pt") as file:
        for name, linear in adapters(model_parts).items():
            for which in ("lora_A", "lora_B"):
                copy_box(getattr(linear, which).weight, file.get_tensor(peft_name(name, which, description)))
        for name, experts in expert_adapters(model_parts).items():
            assert description.experts is not None  # only a model describing its experts has them adapted
            for stack in experts.lora_stacks:
                for which in ("lora_A", "lora_B"):
                    stored = file.get_tensor(peft_stack_name(name, experts.lora_stacks, stack, which, description))
                    copy_box(getattr(experts, f"{stack}_{which}"),
                             from_peft_stack(stored, which, description.experts.count))


def writes_for_its_stage(mesh) -> bool:
    """Whether this rank speaks for its pipeline stage: the first of the ranks holding the same parameters."""
    return mesh.local_rank(DP_REPLICATE, DP_SHARD, CP, TP) == 0


def export_peft(model_parts, folder: Path, options, description: ModelDescription, base: str | None, mesh) -> None:
    """Write the adapters as PEFT's ``adapter_model.safetensors`` and ``adapter_config.json`` (rank 0 writes;
    each pipeline stage's first rank sends its own)."""
    linears = {peft_name(name, which, description): full(getattr(linear, which).weight)
               for name, linear in adapters(model_parts).items() for which in ("lora_A", "lora_B")}
    adapted_experts = expert_adapters(model_parts)
    stacks = {peft_stack_name(name, experts.lora_stacks, stack, which, description):
              to_peft_stack(full(getattr(experts, f"{stack}_{which}")), which)
              for name, experts in adapted_experts.items()
              for stack in experts.lora_stacks for which in ("lora_A", "lora_B")}
    targets = [peft_stack_target(name, stack, description) for name, experts in adapted_experts.items()
               for stack in experts.lora_stacks]
    gathered: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str]] | None]
    gathered = [None] * dist.get_world_size()
    dist.gather_object((linears, stacks, targets) if writes_for_its_stage(mesh) else None,
                       gathered if dist.get_rank() == 0 else None)
    if dist.get_rank() != 0:
        return
    shares = [share for share in gathered if share]
    linears = {name: tensor for share in shares for name, tensor in share[0].items()}
    stacks = {name: tensor for share in shares for name, tensor in share[1].items()}
    targets = list(dict.fromkeys(target for share in shares for target in share[2]))  # in the stacks' order
    modules = sorted({name.rsplit(".", 3)[1] for name in linears})  # <module>.lora_A.weight
    folder.mkdir(parents=True, exist_ok=True)
    save_file(linears | stacks, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": options.rank,
        "lora_alpha": options.alpha, "lora_dropout": options.dropout, "use_rslora": options.rslora,
        "target_modules": modules, "target_parameters": targets or None, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True}, indent=2))
    log.info("LoRA adapters of %d linears and %d expert stacks written to %s (PEFT format)", len(linears) // 2,
             len(stacks) // 2, folder)


def full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a collective over the ranks sharing a sharded one)."""
    whole = param.full_tensor() if hasattr(param, "full_tensor") else param
    return whole.detach().to("cpu", torch.float32).contiguous()
