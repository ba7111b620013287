"""Float8 training (torchao): chosen Linear layers compute their matmuls in float8 with dynamic scales.

Conversion happens on the meta model, before any parallelism, so TP and FSDP see the float8 modules.
Left in high precision: the layers the model names in ``ModelDescription.float8_skip`` (typically the
output layer, whose logits are the most precision-sensitive), any layer a ``filter_fqns`` entry matches, and layers whose dimensions the float8 matmul cannot tile (multiples
of 16 for Float8Linear, of the 32-element scaling block for MXFP8).

With ``fsdp_float8_all_gather`` the FSDP all-gather sends float8 weights (half the bytes of bf16);
their scales are then computed for all layers at once after each optimizer step, in one all-reduce.
"""

import contextlib
import dataclasses
import functools
import importlib.util
import logging

import torch
from torch import nn

from titan_core import (DATA_PARALLEL_SHARDING, ConfigError, Declaration, GatherCasts, canonical_name, cast_gathers,
                        device_kind, evaluated, hookimpl)
from titan_float8.measured import SPEEDUPS, speedup

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MXFP8_RECIPES = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8_emulated_rceil")
log = logging.getLogger("titan_core")
MXFP8_NEEDS_TRITON = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp")  # torchao's CUDA cast kernels
# Bytes per element read and written to cast a linear's input, its output's gradient and its weight to float8 for
# forward and backward, as torchao's roofline counts its cast kernels (none fused with the op before them:
# torchao/testing/training/roofline_utils.py, get_tensor_memory_traffic_ovhd_s). Rowwise scales each operand
# along the dimension its matmul sums over, so backward transposes in bf16 and casts again.
CAST_BYTES = {"tensorwise": (6, 6, 8), "rowwise": (8, 8, 10), "rowwise_with_gw_hp": (3, 3, 6)}
MXFP8_CAST_BYTES = (6, 6, 6)
# Rowwise's backward matmuls accumulate at full precision, where torchao runs the tensorwise kernel unscaled and
# scales its output in a kernel of its own (torchao/float8/float8_ops.py, addmm_float8_unwrapped; torchao issue
# 2184): each reads and writes its bf16 output once more, the input's gradient and the weight's.
RESCALED_OUTPUT_BYTES = {"rowwise": 4}
# Module conversions run in stage order: float8 replaces whole linears, so it goes before any conversion at a
# later stage that hangs modules on them (LoRA's adapters, 210), which a replacement would drop.
STAGE = 150


@hookimpl
def declare():
    """float8: its place among the module conversions, before those that build on its linears."""
    return Declaration(stage=STAGE)


@hookimpl
def validate(config, plugin_config, plan):
    """float8: the recipe exists and runs on the job's device; float8 all-gathers need tensorwise and a sharder."""
    recipe = plugin_config.recipe
    if recipe not in FLOAT8_RECIPES + MXFP8_RECIPES:
        raise ConfigError("plugins.float8.recipe", f"unknown recipe '{recipe}'",
                          f"use one of {', '.join(FLOAT8_RECIPES + MXFP8_RECIPES)}")
    # Planned for a GPU from a machine without one, the GPU's machine is checked for triton when the job runs there.
    here = torch.cuda.is_available()
    if recipe in MXFP8_NEEDS_TRITON and not (device_kind(config.launch.device) == "cuda"
                                             and (importlib.util.find_spec("triton") or not here)):
        raise ConfigError("plugins.float8.recipe", f"{recipe} needs a CUDA device with triton (torchao's MXFP8 "
                          "cast kernels), and this machine has none", "use recipe=mxfp8_emulated_rceil here")
    if plugin_config.fsdp_float8_all_gather:
        if recipe != "tensorwise":
            raise ConfigError("plugins.float8.fsdp_float8_all_gather", f"needs recipe=tensorwise, not {recipe} "
                              "(only one scale per tensor can be applied before the all-gather)",
                              "set recipe=tensorwise or fsdp_float8_all_gather=false")
        if not plan.provides(DATA_PARALLEL_SHARDING):
            raise ConfigError("plugins.float8.fsdp_float8_all_gather", "no enabled plugin shards parameters "
                              "over data-parallel ranks, so there is no all-gather", "enable fsdp or set it to false")


