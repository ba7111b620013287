"""Tensor parallel's pricing: the weights and activations split over the tp ranks, the residual stream's gathers
and reductions (AsyncTP hiding part of them), and DTensor's host time per operator."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from titan_core import DATA_PARALLEL_SHARDING, TP, TensorParallelLayout, hookimpl
from titan_tp.plugin import TOKEN_SPLIT_REPLICAS, stream_readers, within

# The share of tp's collective time AsyncTP hides behind the matmuls it splits; the rest still waits (each fused
# matmul's first chunk, the patterns it does not fuse). From TorchTitan's June 2025 AsyncTP benchmark (Llama 3 70B
# and 8B, TP 8, bf16 and float8: 0.29 to 0.82 of the planned time of those collectives, mean 0.49); priced as all
# of it, its 8B jobs were planned 24% to 33% fast.
ASYNC_TP_HIDDEN = 0.5

# The host's time for a forward and backward of a tensor-parallel model relative to one process's, by sequence
# parallel: DTensor's sharding propagation and redistributions per operator (bench/dtensor_dispatch.py, CPU).
DTENSOR_DISPATCH = {True: 13.6, False: 12.0}


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """tp: every weight split over the tp ranks, the blocks' activations too (but the linears' gathered
    inputs, and without sequence parallel all that has the stream's shape), the logits under loss parallel; the
    embedding's whole gradient in its backward; per block and micro-batch, two all-gathers and two
    reduce-scatters of the residual stream (or two all-reduces) in each of forward and backward, and a checkpointed
    block's again as it recomputes, which the step waits for (AsyncTP hides them behind the matmuls); DTensor's host
    time per operator."""
    degree = plan.degree(TP)
    estimate.weight_split *= degree
    if plan.model.experts is not None:
        estimate.sparse_units.append(TOKEN_SPLIT_REPLICAS)
    split_block_activations(estimate, plan.model.tensor_parallel, plugin_config.sequence_parallel, degree)
    hold_embedding_gradient_whole(estimate, degree)
    if plugin_config.sequence_parallel:
        # The output layer's input is gathered along the sequence as a collective gathers, rank after rank, then
        # reordered into a second tensor: the first one's room, freed just before the logits are made, is too
        # small for the loss's float32 tensors (70B's widths at 16 x 8,192 tokens a rank, replayed through
        # tests/allocator_replay.py: 2 GiB of the 7.1 the allocator keeps beyond what is allocated).
        estimate.add_memory("buffers", lambda e: e.leaves_logits_room * e.microbatch_tokens * e.facts.block_input,
                            "the output layer's input gathered along the sequence: its first copy's room", "tp",
                            when="cached")
    if plugin_config.loss_parallel:
        split_logits(estimate, plugin_config.sequence_parallel, degree)
    estimate.dispatch_cost *= DTENSOR_DISPATCH[plugin_config.sequence_parallel]
    add_stream_collectives(estimate, plugin_config, plan, degree)


def split_block_activations(estimate, layout: TensorParallelLayout, sp: bool, degree: int) -> None:
    """The blocks' activations split over the tp ranks but for what each rank keeps whole, the gathered inputs'
    casts under sequence parallel, and which share of its input and output each block linear computes on."""
    # Kept whole on every rank: what has the residual stream's shape without sequence parallel (norms, sums),
    # and with it the column-wise linears' inputs, gathered along the sequence (two per block).
    facts = estimate.facts
    saved = max(facts.block_saved, default=0.0)
    whole = 2 * facts.block_input if sp else max(facts.block_stream_saved, default=0.0)
    estimate.activation_split *= saved / ((saved - whole) / degree + whole) if saved > whole else 1
    if sp:
        estimate.stream_split *= degree
        estimate.cast_shares = functools.partial(cast_shares, layout=layout, degree=degree)
        # What the column-wise linears keep of their gathered input, cast before the gather, is that narrow.
        estimate.saved_narrower = lambda e, index: e.facts.block_input * sum(
            1 - size for name, size in gathered_sizes(e, index, layout).items() if name in layout.block_regions)
    # A column-wise linear computes on its whole input (gathered, or replicated) and leaves its result split; a
    # row-wise one the other way round (its result a partial sum of the stream's shape).
    estimate.linear_splits.update({**{path: (1, degree) for path in layout.block_colwise},
                                   **{path: (degree, 1) for path in layout.block_rowwise}})


def hold_embedding_gradient_whole(estimate, degree: int) -> None:
    """The vocabulary-split embedding's gradient, whole in its backward and, as a partial sum, until reduced."""
    # torch's backward of a vocabulary-split embedding makes the gradient of the whole table before keeping its
    # rows (measured under torch's tracker: 3.9 GiB on every rank for 70B's 128,256 x 8,192 in float32).
    estimate.add_memory("gradients", lambda e: e.facts.inputs_params * e.holds_inputs * e.made_gradient_bytes,
                        "the embedding's gradient, whole in its backward", "tp", when="end")
    # It stays whole (a partial sum over the tp ranks) until it is reduced: accumulated over micro-batches, the
    # whole table (tracked: 7.8 GiB in float32 on a 405B pipeline's first stage under FSDP).
    estimate.grad_whole_params = lambda e: e.facts.inputs_params * e.holds_inputs * (1 - 1 / degree)


