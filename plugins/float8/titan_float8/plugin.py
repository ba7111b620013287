"""Float8 training (torchao): chosen Linear layers compute their matmuls in float8 with dynamic scales.

Conversion happens on the meta model, before any parallelism, so TP and FSDP see the float8 modules.
Left in high precision: the layers the model names in ``ModelDescription.float8_skip`` (typically the
output layer, whose logits are the most precision-sensitive), any layer a ``filter_fqns`` entry matches, and layers whose dimensions the float8 matmul cannot tile (multiples
of 16 for Float8Linear, of the 32-element scaling block for MXFP8).

With ``fsdp_float8_all_gather`` the FSDP all-gather sends float8 weights (half the bytes of bf16);
their scales are then computed for all layers at once after each optimizer step, in one all-reduce.
"""

import dataclasses
import importlib.util
import logging

import torch
from torch import nn

from titan_core import (DATA_PARALLEL_SHARDING, TORCHAO_LOGGERS, ConfigError, Declaration, GatherCasts, canonical_name,
                        cast_gathers, device_kind, hookimpl, library_logs_at_debug)

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
EMULATED_MXFP8 = "mxfp8_emulated_rceil"  # MXFP8's casts computed in high precision: any device, slowly
MXFP8_RECIPES = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", EMULATED_MXFP8)
log = logging.getLogger("titan_core")
MXFP8_NEEDS_TRITON = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp")  # torchao's CUDA cast kernels
BLACKWELL = (10, 0)  # the compute capability whose tensor cores take MXFP8's block scales
FLOAT8_CAPABILITY = (8, 9)  # the first with float8 matmuls (Ada; Hopper is 9.0)
# Module conversions run in stage order: float8 replaces whole linears, so it goes before any conversion at a
# later stage that hangs modules on them (LoRA's adapters, 210), which a replacement would drop.
STAGE = 150


@hookimpl
def declare():
    """float8: its place among the module conversions, before those that build on its linears."""
    return Declaration(stage=STAGE)


@hookimpl
def validate(config, plugin_config, plan):
    """float8: the recipe exists and runs on the job's device (MXFP8's on a Blackwell GPU); float8 all-gathers need
    tensorwise and a sharder."""
    recipe = plugin_config.recipe
    if recipe not in FLOAT8_RECIPES + MXFP8_RECIPES:
        raise ConfigError("plugins.float8.recipe", f"unknown recipe '{recipe}'",
                          f"use one of {', '.join(FLOAT8_RECIPES + MXFP8_RECIPES)}")
    # Planned for a GPU from a machine without one, the GPU's machine is checked for triton when the job runs there.
    here = torch.cuda.is_available()
    if recipe in MXFP8_NEEDS_TRITON and device_kind(config.launch.device) == "cuda" and here:
        check_blackwell(recipe)  # the emulated recipe computes in high precision on any device
    if recipe in MXFP8_NEEDS_TRITON and not (device_kind(config.launch.device) == "cuda"
                                             and (importlib.util.find_spec("triton") or not here)):
        raise ConfigError("plugins.float8.recipe", f"{recipe} needs a CUDA device with triton (torchao's MXFP8 "
                          "cast kernels), and this machine has none", "use recipe=mxfp8_emulated_rceil here")
    if plugin_config.fsdp_float8_all_gather:
        if recipe != "tensorwise":
            raise ConfigError("plugins.float8.fsdp_float8_all_gather", f"needs recipe=tensorwise, not {recipe} "
                              "(only one scale per tensor can be applied before the all-gather)",
                              "set plugins.float8.recipe=tensorwise or plugins.float8.fsdp_float8_all_gather=false")
        if not plan.provides(DATA_PARALLEL_SHARDING):
            raise ConfigError("plugins.float8.fsdp_float8_all_gather", "no enabled plugin shards parameters "
                              "over data-parallel ranks, so there is no all-gather", "enable fsdp or set it to false")


def check_blackwell(recipe: str) -> None:
    """Refuse an MXFP8 recipe on this machine's GPU below Blackwell (compute capability 10.0), whose tensor cores
    lack MXFP8's block-scaled matmuls; float8's need 8.9 (Ada, Hopper)."""
    capability = tuple(torch.cuda.get_device_capability())
    if capability < BLACKWELL:
        other = ", or set plugins.float8.recipe=tensorwise" if capability >= FLOAT8_CAPABILITY else ""
        raise ConfigError("plugins.float8.recipe", f"{recipe} needs an NVIDIA Blackwell GPU (compute capability 10.0 "
                          f"or later) for MXFP8's block-scaled matmuls, and this machine's has "
                          f"{capability[0]}.{capability[1]}", f"run it on a B200 or GB200{other}")


