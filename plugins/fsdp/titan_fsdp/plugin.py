"""FSDP2: every block the model describes, then the root, sharded with ``fully_shard`` over the data-parallel mesh.

The shard mesh is ``dp_shard`` flattened with ``cp`` when context parallel is on (the ranks of one
context-parallel group hold different tokens of the same samples, so their gradients are averaged
like those of different samples), and ``dp_replicate`` adds an outer replica dimension (HSDP).
"""

import math
import warnings

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan_core import (CP, DATA_PARALLEL_SHARDING, DP_REPLICATE, DP_SHARD, FLOAT_DTYPES, MIXED_PRECISION,
                        PARTIAL_DATA_PARALLEL, PP, SPLIT_BACKWARD, ConfigError, Declaration, attribute, compute_dtype,
                        evaluated, float_dtype, hookimpl, lacks, replica_count, replicated_over)

# FSDP2 warns once per process that a unit returned a view (tensor parallel's embedding does): an in-place op
# on that view would skip the unit's all-gather. No shipped model writes a block's output in place, and a model
# that did would fail the conformance kit's fsdp case, which is where its author can act on it.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")

STAGE = 600  # last: it shards whatever the transforms before it (TP, AC, compile) produced
RESHARD = ("default", "always", "never")
REDUCE = ("every_micro_batch", "last_micro_batch")


@hookimpl
def declare(plugin_config):
    mesh = {DP_SHARD: plugin_config.degree}
    if replica_count(plugin_config.replicate_degree, "plugins.fsdp.replicate_degree") != 1:
        mesh[DP_REPLICATE] = plugin_config.replicate_degree
    return Declaration(stage=STAGE, mesh=mesh, provides=frozenset({DATA_PARALLEL_SHARDING, PARTIAL_DATA_PARALLEL,
                                                                   MIXED_PRECISION}))


@hookimpl
def validate(plugin_config, plan):
    if plan.model.blocks is None:
        raise ConfigError("plugins.fsdp", lacks(plan.model, "blocks", "FSDP (one unit per block)"),
                          "use simplefsdp, or describe the model's blocks")
    if plugin_config.param_dtype is not None:
        float_dtype(plugin_config.param_dtype, "plugins.fsdp.param_dtype")
    float_dtype(plugin_config.reduce_dtype, "plugins.fsdp.reduce_dtype")
    if plugin_config.reshard_after_forward not in RESHARD:
        raise ConfigError("plugins.fsdp.reshard_after_forward", f"unknown policy '{plugin_config.reshard_after_forward}'",
                          f"use one of {', '.join(RESHARD)}")
    if plugin_config.reshard_after_forward == "always" and plan.provides(SPLIT_BACKWARD):
        # Found by the stack matrix: resharding between the input- and weight-gradient passes gave wrong
        # gradients (losses off by 1e-1 with ZBVZeroBubble and InterleavedZeroBubble, 4e-3 with DualPipeV).
        raise ConfigError("plugins.fsdp.reshard_after_forward", "'always' reshards parameters between the input- "
                          "and weight-gradient passes of a pipeline schedule that splits backward, which trains wrong",
                          "use reshard_after_forward=default, or a schedule that does not split backward")
    if plugin_config.prefetch < 0:
        raise ConfigError("plugins.fsdp.prefetch", f"{plugin_config.prefetch} is negative", "use 0 or more blocks")
    if plugin_config.reduce_gradients not in REDUCE:
        raise ConfigError("plugins.fsdp.reduce_gradients", f"unknown policy '{plugin_config.reduce_gradients}'",
                          f"use one of {', '.join(REDUCE)}")
    if plugin_config.reduce_gradients == "last_micro_batch" and PP in plan.mesh_shape:
        raise ConfigError("plugins.fsdp.reduce_gradients", "a pipeline schedule decides itself when its stages "
                          "reduce gradients (once per pipeline step)", "set reduce_gradients=every_micro_batch "
                          "with pp")


