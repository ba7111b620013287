"""Float8 training (torchao): chosen Linear layers compute their matmuls in float8 with dynamic scales.

Conversion happens on the meta model, before any parallelism, so TP and FSDP see the float8 modules.
Left in high precision: the output layer (its logits are the most precision-sensitive), any layer a
``filter_fqns`` entry matches, and layers whose dimensions the float8 matmul cannot tile (multiples
of 16 for Float8Linear, of the 32-element scaling block for MXFP8).

With ``fsdp_float8_all_gather`` the FSDP all-gather sends float8 weights (half the bytes of bf16);
their scales are then computed for all layers at once after each optimizer step, in one all-reduce.
"""

import dataclasses
import importlib.util

import torch
from torch import nn

from titan_core import ConfigError, Declaration, hookimpl
from titan_core.model import canonical_name

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MXFP8_RECIPES = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8_emulated_rceil")
MXFP8_NEEDS_TRITON = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp")  # torchao's CUDA cast kernels
ALWAYS_SKIPPED = ("output",)


@hookimpl
def declare():
    return Declaration()


@hookimpl
def validate(plugin_config, plan):
    recipe = plugin_config.recipe
    if recipe not in FLOAT8_RECIPES + MXFP8_RECIPES:
        raise ConfigError("plugins.float8.recipe", f"unknown recipe '{recipe}'",
                          f"use one of {', '.join(FLOAT8_RECIPES + MXFP8_RECIPES)}")
    if recipe in MXFP8_NEEDS_TRITON and not (torch.cuda.is_available() and importlib.util.find_spec("triton")):
        raise ConfigError("plugins.float8.recipe", f"{recipe} needs a CUDA device with triton (torchao's MXFP8 "
                          "cast kernels), and this machine has none", "use recipe=mxfp8_emulated_rceil here")
    if plugin_config.fsdp_float8_all_gather:
        if recipe != "tensorwise":
            raise ConfigError("plugins.float8.fsdp_float8_all_gather", f"needs recipe=tensorwise, not {recipe} "
                              "(only one scale per tensor can be applied before the all-gather)",
                              "set recipe=tensorwise or fsdp_float8_all_gather=false")
        if not any("data_parallel_sharding" in p.declaration.provides for p in plan.plugins):
            raise ConfigError("plugins.float8.fsdp_float8_all_gather", "no enabled plugin shards parameters "
                              "over data-parallel ranks, so there is no all-gather", "enable fsdp or set it to false")


@hookimpl
def convert_float8(model, config):
    options = config.plugins.float8
    if options.recipe in MXFP8_RECIPES:
        convert_mxfp8(model, options.recipe, options.filter_fqns)
    else:
        convert_float8_linears(model, options.recipe, options.filter_fqns, options.fsdp_float8_all_gather)


def convert_float8_linears(model: nn.Module, recipe: str, filter_fqns, fsdp_float8_all_gather: bool) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    float8_config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:
        float8_config = dataclasses.replace(float8_config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=float8_config,
                               module_filter_fn=lambda module, fqn: converts(module, fqn, filter_fqns, 16))


def convert_mxfp8(model: nn.Module, recipe: str, filter_fqns) -> None:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe)),
              filter_fn=lambda module, fqn: converts(module, fqn, filter_fqns, 32))


def converts(module: nn.Module, fqn: str, filter_fqns, multiple: int) -> bool:
    """Whether the Linear ``module`` named ``fqn`` is converted; other modules never are."""
    if not isinstance(module, nn.Linear):
        return False
    name = canonical_name(fqn)
    if name in ALWAYS_SKIPPED or any(skipped in name for skipped in filter_fqns):
        return False
    return module.in_features % multiple == 0 and module.out_features % multiple == 0


@hookimpl
def after_optimizer_step(model_parts, config):
    if config.plugins.float8.fsdp_float8_all_gather:
        from torch.distributed.fsdp import FSDPModule
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            # The scales belong to FSDP's float8 all-gather; only FSDP2 modules carry it.
            if isinstance(part, FSDPModule):
                precompute_float8_dynamic_scale_for_fsdp(part)
