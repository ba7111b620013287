"""Context parallel's pricing: each rank's share of the sequence, the keys and values its attention exchanges
around the ring (or gathers for masks), and the gradients' all-reduce without a data-parallel sharder."""

from titan_core import CP, DATA_PARALLEL_SHARDING, hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """cp: each rank keeps the activations of its share of the sequence; per block and micro-batch, the
    other ranks' keys and values reach it in forward (again as a checkpointed block recomputes) and in backward,
    and their gradients go back."""
    degree = plan.degree(CP)
    estimate.sequence_split *= degree
    # Per block and micro-batch, in calls and in the rank's keys and values' size. Causal attention runs torch's
    # ring: forward's keys and values (one all-gather, or degree - 1 exchanges), backward's again and their
    # gradients, in float32, degree exchanges; forward's again in a block that recomputes its attention. Masked
    # attention gathers the keys, values and positions (and document ids) in forward, again in a block that
    # recomputes (no checkpoint keeps a collective's result), and reduce-scatters the keys' and values' gradients.
    # Counted by tests/test_planner_collectives.py.
    exchanges = 1 if plugin_config.rotate_method == "allgather" else degree - 1
    masked = bool(estimate.facts.attention_masks)

    def per_block(e, index: int) -> tuple[int, float]:
        if masked:
            gathers = 3 + e.masks_by_document
            return gathers * (1 + e.recomputes(index)) + 2, (degree - 1) * (2 + e.recomputes(index))
        passes = 2 + e.recomputes_attention(index)
        return exchanges * passes + degree, (degree - 1) * passes + degree * 4 / e.compute_dtype.itemsize

    estimate.add_collective(
        "keys and values gathered for the masks" if masked
        else f"keys and values around the ring ({plugin_config.rotate_method})", (CP,),
        lambda e: sum(per_block(e, i)[1] for i in e.blocks) * e.facts.attention_kv / e.activation_split
        * e.microbatch_tokens * e.microbatches_per_step(),
        overlapped=plugin_config.rotate_method == "alltoall" and not masked, plugin="cp",
        calls=lambda e: sum(per_block(e, i)[0] for i in e.blocks) * e.microbatches_per_step())
    if not plan.provides(DATA_PARALLEL_SHARDING):  # one all-reduce per parameter and micro-batch
        estimate.add_collective("all-reduce of the gradients", (CP,),
                                lambda e: 2 * 4 * e.held_params() / e.weight_split * (degree - 1) / degree,
                                overlapped=False, plugin="cp",
                                calls=lambda e: e.facts.parameter_tensors * e.microbatches_per_step())


@hookimpl
def plan_options(config):
    """cp: off, or 2, 4 or 8 ranks per sequence when each keeps at least 4,096 of its tokens."""
    return [None, *({"degree": d} for d in (2, 4, 8) if config.training.seq_len // d >= 4096)]