@hookimpl
def convert_modules(model, config, plugin_config, plan):
    """float8: swap the model's convertible Linear layers for torchao's float8 (or MXFP8) training ones; with
    tensorwise scales, tensor parallel gathers their inputs and output gradients in float8."""
    skipped = (*plan.model.float8_skip, *plugin_config.filter_fqns)
    with torchao_noise_at_debug():
        if plugin_config.recipe in MXFP8_RECIPES:
            convert_mxfp8(model, plugin_config.recipe, skipped)
        else:
            convert_float8_linears(model, plugin_config.recipe, skipped, plugin_config.fsdp_float8_all_gather,
                                   device_kind(config.launch.device))


class _AtDebug(logging.Handler):
    """Re-logs a library's record at DEBUG on titan_core's logger."""

    def emit(self, record: logging.LogRecord) -> None:
        log.debug("%s: %s", record.name, record.getMessage())


@contextlib.contextmanager
def torchao_noise_at_debug():
    """torchao's known start-up warnings at DEBUG, not on the console: without its CUDA kernels it warns
    "Failed to load ... .so" for each and "Detected no triton", and its Enum registration trips a pytree
    deprecation warning. None is anything a user can act on; our own checks refuse what cannot run."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    handler, propagates = _AtDebug(), [logger.propagate for logger in loggers]
    for logger in loggers:  # records of child loggers (torchao.kernel.*) reach this handler and stop there
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in zip(loggers, propagates):
            logger.removeHandler(handler)
            logger.propagate = propagate


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


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """float8: the matmuls of the linears it converts (rowwise_with_gw_hp: two of each one's three) at the speed-up
    measured for each linear's shape on the card's chip where a table exists (H100s' rowwise, casts included),
    else at the float8 rate the hardware reaches plus the casts' memory traffic as the recipe's kernels move it;
    those linears' weights in float8 in FSDP's all-gather when fsdp_float8_all_gather is on (each rank then casts
    its shard, before the gather); under the core's autocast, no copy of the blocks' weights in the compute dtype."""
    hardware = estimate.hardware
    if estimate.device_type == "cuda" and not hardware.fp8_tflops:
        raise ConfigError("plugins.float8", f"{hardware.name} has no float8 matmuls",
                          "remove float8 from +plugins=[...], or plan for hardware that has them (h100, h200, ...)")
    estimate.casts_block_weights = False  # its linears cast float32 weights to float8 themselves, not autocast
    measured = SPEEDUPS.get(plugin_config.recipe, {}).get(hardware.chip)
    converted = converted_linears(plan, plugin_config)
    if plugin_config.recipe == "tensorwise":  # tensor parallel's gathers in float8 (GatherCasts)
        estimate.gathered_itemsize = lambda e, index, path: 1 if converted(e, index, path) else None
    if plugin_config.fsdp_float8_all_gather:
        estimate.gather_bytes = functools.partial(float8_gather_bytes, converted=converted)
    if hardware.fp8_tflops:
        weights = sum(linear.weights for i, block in enumerate(estimate.facts.block_linears)
                      for path, linear in block.items() if converted(estimate, i, path))
        linear = 6 * weights / plan.model.flops_per_token(estimate.seq_len)  # converted linears' share of the FLOPs
        # rowwise_with_gw_hp leaves the weight gradient's matmul, one of each linear's three, in high precision.
        share = min(linear, 1.0) * (2 / 3 if plugin_config.recipe == "rowwise_with_gw_hp" else 1)
        rate_ratio = hardware.matmul_tflops() / hardware.matmul_tflops(float8=True)
        earlier = estimate.matmul_speedup

        def matmul_speedup(e):
            # The shapes are the rank's, known once every plugin has split the linears and the tokens.
            time_ratio = rate_ratio if measured is None else measured_time_ratio(e, measured, converted, rate_ratio)
            return evaluated(earlier, e) / ((1 - share) + share * time_ratio)
        estimate.matmul_speedup = matmul_speedup
    if measured is None:
        estimate.add_traffic(cast_traffic(plugin_config, converted), f"casts to float8 ({plugin_config.recipe})",
                             "float8")


def float8_gather_bytes(estimate, converted) -> float:
    """Bytes per element of the rank's blocks' weights as FSDP gathers them: one for its converted linears', the
    compute dtype's for the rest (norms; a mixture of experts' experts and router, most of its weights)."""
    wide = estimate.compute_dtype.itemsize
    blocks = sum(estimate.block_gathered(i) for i in estimate.blocks)
    narrow = sum(linear.weights for linear in rank_converted(estimate, converted))
    return (narrow + wide * (blocks - narrow)) / blocks if blocks else wide


def converted_linears(plan, plugin_config):
    """Whether the plugin converts a linear of the trace: a predicate on (estimate, block index, path in the block),
    judged by the linear's whole shape and its name in the model, as ``converts`` judges modules."""
    skipped = (*plan.model.float8_skip, *plugin_config.filter_fqns)
    multiple = 32 if plugin_config.recipe in MXFP8_RECIPES else 16

    def converted(e, index: int, path: str) -> bool:
        linear = e.facts.block_linears[index][path]
        return convertible(f"{plan.model.blocks}.{index}.{path}", linear.inputs, linear.outputs, skipped, multiple)
    return converted


def rank_converted(estimate, converted) -> list:
    """The rank's block linears the plugin converts, as the rank computes them."""
    return [linear for _, _, linear in rank_converted_at(estimate, converted)]


def rank_converted_at(estimate, converted) -> list[tuple[int, str, object]]:
    """The same with each one's block index and path in the block."""
    return [(i, path, linear) for i in estimate.blocks for path, linear in estimate.rank_linears(i).items()
            if converted(estimate, i, path)]


def cast_traffic(plugin_config, converted):
    """The bytes a step's casts to float8 move through device memory, as a function of the estimate."""
    inputs, gradients, weights = CAST_BYTES.get(plugin_config.recipe, MXFP8_CAST_BYTES)
    rescaled = RESCALED_OUTPUT_BYTES.get(plugin_config.recipe, 0)
    gathered_cast = not plugin_config.fsdp_float8_all_gather

    def cast_bytes(e):
        # Each linear casts what it computes on: under tensor parallel a column-wise one its gathered input, a
        # row-wise one its result's whole gradient (checked against the shapes torchao casts in a real step), but
        # what tensor parallel casts before gathering (Estimate.cast_shares).
        linears = rank_converted_at(e, converted)
        shares = e.cast_shares or (lambda e, i, path: (1.0, 1.0))
        activations = sum((inputs + rescaled) * linear.inputs * own_input + gradients * linear.outputs * own_grad
                          for i, path, linear in linears
                          for own_input, own_grad in [shares(e, i, path)]) * e.microbatch_tokens
        linear_weights = sum(linear.weights for _, _, linear in linears)
        casts = weights * linear_weights / (1 if gathered_cast else e.state_shards)
        return (activations + casts + rescaled * linear_weights) * e.microbatches_per_step()
    return cast_bytes


def measured_time_ratio(estimate, table, converted, otherwise: float) -> float:
    """The rank's converted linears' float8 time over their bfloat16 time, each linear at the table's speed-up for
    its shape (M: a micro-batch's tokens on the rank; K, N: its input and result features there), weighted by
    its matmuls' share; ``otherwise`` for a rank without any."""
    tokens = estimate.microbatch_tokens
    linears = rank_converted(estimate, converted)
    work = sum(linear.inputs * linear.outputs for linear in linears)
    if not work:
        return otherwise
    return sum(linear.inputs * linear.outputs / speedup(table, tokens, linear.inputs, linear.outputs)
               for linear in linears) / work


@hookimpl
def plan_options(hardware):
    """float8: off, or tensorwise with float8 all-gathers, on hardware with float8 matmuls."""
    return [None, {"recipe": "tensorwise", "fsdp_float8_all_gather": True}] if hardware.fp8_tflops else [None]
