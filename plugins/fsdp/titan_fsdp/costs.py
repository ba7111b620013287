"""FSDP2's pricing: the state it shards over the data-parallel ranks, the weights' all-gathers and the gradients'
reduce-scatters (and HSDP's all-reduces), and the buffers its gathers and reductions hold."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titan_core import CP, DP_REPLICATE, DP_SHARD, FLOAT_DTYPES, PP, compute_dtype, hookimpl
from titan_core.planner import evaluated


@dataclass(frozen=True)
class _Schedule:
    """How often the options make FSDP gather and reduce in one step, and over how many ranks."""

    shards: int  # ranks a unit is sharded over: dp_shard x cp
    reduce_bytes: int  # bytes per element of the gradients as reduced
    pipelined: bool
    resharded: bool  # weights let go after forward, gathered again by backward
    micro: int  # rounds of gathers and reductions per step: a pipeline gathers and reduces once per step
    reductions: int  # reduce-scatters per step: micro, or one with reduce_gradients=last_micro_batch

    @property
    def gathers(self) -> int:
        return (2 if self.resharded else 1) * self.micro

    @property
    def reduced_once(self) -> bool:
        """Reduced once a step (a pipeline's, or in the last micro-batch), every shard made after the peak."""
        return self.pipelined or self.reductions < self.micro


def _schedule(estimate, plugin_config, plan) -> _Schedule:
    pipelined = PP in plan.mesh_shape
    micro = 1 if pipelined else estimate.grad_accum
    return _Schedule(
        shards=plan.degree(DP_SHARD) * plan.degree(CP),
        reduce_bytes=torch.finfo(FLOAT_DTYPES[plugin_config.reduce_dtype]).bits // 8,
        pipelined=pipelined,
        resharded=plugin_config.reshard_after_forward == "always" or (
            plugin_config.reshard_after_forward == "default" and not pipelined),
        micro=micro,
        reductions=1 if plugin_config.reduce_gradients == "last_micro_batch" else micro)


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """fsdp: parameters, gradients and optimizer states divided over the shard ranks; each block's weights
    gathered in forward and again in backward (behind the computation), gradients reduce-scattered (each
    micro-batch, or the last only with whole gradients held until then)."""
    schedule = _schedule(estimate, plugin_config, plan)
    estimate.state_shards *= schedule.shards
    estimate.sharder_holds_gradients = True  # reduced as backward makes them, or held whole by its own term
    estimate.compute_dtype = compute_dtype(plugin_config.param_dtype, "plugins.fsdp.param_dtype", estimate.device_type)
    _add_collectives(estimate, plan, schedule)
    _add_stream_buffers(estimate, plugin_config, schedule)
    if schedule.pipelined:
        _add_pipeline_buffers(estimate, plugin_config, schedule)
    else:
        _add_backward_buffers(estimate, plugin_config, schedule)


def _sent(total, shards: int) -> float:
    """What one rank sends of a gather or reduce-scatter of ``total`` bytes over ``shards`` ranks."""
    return total * (shards - 1) / shards


def _sparse_units_sharded(e, plan) -> int:
    # Per mixture-of-experts block, its modules another plugin split partly (Estimate.sparse_units): a unit of
    # their own each, sharded over the ranks they are whole on (a unit over one rank issues nothing).
    return sum(math.prod(plan.degree(d) for d in dims) > 1 for dims in e.sparse_units)


def _units_sharded(e, plan, shards: int) -> int:
    """One unit per block, one for the output layer, one for the rest, and the experts' own."""
    return (shards > 1) * (len(e.blocks) + 2) + len(e.sparse_blocks()) * _sparse_units_sharded(e, plan)


def _gather_calls(e, plan, schedule: _Schedule) -> int:
    # Backward gathers again every unit but the last block's (its mixture-of-experts units too) and the
    # output's, never resharded.
    sparse = e.sparse_blocks()
    last_sparse = bool(sparse) and sparse[-1] == e.blocks[-1]
    regathered = (schedule.shards > 1) * len(e.blocks) + (len(sparse) - last_sparse) * _sparse_units_sharded(e, plan)
    return schedule.micro * (_units_sharded(e, plan, schedule.shards) + regathered * schedule.resharded)


def _add_collectives(estimate, plan, schedule: _Schedule) -> None:
    """The weights' all-gathers and the gradients' reduce-scatters, and with HSDP the shards' all-reduces."""
    shards, reductions, reduce_bytes = schedule.shards, schedule.reductions, schedule.reduce_bytes
    estimate.add_collective("all-gather of the weights", (DP_SHARD, CP),
                            lambda e: _sent(schedule.gathers * e.held_gathered_bytes(), shards),
                            overlapped=True, plugin="fsdp", calls=lambda e: _gather_calls(e, plan, schedule))
    estimate.add_collective("reduce-scatter of the gradients", (DP_SHARD, CP),
                            lambda e: _sent(reductions * e.held_gathered() * reduce_bytes, shards),
                            overlapped=True, plugin="fsdp", calls=lambda e: reductions * _units_sharded(e, plan, shards))
    replicas = plan.degree(DP_REPLICATE)
    if replicas > 1:
        estimate.add_collective("all-reduce of the gradient shards", (DP_REPLICATE,),
                                lambda e: 2 * reductions * e.held_gathered() / shards * reduce_bytes
                                * (replicas - 1) / replicas, overlapped=True, plugin="fsdp",
                                calls=lambda e: reductions * (len(e.blocks) + 2 + len(e.sparse_blocks()) * len(e.sparse_units)))


def _unreduced(e, reduce_bytes: int) -> float:
    # Whole until the last micro-batch's reduce-scatter makes its shard and frees it: at the peak the whole
    # gradients stand where the core counts shards (tracked: a stage holds the whole ones only), with what
    # another plugin's backward makes beyond its split of the weights.
    whole = e.held_gathered() + evaluated(e.grad_whole_params, e)
    return (whole * reduce_bytes - 4 * e.sharded_params()) * e.trained_share


def _add_stream_buffers(estimate, plugin_config, schedule: _Schedule) -> None:
    # FSDP2 gathers on a stream of its own and reduces on another: a caching allocator keeps each stream's freed
    # blocks for that stream, so as the peak comes the gathers' room and the gradient shards' (freed by the step's
    # start) stay reserved beside what the compute stream allocates. Reduced once a step (a pipeline's, or in the
    # last micro-batch), every shard is made there after the peak, which counts the gradients whole instead.
    ahead = max(plugin_config.prefetch, 1)
    estimate.add_memory("buffers", lambda e: e.gathered_weight_bytes(e.largest_block_gathered() * ahead,
                                                                     e.facts.outputs_params / e.weight_split),
                        "the all-gathers' stream: a block and the output gathered", "fsdp", when="cached")

    def shards_not_made(e):
        shards = 4 * e.trained_params()
        return shards if schedule.reduced_once else max(0.0, shards - e.memory()["gradients"])
    estimate.add_memory("buffers", shards_not_made, "the reduce-scatters' stream: the gradient shards not made yet",
                        "fsdp", when="cached")


def _add_pipeline_buffers(estimate, plugin_config, schedule: _Schedule) -> None:
    # torch's pipeline stages keep their FSDP weights gathered after each backward and their gradients
    # unreduced until the last micro-batch's: whole, for every block of the rank. Resharded after forward
    # (always), a backward that follows a forward gathers them again block by block.
    resharded = schedule.resharded
    estimate.add_memory("buffers", lambda e: e.held_gathered_bytes(),
                        "weights gathered again by backward and kept (pipeline)" if resharded
                        else "weights gathered for the whole step (pipeline)", "fsdp",
                        when="regathered" if resharded else None)
    estimate.backward_prefetch = max(plugin_config.prefetch, 1)  # FSDP2 prefetches one block unasked
    # Experts another plugin split are a unit of their own (_shard_partly_split), gathered only when reached.
    estimate.prefetched_gathered = lambda e, i: e.block_gathered(i) - (e.expert_split > 1) * e.experts_gathered(i)
    estimate.add_memory("buffers", lambda e: _unreduced(e, schedule.reduce_bytes), "gradients accumulated whole "
                        "until the last micro-batch, beyond their shards (pipeline)", "fsdp", when="accumulated")


def _reducing(plugin_config, reduce_bytes: int):
    """The bytes that the blocks being gathered and reduced hold while backward runs them, as a function of the
    estimate."""
    if plugin_config.reshard_after_forward == "never":
        def reduced_only(e):  # the block before the one running backward has its gradients reduced
            return e.largest_block_gathered() * reduce_bytes
        return reduced_only
    in_flight = 1 + max(plugin_config.prefetch, 1)

    def reducing(e):  # the block running backward, those prefetched, the one before reduced
        return e.largest_block_gathered() * (in_flight * e.block_gather_bytes() + reduce_bytes)
    return reducing


def _add_backward_buffers(estimate, plugin_config, schedule: _Schedule) -> None:
    """Without a pipeline: what backward holds gathered and being reduced, by moment."""
    reduce_bytes = schedule.reduce_bytes
    if schedule.reductions < schedule.micro:
        # Reduced in the last micro-batch only: until then each parameter's gradient accumulates whole.
        estimate.add_memory("buffers", lambda e: _unreduced(e, reduce_bytes), "gradients accumulated whole until "
                            "the last micro-batch, beyond their shards (reduce_gradients)", "fsdp", when="accumulated")
    reducing = _reducing(plugin_config, reduce_bytes)
    if schedule.reductions == schedule.micro:
        _add_outer_reductions(estimate, reducing, reduce_bytes, schedule.shards,
                              output_counted=plugin_config.reshard_after_forward != "always")
    if plugin_config.reshard_after_forward == "never":
        # Every unit stays gathered from its forward until its backward has run.
        estimate.add_memory("buffers", lambda e: e.held_gathered_bytes(), "every unit gathered since forward, until its backward", "fsdp",
                            when="unreleased")
        estimate.add_memory("buffers", reducing, "a reduce-scatter", "fsdp", when="blocks")
        return
    # As backward starts, the last block (by default, not resharded) and the output layer's unit are gathered
    # (resharded after forward, always, the output is gathered again only once the loss's backward has run);
    # then the block running backward, the ones prefetched, and the gradients of the one before being reduced.
    if plugin_config.reshard_after_forward == "default":
        estimate.add_memory("buffers", lambda e: e.gathered_weight_bytes(e.largest_block_gathered(),
                                                                     e.facts.outputs_params * e.holds_outputs
                                                                     / e.weight_split),
                            "the last block and the output gathered", "fsdp", when="start")
    estimate.add_memory("buffers", reducing, "gathered blocks and a reduce-scatter", "fsdp", when="blocks")


def _add_outer_reductions(estimate, reducing, reduce_bytes: int, shards: int, output_counted: bool) -> None:
    """The reductions of the units larger than any block, which a vocabulary makes (tracked at 16,384 entries and 16 tokens a
    rank: the step's peak, 10% to 41% above the blocks'): the output layer's, as the loss's backward ends, and the embeddings'
    (the root unit's, in FSDP2's final callback), as backward ends. Each holds the unit's gradients whole as
    backward made them, their copy in the reduction's dtype and the shard it makes; before it, the output's matmul
    makes its gradient beside the logits' and the output's gathered weights."""
    def shard_made(accumulated: bool) -> float:
        # Bytes per element of the unit that its reduction leaves: the reduce-scatter's output, and the float32
        # shard cast from it (unless it is one) or that it is added into (an earlier micro-batch's).
        return (reduce_bytes + 4 * (reduce_bytes != 4 or accumulated)) / shards

    def output_reduced(e):
        whole = e.facts.outputs_params * e.holds_outputs / e.weight_split
        if not whole or e.logits_tokens is not None:  # a chunked loss counts the output's gradient as it sums it
            return 0.0
        gradient, gathered_output = whole * e.made_gradient_bytes, e.gathered_weight_bytes(0, whole)
        matmul = gradient + e.microbatch_tokens * e.facts.output / e.logits_split + gathered_output
        reduction = gradient + whole * (reduce_bytes + shard_made(accumulated=False))
        # Beyond the loss's backward and the output's weights, which the moment as backward starts holds already.
        return max(0.0, max(matmul, reduction) - e.loss_backward_bytes() - output_counted * gathered_output)

    def inputs_reduced(e):
        rows, accumulated = e.facts.inputs_params * e.holds_inputs / e.weight_split, e.gradients_at_peak()
        reduction = rows * (e.made_gradient_bytes + reduce_bytes + shard_made(accumulated) - 4 / shards)
        beyond = evaluated(e.grad_whole_params, e)
        if beyond:
            # Made whole by another plugin's backward (and counted by it: a vocabulary-split embedding's), the
            # gradient is cut to the rank's rows by the post-backward, which holds them twice beside it (tracked),
            # before the shard exists; the reduction follows once the whole one is freed.
            cut = 2 * rows * e.made_gradient_bytes - (not accumulated) * 4 * rows / shards
            reduction = max(cut, reduction - (rows + beyond) * e.made_gradient_bytes)
        return max(0.0, reduction - reducing(e))  # no block is gathered or reduced any more
    estimate.add_memory("buffers", output_reduced, "the output layer's gradient reduced", "fsdp", when="start")
    estimate.add_memory("buffers", inputs_reduced, "the embeddings' gradient reduced", "fsdp", when="end")


@hookimpl
def plan_options(world_size, hardware):
    """fsdp: shard over every rank the others leave; across nodes, also HSDP with one replica per node."""
    nodes = world_size // hardware.devices_per_node
    return [{"degree": -1, "replicate_degree": 1}] + (
        [{"degree": -1, "replicate_degree": nodes}] if nodes > 1 and world_size % hardware.devices_per_node == 0 else [])
