"""PEFT's LoRA adapter format, as far as a tool that applies an adapter needs it: which fields of an
``adapter_config.json`` change what the adapter computes beyond what titan-core computes, and the update each adapted
weight of the base receives (``scale * B @ A``, by the base folder's tensor name): for the plugins that read, write
or fold adapters, which may not import each other."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

PEFT_PREFIX = "base_model.model."  # PEFT's prefix of the base model's module names in adapter_model.safetensors
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

# Fields of PEFT's adapter_config.json that do not change what a loaded adapter computes, or that are honoured: r,
# lora_alpha and use_rslora are checked against the options; target_modules and target_parameters through the tensors
# the file holds. Every other field set to anything but PEFT's default is refused by name: a per-module rank or alpha,
# DoRA's magnitudes, saved modules, replicated layers or transposed weights would be loaded wrong, not skipped.
READ_AS_IS = {"task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
              "inference_mode", "r", "lora_alpha", "use_rslora", "target_modules", "target_parameters", "lora_dropout",
              # how the factors were first drawn, which a trained adapter no longer depends on
              "init_lora_weights", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
              # run-time placement, and settings that only apply beside a refused one
              "runtime_config", "megatron_core", "qalora_group_size"}
PEFT_DEFAULTS: tuple = (None, False, {}, [], "none")
WHAT = {"use_dora": "DoRA's magnitude vectors", "rank_pattern": "a rank per module", "alpha_pattern": "an alpha per module",
        "modules_to_save": "whole modules trained beside the adapters", "layer_replication": "replicated layers",
        "fan_in_fan_out": "transposed (Conv1D) weights", "bias": "trained biases", "lora_bias": "a bias on lora_B",
        "layers_to_transform": "adapters on some layers only", "exclude_modules": "modules left out by pattern"}


def uncomputed_field(peft: dict, folder: Path) -> str | None:
    """What an adapter_config.json sets that titan-core's LoRA does not compute, said in a line; None when nothing."""
    for key, value in peft.items():
        if key not in READ_AS_IS and not any(value == default and type(value) is type(default)
                                             for default in PEFT_DEFAULTS):
            what = f" ({WHAT[key]})" if key in WHAT else ""
            return (f"{folder / 'adapter_config.json'} sets {key}={json.dumps(value)}{what}, which titan-core's LoRA "
                    "does not compute")
    return None



def peft_updates(adapter: Path) -> dict[str, torch.Tensor]:
    """``scale * B @ A`` of every weight the adapter in folder ``adapter`` changes, in float64, by the base folder's
    tensor name (scale ``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA). ValueError, in a line, for an adapter
    whose math titan-core does not compute or whose stacked expert weights only PEFT knows how to fold."""
    missing = [file for file in ADAPTER_FILES if not (adapter / file).is_file()]
    if missing:
        raise ValueError(f"{adapter} has no {missing[0]}: is it a PEFT adapter folder?")
    config = json.loads((adapter / "adapter_config.json").read_text())
    uncomputed = uncomputed_field(config, adapter)
    if uncomputed:
        raise ValueError(f"{uncomputed}: merge it with PEFT (PeftModel.merge_and_unload, then save_pretrained)")
    if config.get("target_parameters"):
        # A folder may store an expert stack as one tensor or as every expert's projections apart: only the
        # model's own loader knows which.
        raise ValueError(f"{adapter} adapts stacked expert weights ({config['target_parameters'][0]}, ...), which "
                         "only PEFT folds: merge it with PEFT (PeftModel.merge_and_unload, then save_pretrained)")
    scale = config["lora_alpha"] / (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"])
    tensors = load_file(adapter / "adapter_model.safetensors")
    return {name.removeprefix(PEFT_PREFIX).replace(".lora_A.weight", ".weight"):
            scale * (tensors[name.replace(".lora_A.", ".lora_B.")].double() @ a.double())
            for name, a in tensors.items() if name.endswith(".lora_A.weight")}