def split_logits(estimate, sp: bool, degree: int) -> None:
    """Loss parallel: the logits and the loss's tensors of their shape split by vocabulary, and the third float32
    tensor of that shape its backward makes."""
    facts = estimate.facts
    logits = facts.outer_logits
    rest = facts.outer_saved - logits
    # With sequence parallel the final norm's tensors stay split along the sequence; the output layer's input,
    # gathered along it, is whole.
    whole = min(facts.block_input, rest) if sp else rest
    estimate.outer_split *= facts.outer_saved / ((logits + rest - whole) / degree + whole)
    estimate.logits_split *= degree
    # Its backward (torch's loss-parallel cross entropy) makes a third float32 tensor of the logits' shape
    # beside the two an eager loss makes (tracked: four of them as backward starts, the log-probabilities kept),
    # a chunked loss's for each chunk.
    estimate.add_memory("activations", lambda e: e.holds_outputs * (not e.loss_keeps_logits) * e.logits_at_once
                        * e.facts.outer_logits / e.logits_split,
                        "the loss-parallel backward's third float32 tensor of the logits' shape", "tp",
                        when="start")


def add_stream_collectives(estimate, plugin_config, plan, degree: int) -> None:
    """The residual stream's gathers and reductions per block and micro-batch, and the outer modules' (the step
    waits for them, but for the share AsyncTP hides behind its matmuls)."""
    layout, sp = plan.model.tensor_parallel, plugin_config.sequence_parallel
    # Calls per forward and backward as torch runs them (counted by tests/test_planner_collectives.py), per dense and sparse
    # block from the layout; the embeddings', the output's and the loss's besides. With sequence parallel the
    # norms' gradients, partial sums over the sequence, are all-reduced once more when data-parallel sharding
    # reduces them too.
    sharded = plan.provides(DATA_PARALLEL_SHARDING)
    experts_layer = plan.model.experts.layer if plan.model.experts is not None else None
    outer = (4 + sharded * len(layout.final_norms)) if sp else 2

    def each_block(e):
        sparse = set(e.sparse_blocks())
        return ((block_collectives(layout, sp, sharded, experts_layer if i in sparse else None,
                                   gathered_sizes(e, i, layout) if sp else {}), e.recomputes(i)) for i in e.blocks)

    def streams(e):  # bytes a rank sends per step
        # The embeddings' output reduced and its gradient gathered back (or both all-reduced: as many bytes), the
        # output layer's input gathered and its gradient reduced; without loss parallel the logits gathered whole.
        outer = (2 * e.holds_inputs + 2 * e.holds_outputs) * e.facts.block_input
        outer += e.holds_outputs * (not plugin_config.loss_parallel) * e.facts.outer_logits
        blocks = sum(block.streams(recomputes) for block, recomputes in each_block(e)) * e.facts.block_input
        return (blocks + outer) * e.microbatch_tokens * e.microbatches_per_step() * (degree - 1) / degree

    hidden = ASYNC_TP_HIDDEN if plugin_config.async_tp else 0.0
    estimate.add_collective(
        "residual stream gathered and reduced", (TP,), lambda e: streams(e) * (1 - hidden), overlapped=False,
        plugin="tp", calls=lambda e: (sum(block.calls(recomputes) for block, recomputes in each_block(e))
                                      + outer * (e.holds_inputs or e.holds_outputs)) * e.microbatches_per_step())
    if hidden:
        estimate.add_collective("residual stream gathered and reduced, behind AsyncTP's matmuls", (TP,),
                                lambda e: streams(e) * hidden, overlapped=True, plugin="tp", calls=0)


def gathered_sizes(estimate, index: int, layout: TensorParallelLayout) -> dict[str, float]:
    """What block ``index``'s gathers move relative to the stream in the compute dtype where a conversion casts the
    shard first (``Estimate.gathered_itemsize``, as ``GatherCasts`` at run time), by region (its input, when every
    reader asks for the same) and by row-wise linear (its output's gradient); the rest move the stream as it is."""
    asked = estimate.gathered_itemsize
    if asked is None:
        return {}
    wide = estimate.compute_dtype.itemsize
    sizes = {path: size / wide for path in layout.block_rowwise if (size := asked(estimate, index, path))}
    for region in layout.block_regions:
        readers = {asked(estimate, index, path) for path in stream_readers(layout, region)}
        if len(readers) == 1 and (size := readers.pop()):
            sizes[region] = size / wide
    return sizes