@hookimpl
def convert_modules(model, config, plugin_config, plan):
    """float8: swap the model's convertible Linear layers for torchao's float8 (or MXFP8) training ones; with
    tensorwise scales, tensor parallel gathers their inputs and output gradients in float8."""
    skipped = (*plan.model.float8_skip, *plugin_config.filter_fqns)
    with library_logs_at_debug(*TORCHAO_LOGGERS):
        if plugin_config.recipe in MXFP8_RECIPES:
            convert_mxfp8(model, plugin_config.recipe, skipped)
        else:
            convert_float8_linears(model, plugin_config.recipe, skipped, plugin_config.fsdp_float8_all_gather,
                                   device_kind(config.launch.device))


def convert_float8_linears(model: nn.Module, recipe: str, skipped, fsdp_float8_all_gather: bool,
                           device: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    float8_config = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather:
        float8_config = dataclasses.replace(float8_config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=float8_config,
                               module_filter_fn=lambda module, fqn: converts(module, fqn, skipped, 16))
    if recipe == "tensorwise":  # one scale a tensor: a shard cast before tensor parallel's gather casts alike
        if device == "cpu":
            gather_float8_as_bytes()
        for module in model.modules():
            if isinstance(module, Float8Linear):
                cast_gathers(module, tensorwise_gather_casts(module))


def gather_float8_as_bytes() -> None:
    """gloo has no float8 type ("Invalid scalar type" at the first gather): torchao's all-gather of its float8
    tensors, whose bytes NCCL moves as they are, moves them through a uint8 view on the CPU too. It is
    registered in torchao's table of its tensors' operators, for the process: the same for every run."""
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    def gathered_as_bytes(aten_op, args, kwargs=None):
        shard = args[0]
        data = aten_op(shard._data.contiguous().view(torch.uint8), *args[1:], **(kwargs or {}))
        return Float8TrainingTensor(data.view(shard._data.dtype), shard._scale, shard._orig_dtype,
                                    shard._linear_mm_config, shard._gemm_input_role)
    for op in (torch.ops._c10d_functional.all_gather_into_tensor.default,
               torch.ops.c10d_functional.all_gather_into_tensor.default):
        float8_ops.FLOAT8_OPS_TABLE[op] = gathered_as_bytes


def tensorwise_gather_casts(linear) -> GatherCasts:
    """Tensor parallel's gathers in float8, as the linear would cast what they bring: one scale for the whole
    tensor, its amax reduced over the shards (torchao's float8 tensor-parallel styles)."""
    from torchao.float8.float8_scaling_utils import NoopFwToFloat8BwDynamic, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    config, mm_config = linear.config, linear.linear_mm_config
    return GatherCasts(
        input=lambda stream: hp_tensor_to_float8_dynamic(stream, config.cast_config_input.target_dtype, mm_config,
                                                         gemm_input_role=GemmInputRole.INPUT),
        output_grad=lambda output: NoopFwToFloat8BwDynamic.apply(output, mm_config,
                                                                 config.cast_config_grad_output.target_dtype),
        same=(config.cast_config_input, mm_config))


def convert_mxfp8(model: nn.Module, recipe: str, skipped) -> None:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe)),
              filter_fn=lambda module, fqn: converts(module, fqn, skipped, 32))


def converts(module: nn.Module, fqn: str, skipped, multiple: int) -> bool:
    """Whether the Linear ``module`` named ``fqn`` is converted; other modules never are."""
    return isinstance(module, nn.Linear) and convertible(canonical_name(fqn), module.in_features,
                                                         module.out_features, skipped, multiple)


def convertible(name: str, in_features: float, out_features: float, skipped, multiple: int) -> bool:
    """Whether a linear of that name and shape is converted: no skipped fragment names whole dotted parts of it
    (``mlp.gate``, a router, leaves ``mlp.gate_proj`` alone: a substring match skipped DeepSeek-V3's and
    Qwen3-MoE's dense feed-forward gates), and the float8 matmul can tile both dimensions."""
    if any(f".{fragment}." in f".{name}." for fragment in skipped):
        return False
    return in_features % multiple == 0 and out_features % multiple == 0


@hookimpl
def after_optimizer_step(model_parts, plugin_config):
    """float8: with float8 all-gather, compute the next step's weight scales for all layers at once."""
    if plugin_config.fsdp_float8_all_gather:
        from torch.distributed.fsdp import FSDPModule
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            # The scales belong to FSDP's float8 all-gather; only FSDP2 modules carry it.
            if isinstance(part, FSDPModule):
                precompute_float8_dynamic_scale_for_fsdp(part)