@hookimpl
def apply_parallelism(model_parts, mesh, plugin_config, plan):
    """fsdp: shard each block, the embeddings, the final norm with the output layer, then each model part's
    remaining parameters, over the data-parallel mesh."""
    dp_mesh = mesh.submesh(DP_REPLICATE, (DP_SHARD, CP))
    policy = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=compute_dtype(plugin_config.param_dtype, "plugins.fsdp.param_dtype", mesh.device_type),
            reduce_dtype=FLOAT_DTYPES[plugin_config.reduce_dtype]),
        # Pinned memory needs an accelerator; on a CPU-only job plain memory is the only kind.
        offload_policy=(CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if plugin_config.cpu_offload
                        else OffloadPolicy()),
    )
    pipelined = len(model_parts) > 1 or PP in mesh.shape
    for part in model_parts:
        blocks = list(plan.model.blocks_of(part).values())
        for i, block in enumerate(blocks):
            reshard = _reshard(plugin_config, last=i == len(blocks) - 1, pipelined=pipelined)
            _shard_partly_split(block, mesh, reshard, policy)
            fully_shard(block, reshard_after_forward=reshard, **policy)
        reshard_root = plugin_config.reshard_after_forward == "always"
        # Units of their own, so that no rank holds a whole embedding or output layer for the step (at 8B:
        # 2.1 GB in bf16 at any data-parallel degree). The outputs are needed again right away by backward.
        for paths, reshard in ((plan.model.inputs, _reshard(plugin_config, last=False, pipelined=pipelined)),
                               (plan.model.outputs, reshard_root)):
            modules = [m for m in (attribute(part, path) for path in paths or ()) if m is not None]
            if modules:
                fully_shard(modules, reshard_after_forward=reshard, **policy)
        fully_shard(part, reshard_after_forward=reshard_root, **policy)
        _prefetch(blocks, plugin_config.prefetch)


@hookimpl
def batch_context(micro_batch, micro_batches, model_parts, plugin_config):
    """fsdp: with reduce_gradients=last_micro_batch, reduce-scatter (HSDP: and all-reduce) the gradients in the
    last micro-batch's backward only; the earlier ones accumulate whole, unsharded gradients."""
    if plugin_config.reduce_gradients == "last_micro_batch":
        for part in model_parts:
            part.set_requires_gradient_sync(micro_batch == micro_batches - 1)


def _shard_partly_split(block, mesh, reshard: bool, policy: dict) -> None:
    """Modules another plugin already split over some ranks (expert parallel's experts, tensor parallel's
    mixture-of-experts layers): their own FSDP unit over the ranks they are replicated on, innermost first,
    gradients summed there and divided like the dense ones'."""
    # Each data-parallel and context-parallel rank averages its loss over its own tokens.
    divisor = policy["mesh"].size()
    for module in reversed(list(block.modules())):
        dims = replicated_over(module)
        if dims is not None:
            fully_shard(module, reshard_after_forward=reshard,
                        **{**policy, "mesh": mesh.submesh(DP_REPLICATE, tuple(dims))})
            module.set_gradient_divide_factor(divisor)
            # A divide factor reduce-scatters with NCCL's PREMUL_SUM, which gloo lacks: sum, then divide. Not
            # over a single rank, where torch 2.13 would divide twice (it divides when copying the gradient).
            if mesh.device_type == "cpu" and mesh.submesh(tuple(dims)).size() > 1:
                module.set_force_sum_reduction_for_comms(True)


def _reshard(plugin_config, last: bool, pipelined: bool) -> bool:
    policy = plugin_config.reshard_after_forward
    if policy != "default":
        return policy == "always"
    # The last block's backward starts right after forward, and pipeline schedules run several
    # micro-batches' forwards before their backwards: resharding there only repeats all-gathers.
    return not (last or pipelined)


