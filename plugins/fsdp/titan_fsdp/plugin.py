"""FSDP2: every block the model describes, then the root, sharded with ``fully_shard`` over the data-parallel mesh.

The shard mesh is ``dp_shard`` flattened with ``cp`` when context parallel is on (the ranks of one
context-parallel group hold different tokens of the same samples, so their gradients are averaged
like those of different samples), and ``dp_replicate`` adds an outer replica dimension (HSDP).
"""

import warnings

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan_core import (CP, DATA_PARALLEL_SHARDING, DP_REPLICATE, DP_SHARD, FLOAT_DTYPES, MIXED_PRECISION,
                        PARTIAL_DATA_PARALLEL, PP, SPLIT_BACKWARD, ConfigError, Declaration, attribute, compute_dtype,
                        float_dtype, hookimpl, lacks, replica_count, replicated_over)

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
                          "reduce gradients (once per pipeline step)",
                          "set plugins.fsdp.reduce_gradients=every_micro_batch with pp")


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
