"""SimpleFSDP's pricing: the state it shards over the data-parallel ranks, the weights gathered as read and kept
for backward, and the per-parameter all-gathers and reduce-scatters the step waits for."""

from titan_core import CP, DP_REPLICATE, DP_SHARD, FLOAT_DTYPES, compute_dtype, hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """simplefsdp: parameters, gradients and optimizer states divided over the shard ranks; every parameter
    gathered each time a module reads it and kept so by autograd until its backward, its gradient
    reduce-scattered there: one call each per parameter and micro-batch, which the step waits for (eager)."""
    shards = plan.degree(DP_SHARD) * plan.degree(CP)
    estimate.state_shards *= shards
    estimate.sharder_holds_gradients = True  # each reduce-scattered as backward makes it
    estimate.compute_dtype = compute_dtype(plugin_config.param_dtype, "plugins.simplefsdp.param_dtype",
                                           estimate.device_type)
    reduce_bytes = FLOAT_DTYPES[plugin_config.reduce_dtype].itemsize

    def kept_by_blocks(e):  # a checkpointed block reads (gathers) its weights again in backward: not kept
        return sum(e.block_gathered(i) for i in e.blocks if not e.recomputes(i)) * e.compute_dtype.itemsize

    def kept_by_outputs(e):  # until the loss's backward (an embedding's backward needs no weight)
        return e.facts.outputs_params * e.holds_outputs / e.weight_split * e.compute_dtype.itemsize

    def regathered(e):
        return max((e.block_gathered(i) for i in e.blocks if e.recomputes(i)), default=0.0) * e.compute_dtype.itemsize

    estimate.add_memory("buffers", kept_by_blocks, "the blocks' weights gathered as read, kept for backward",
                        "simplefsdp")
    estimate.add_memory("buffers", kept_by_outputs, "the output's weights gathered, kept for backward", "simplefsdp",
                        when="start")
    estimate.add_memory("buffers", regathered, "a checkpointed block's weights gathered again", "simplefsdp",
                        when="blocks")

    def gathered(e):  # bytes of the weights one rank computes with, as gathered
        return e.held_gathered() * e.compute_dtype.itemsize

    calls = lambda e: e.facts.parameter_tensors * e.microbatches_per_step()  # noqa: E731
    estimate.add_collective("all-gather of the weights", (DP_SHARD, CP),
                            lambda e: gathered(e) * e.microbatches_per_step() * (shards - 1) / shards,
                            overlapped=False, plugin="simplefsdp", calls=calls)
    estimate.add_collective("reduce-scatter of the gradients", (DP_SHARD, CP),
                            lambda e: e.held_gathered() * reduce_bytes * e.microbatches_per_step() * (shards - 1) / shards,
                            overlapped=False, plugin="simplefsdp", calls=calls)
    replicas = plan.degree(DP_REPLICATE)
    if replicas > 1:
        estimate.add_collective("all-reduce of the gradient shards", (DP_REPLICATE,),
                                lambda e: 2 * e.held_gathered() / shards * reduce_bytes * e.microbatches_per_step()
                                * (replicas - 1) / replicas, overlapped=False, plugin="simplefsdp", calls=calls)
