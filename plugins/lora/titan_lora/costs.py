"""lora's pricing: only the adapters train (their gradients and optimizer states), the model traced frozen with its
adapters, and what a split of the linears leaves whole on every rank; and the base dtypes worth trying."""

from __future__ import annotations

import functools

from titan_core import build_meta_model, hookimpl

from titan_lora.adapters import block_linears, frozen_matmul_weights, target_paths
from titan_lora.plugin import adapt


@hookimpl
def plan_options():
    """lora: never left out (it is what trains), its frozen linears in float32 or in bfloat16 (where the job
    computes in bfloat16: a float32 job refuses the latter)."""
    return [{"base_dtype": "float32"}, {"base_dtype": "bfloat16"}]


@hookimpl
def estimate_costs(estimate, config, plugin_config, plan):
    """lora: the model traced frozen, with its adapters (so the core counts only them as trained); under a split
    of the linears (tensor parallel), each adapter's factor left whole on every rank, and its low-rank input,
    which that factor makes."""
    model = build_meta_model(config, plan.model)
    narrow = sum(p.numel() for p in frozen_matmul_weights(model, plan.model))  # before the adapters join them
    adapt(model, plugin_config, plan)
    every = sum(p.numel() for p in model.parameters())
    whole, per_block = whole_factors(model, plan.model, plugin_config.targets)
    split = estimate.weight_split  # tensor parallel's, set before this plugin's stage
    # Each rank trains its share of the split factors (the core counts those) and all of the whole ones.
    estimate.trained_whole = lambda e: sum(whole[i] for i in e.blocks) * (1 - 1 / split) / e.state_shards
    # The model is traced as this plugin converts it: a frozen weight's matmul keeps no input for its gradient,
    # a frozen norm no normalized input; each adapter keeps its own.
    estimate.trace_conversions[f"lora {plugin_config}"] = functools.partial(adapt, plugin_config=plugin_config,
                                                                             plan=plan)
    if plugin_config.base_dtype == "bfloat16":
        estimate.add_memory("parameters", lambda e: -2 * narrow / every * e.sharded_params(),
                            "the frozen linears held in bfloat16 (2 bytes each, not 4)", "lora", when="held")
    if split > 1:
        # A pipeline rank holds its own blocks' factors.
        estimate.add_memory("parameters", lambda e: 4 * sum(whole[i] for i in e.blocks) * (1 - 1 / split)
                            / e.state_shards,
                            "the adapters' factors whole on every tensor-parallel rank", "lora", when="held")
        estimate.add_memory("activations", functools.partial(whole_low_rank_inputs, per_block=per_block,
                                                             rank=plugin_config.rank),
                            "the adapters' low-rank inputs, whole on every tensor-parallel rank", "lora")


def whole_factors(model, description, targets) -> tuple[list[int], int]:
    """Of the adapted ``model``, block by block, the elements of the adapters' factors a split of their linears
    leaves whole (``lora_A`` of a linear split by output features, ``lora_B`` of one split by input features), and
    how many linears a block adapts (of the blocks that adapt most)."""
    rowwise = set(description.tensor_parallel.block_rowwise) if description.tensor_parallel else set()
    paths = target_paths(description, targets)
    chosen = [block_linears(block, paths) for block in description.blocks_of(model).values()]
    elements = [sum((linear.lora_B if path in rowwise else linear.lora_A).weight.numel()
                    for path, linear in linears.items()) for linears in chosen]
    return elements, max((len(linears) for linears in chosen), default=0)


def whole_low_rank_inputs(estimate, per_block: int, rank: int) -> float:
    """What the blocks keep of the adapters' low-rank inputs beyond the split share the trace's figures give them
    (each is whole on every rank), and the same of a block that recomputes them in backward."""
    kept = [estimate.kept(i) / estimate.saved(i) if estimate.saved(i) else 0.0 for i in estimate.blocks]
    blocks = sum(kept) + max((1 - share for share in kept), default=0.0)
    return (estimate.microbatch_tokens * blocks * per_block * rank * estimate.compute_dtype.itemsize
            * (1 - 1 / estimate.activation_split))
