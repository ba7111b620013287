"""float8's pricing: its converted linears' matmuls at the card's float8 speed (measured by shape where a table
exists), the casts' memory traffic, FSDP's float8 all-gathers; and the recipes worth trying on a card."""

import functools
from typing import Any

from titan_core import ConfigError, hookimpl
from titan_core.planner import evaluated
from titan_float8.measured import SPEEDUPS, speedup
from titan_float8.plugin import EMULATED_MXFP8, FLOAT8_RECIPES, MXFP8_RECIPES, convertible

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


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """float8: the matmuls of the linears it converts (rowwise_with_gw_hp: two of each one's three) at the speed-up
    measured for each linear's shape on the card's chip where a table exists (H100s' rowwise, casts included),
    else at the float8 rate the hardware reaches plus the casts' memory traffic as the recipe's kernels move it;
    those linears' weights in float8 in FSDP's all-gather when fsdp_float8_all_gather is on (each rank then casts
    its shard, before the gather); under the core's autocast, no copy of the blocks' weights in the compute dtype."""
    hardware = estimate.hardware
    check_hardware(estimate, plugin_config.recipe)
    estimate.casts_block_weights = False  # its linears cast float32 weights to float8 themselves, not autocast
    measured = SPEEDUPS.get(plugin_config.recipe, {}).get(hardware.chip)
    converted = converted_linears(plan, plugin_config)
    if plugin_config.recipe == "tensorwise":  # tensor parallel's gathers in float8 (GatherCasts)
        estimate.gathered_itemsize = lambda e, index, path: 1 if converted(e, index, path) else None
    if plugin_config.fsdp_float8_all_gather:
        estimate.gather_bytes = functools.partial(float8_gather_bytes, converted=converted)
    if hardware.fp8_tflops:
        estimate.matmul_speedup = float8_matmul_speedup(estimate, plugin_config, plan, converted, measured)
    if measured is None:
        estimate.add_traffic(cast_traffic(plugin_config, converted), f"casts to float8 ({plugin_config.recipe})",
                             "float8")


def check_hardware(estimate, recipe: str) -> None:
    """Refuse a GPU profile without the matmuls the recipe runs: MXFP8's block-scaled ones are Blackwell's (a CPU
    profile runs the emulated recipe, which no GPU profile prices), float8's are any float8 card's."""
    hardware = estimate.hardware
    if estimate.device_type != "cuda":
        return
    if recipe == EMULATED_MXFP8:
        raise ConfigError("plugins.float8.recipe", f"{recipe} emulates MXFP8 in high precision (a recipe for CPU "
                          f"tests), which the planner does not price on {hardware.name}",
                          "plan mxfp8_rceil on b200 or gb200, or tensorwise")
    if recipe in MXFP8_RECIPES and not hardware.blackwell:
        other = f", or set plugins.float8.recipe={FLOAT8_RECIPES[0]}" if hardware.fp8_tflops else ""
        raise ConfigError("plugins.float8.recipe", f"{recipe} needs an NVIDIA Blackwell card (compute capability "
                          f"10.0 or later) for MXFP8's block-scaled matmuls, and {hardware.name} is not one",
                          f"plan for b200 or gb200{other}")
    if not hardware.fp8_tflops:
        raise ConfigError("plugins.float8", f"{hardware.name} has no float8 matmuls",
                          "remove float8 from +plugins=[...], or plan for hardware that has them (h100, h200, ...)")


def float8_matmul_speedup(estimate, plugin_config, plan, converted, measured):
    """The estimate's matmul speed-up with the converted linears' matmuls in float8, as a function of the estimate:
    their share of the FLOPs at the table's speed-up by shape (``measured``) or else at the card's float8 rate."""
    hardware = estimate.hardware
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
    return matmul_speedup


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


def rank_converted_at(estimate, converted) -> list[tuple[int, str, Any]]:
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
    """float8: off, or tensorwise with float8 all-gathers, on hardware with float8 matmuls; MXFP8 too on Blackwell."""
    if not hardware.fp8_tflops:
        return [None]
    mxfp8 = [{"recipe": "mxfp8_rceil"}] if hardware.blackwell else []
    return [None, {"recipe": "tensorwise", "fsdp_float8_all_gather": True}, *mxfp8]
