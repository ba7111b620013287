"""torch.compile's pricing: inductor's fusion of the elementwise ops, and of the loss it compiles."""

from titan_core import hookimpl

# Of the elementwise traffic an eager step moves through device memory, what inductor's fusion leaves: the
# fused kernels read each input and write each output once instead of once per op (an assumption the
# planner's comparison with published runs measures, docs/planner.md).
FUSED_TRAFFIC = 0.5


@hookimpl
def estimate_costs(estimate, plugin_config):
    """compile: inductor fuses the elementwise ops, halving their traffic through device memory; a loss it
    compiles keeps no float32 copy of the logits."""
    if plugin_config.backend == "inductor":
        estimate.fusion *= FUSED_TRAFFIC
        estimate.fused_loss = estimate.fused_loss or bool(plugin_config.compile_loss)


@hookimpl
def plan_options():
    """compile: off or on (inductor)."""
    return [None, {}]