def _prefetch(blocks, depth: int) -> None:
    if depth == 0:
        return
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - depth):i][::-1])


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """fsdp: parameters, gradients and optimizer states divided over the shard ranks; each block's weights
    gathered in forward and again in backward (behind the computation), gradients reduce-scattered (each
    micro-batch, or the last only with whole gradients held until then)."""
    shards = plan.degree(DP_SHARD) * plan.degree(CP)
    estimate.state_shards *= shards
    estimate.sharder_holds_gradients = True  # reduced as backward makes them, or held whole by its own term
    estimate.compute_dtype = compute_dtype(plugin_config.param_dtype, "plugins.fsdp.param_dtype", estimate.device_type)
    reduce_bytes = torch.finfo(FLOAT_DTYPES[plugin_config.reduce_dtype]).bits // 8
    pipelined = PP in plan.mesh_shape
    resharded = plugin_config.reshard_after_forward == "always" or (
        plugin_config.reshard_after_forward == "default" and not pipelined)

    def sent(e, total):
        return total * (shards - 1) / shards

    micro = 1 if pipelined else estimate.grad_accum  # a pipeline gathers and reduces once per step
    gathers = (2 if resharded else 1) * micro
    reductions = 1 if plugin_config.reduce_gradients == "last_micro_batch" else micro

    def sparse_sharded(e) -> int:
        # Per mixture-of-experts block, its modules another plugin split partly (Estimate.sparse_units): a unit of
        # their own each, sharded over the ranks they are whole on (a unit over one rank issues nothing).
        return sum(math.prod(plan.degree(d) for d in dims) > 1 for dims in e.sparse_units)

    def sharded_units(e):  # one per block, one for the output layer, one for the rest, and the experts' own
        return (shards > 1) * (len(e.blocks) + 2) + len(e.sparse_blocks()) * sparse_sharded(e)

    def gather_calls(e):
        # Backward gathers again every unit but the last block's (its mixture-of-experts units too) and the
        # output's, never resharded.
        sparse = e.sparse_blocks()
        last_sparse = bool(sparse) and sparse[-1] == e.blocks[-1]
        regathered = (shards > 1) * len(e.blocks) + (len(sparse) - last_sparse) * sparse_sharded(e)
        return micro * (sharded_units(e) + regathered * resharded)

    estimate.add_collective("all-gather of the weights", (DP_SHARD, CP), lambda e: sent(e, gathers * e.held_gathered_bytes()),
                            overlapped=True, plugin="fsdp", calls=gather_calls)
    estimate.add_collective("reduce-scatter of the gradients", (DP_SHARD, CP),
                            lambda e: sent(e, reductions * e.held_gathered() * reduce_bytes),
                            overlapped=True, plugin="fsdp", calls=lambda e: reductions * sharded_units(e))
    replicas = plan.degree(DP_REPLICATE)
    if replicas > 1:
        estimate.add_collective("all-reduce of the gradient shards", (DP_REPLICATE,),
                                lambda e: 2 * reductions * e.held_gathered() / shards * reduce_bytes
                                * (replicas - 1) / replicas, overlapped=True, plugin="fsdp",
                                calls=lambda e: reductions * (len(e.blocks) + 2 + len(e.sparse_blocks()) * len(e.sparse_units)))

    def unreduced(e):
        # Whole until the last micro-batch's reduce-scatter makes its shard and frees it: at the peak the whole
        # gradients stand where the core counts shards (tracked: a stage holds the whole ones only), with what
        # another plugin's backward makes beyond its split of the weights.
        whole = e.held_gathered() + evaluated(e.grad_whole_params, e)
        return (whole * reduce_bytes - 4 * e.sharded_params()) * e.trained_share

    # FSDP2 gathers on a stream of its own and reduces on another: a caching allocator keeps each stream's freed
    # blocks for that stream, so as the peak comes the gathers' room and the gradient shards' (freed by the step's
    # start) stay reserved beside what the compute stream allocates. Reduced once a step (a pipeline's, or in the
    # last micro-batch), every shard is made there after the peak, which counts the gradients whole instead.
    ahead = max(plugin_config.prefetch, 1)
    once = pipelined or reductions < micro
    estimate.add_memory("buffers", lambda e: e.gathered_weight_bytes(e.largest_block_gathered() * ahead,
                                                                     e.facts.outputs_params / e.weight_split),
                        "the all-gathers' stream: a block and the output gathered", "fsdp", when="cached")

    def shards_not_made(e):
        shards = 4 * e.sharded_params() * e.trained_share
        return shards if once else max(0.0, shards - e.memory()["gradients"])
    estimate.add_memory("buffers", shards_not_made, "the reduce-scatters' stream: the gradient shards not made yet",
                        "fsdp", when="cached")
    if pipelined:
        # torch's pipeline stages keep their FSDP weights gathered after each backward and their gradients
        # unreduced until the last micro-batch's: whole, for every block of the rank. Resharded after forward
        # (always), a backward that follows a forward gathers them again block by block.
        estimate.add_memory("buffers", lambda e: e.held_gathered_bytes(),
                            "weights gathered again by backward and kept (pipeline)" if resharded
                            else "weights gathered for the whole step (pipeline)", "fsdp",
                            when="regathered" if resharded else None)
        estimate.backward_prefetch = max(plugin_config.prefetch, 1)  # FSDP2 prefetches one block unasked
        # Experts another plugin split are a unit of their own (_shard_partly_split), gathered only when reached.
        estimate.prefetched_gathered = lambda e, i: e.block_gathered(i) - (e.expert_split > 1) * e.experts_gathered(i)
        estimate.add_memory("buffers", unreduced, "gradients accumulated whole until the last micro-batch, beyond "
                            "their shards (pipeline)", "fsdp", when="accumulated")
        return
    if reductions < micro:
        # Reduced in the last micro-batch only: until then each parameter's gradient accumulates whole.
        estimate.add_memory("buffers", unreduced, "gradients accumulated whole until the last micro-batch, beyond "
                            "their shards (reduce_gradients)", "fsdp", when="accumulated")
    in_flight = 1 + max(plugin_config.prefetch, 1)
    if plugin_config.reshard_after_forward == "never":
        def reducing(e):  # the block before the one running backward has its gradients reduced
            return e.largest_block_gathered() * reduce_bytes
    else:
        def reducing(e):  # the block running backward, those prefetched, the one before reduced
            return e.largest_block_gathered() * (in_flight * e.block_gather_bytes() + reduce_bytes)
    if reductions == micro:
        _add_outer_reductions(estimate, reducing, reduce_bytes, shards,
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