def cast_shares(estimate, index: int, path: str, layout: TensorParallelLayout, degree: int) -> tuple[float, float]:
    """What the linear at ``path`` casts itself of its input and of its output's gradient (``Estimate.cast_shares``):
    a region's input cast before its gather is cast once, on the shard (counted on its first reader); a row-wise
    linear's output gradient, on its shard."""
    sizes = gathered_sizes(estimate, index, layout)
    region = next((r for r in layout.block_regions if within(path, r)), None)
    if region in sizes and path in (readers := stream_readers(layout, region)):
        return (1 / degree if path == readers[0] else 0.0), 1.0
    return 1.0, (1 / degree if path in sizes and path in layout.block_rowwise else 1.0)


@dataclass(frozen=True)
class BlockCollectives:
    """One block's collective calls under tp in forward and in backward, and the residual stream's sizes they move
    (a gather or a reduce-scatter moves one, an all-reduce two); ``output_streams``: those of the reduction making
    the block's output (0 when a mixture-of-experts layer computing its share of the tokens ends the block)."""

    forward: int
    backward: int
    forward_streams: float
    backward_streams: float
    output_streams: float

    # A checkpointed block runs its forward again in backward, collectives included, up to the last result its
    # backward needs (torch's early stop): all but a reduction making the block's output, which nothing needs.
    def calls(self, recomputes: bool) -> int:
        return self.forward + self.backward + recomputes * (self.forward - bool(self.output_streams))

    def streams(self, recomputes: bool) -> float:
        return self.forward_streams + self.backward_streams + recomputes * (self.forward_streams - self.output_streams)


def block_collectives(layout: TensorParallelLayout, sp: bool, sharded: bool, experts_layer: str | None,
                      sizes: dict[str, float]) -> BlockCollectives:
    """A dense block's collectives, or with ``experts_layer`` a sparse block's, whose layer there splits its
    tokens instead of its weights; a gather named in ``sizes`` (:func:`gathered_sizes`) moves that share of the
    stream."""
    forward = backward = output_streams = 0
    forward_streams: float = 0  # a gather named in sizes moves a share of the stream
    backward_streams: float = 0
    reduction = 1 if sp else 2  # a reduce-scatter, or an all-reduce
    for region in layout.block_regions:
        if within(region, experts_layer):
            continue
        rowwise = [path for path in layout.block_rowwise if within(path, region)]
        # The stream enters gathered (sequence parallel); each row-wise linear's output is reduced, its gradient
        # gathered back (sequence parallel).
        forward += sp + len(rowwise)
        forward_streams += sp * sizes.get(region, 1.0) + len(rowwise) * reduction
        backward += sp * len(rowwise)
        backward_streams += sp * sum(sizes.get(path, 1.0) for path in rowwise)
        output_streams = reduction if rowwise else 0
        if any(within(path, region) for path in layout.block_replicated):
            # Low-rank attention: whole modules take the stream, whose gradient is then whole on every rank; each
            # column-wise linear takes a whole module's smaller output and reduces its own input's gradient.
            backward += sum(within(path, region) for path in layout.block_colwise)
        else:  # the column-wise linears' partial input gradients, summed, in one reduction
            backward, backward_streams = backward + 1, backward_streams + reduction
    # Gradients summed over the ranks' heads; the norms' when a sharder reduces them too (over the heads, and
    # with sequence parallel over the sequence).
    backward += len(layout.head_shared) + sharded * (len(layout.head_norms) + sp * len(layout.block_norms))
    if experts_layer is not None:
        # Its share of the tokens ends the block. Without sequence parallel it takes the share from the replicated
        # stream (gathering the gradients' shares back in backward) and gathers the results, which make the output.
        output_streams = 0 if sp else 1
        forward, forward_streams = forward + (not sp), forward_streams + (not sp)
        backward, backward_streams = backward + (not sp), backward_streams + (not sp)
    return BlockCollectives(forward, backward, forward_streams, backward_streams, output_streams)


@hookimpl
def plan_options(model, hardware):
    """tp: off, or degrees 2, 4, 8 that divide the model's heads and stay within a node's fast links."""
    layout = model.tensor_parallel
    degrees = [d for d in (2, 4, 8) if d <= hardware.devices_per_node
               and all(count % d == 0 for count in (layout.divisible.values() if layout else ()))]
    return [None, *({"degree": d} for d in degrees)] if layout is not None else [None]
