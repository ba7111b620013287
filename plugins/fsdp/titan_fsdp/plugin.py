"""FSDP2: every block the model describes, then the root, sharded with ``fully_shard`` over the data-parallel mesh.

The shard mesh is ``dp_shard`` flattened with ``cp`` when context parallel is on (the ranks of one
context-parallel group hold different tokens of the same samples, so their gradients are averaged
like those of different samples), and ``dp_replicate`` adds an outer replica dimension (HSDP).
"""

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan_core import ConfigError, Declaration, hookimpl
from titan_core.capabilities import DATA_PARALLEL_SHARDING, PARTIAL_DATA_PARALLEL, SPLIT_BACKWARD
from titan_core.data_parallel import replicated_over
from titan_core.description import attribute, lacks
from titan_core.options import FLOAT_DTYPES, compute_dtype, float_dtype, replica_count

STAGE = 600  # last: it shards whatever the transforms before it (TP, AC, compile) produced
RESHARD = ("default", "always", "never")


@hookimpl
def declare(plugin_config):
    mesh = {"dp_shard": plugin_config.degree}
    if replica_count(plugin_config.replicate_degree, "plugins.fsdp.replicate_degree") != 1:
        mesh["dp_replicate"] = plugin_config.replicate_degree
    return Declaration(stage=STAGE, mesh=mesh, provides=frozenset({DATA_PARALLEL_SHARDING, PARTIAL_DATA_PARALLEL}))


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


@hookimpl
def apply_parallelism(model_parts, mesh, plugin_config, plan):
    """fsdp: shard each block, the embeddings, the final norm with the output layer, then each model part's
    remaining parameters, over the data-parallel mesh."""
    dp_mesh = mesh.submesh("dp_replicate", ("dp_shard", "cp"))
    policy = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=compute_dtype(plugin_config.param_dtype, "plugins.fsdp.param_dtype", mesh.device_type),
            reduce_dtype=FLOAT_DTYPES[plugin_config.reduce_dtype]),
        # Pinned memory needs an accelerator; on a CPU-only job plain memory is the only kind.
        offload_policy=(CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if plugin_config.cpu_offload
                        else OffloadPolicy()),
    )
    pipelined = len(model_parts) > 1 or "pp" in mesh.shape
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
                        **{**policy, "mesh": mesh.submesh("dp_replicate", tuple(dims))})
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
    gathered in forward and again in backward (behind the computation), gradients reduce-scattered."""
    shards = plan.degree("dp_shard") * plan.degree("cp")
    estimate.state_shards *= shards
    estimate.compute_dtype = compute_dtype(plugin_config.param_dtype, "plugins.fsdp.param_dtype", estimate.device_type)
    reduce_bytes = torch.finfo(FLOAT_DTYPES[plugin_config.reduce_dtype]).bits // 8
    pipelined = "pp" in plan.mesh_shape
    resharded = plugin_config.reshard_after_forward == "always" or (
        plugin_config.reshard_after_forward == "default" and not pipelined)

    def gathered(e):  # bytes of the weights one rank holds, as gathered
        return e.held_params() / e.weight_split * gathered_bytes(e)

    def sent(e, total):
        return total * (shards - 1) / shards

    micro = 1 if pipelined else estimate.grad_accum  # a pipeline gathers and reduces once per step
    gathers = (2 if resharded else 1) * micro
    def units(e):  # one call per block, one for the output layer, one for the rest of the model
        return len(e.blocks) + 2

    def gather_calls(e):  # backward gathers again all but the last block and the output (never resharded)
        return micro * (units(e) + (units(e) - 2) * resharded)

    estimate.add_collective("all-gather of the weights", ("dp_shard", "cp"), lambda e: sent(e, gathers * gathered(e)),
                            overlapped=True, plugin="fsdp", calls=gather_calls)
    estimate.add_collective("reduce-scatter of the gradients", ("dp_shard", "cp"),
                            lambda e: sent(e, micro * e.held_params() / e.weight_split * reduce_bytes),
                            overlapped=True, plugin="fsdp", calls=lambda e: micro * units(e))
    replicas = plan.degree("dp_replicate")
    if replicas > 1:
        estimate.add_collective("all-reduce of the gradient shards", ("dp_replicate",),
                                lambda e: 2 * micro * e.held_params() / e.weight_split / shards * reduce_bytes
                                * (replicas - 1) / replicas, overlapped=True, plugin="fsdp",
                                calls=lambda e: micro * units(e))
    if pipelined:
        # torch's pipeline stages keep their FSDP weights gathered and their gradients unreduced until the
        # last micro-batch's backward: whole, for every block of the rank.
        estimate.add_memory("buffers", lambda e: e.held_params() / e.weight_split * gathered_bytes(e),
                            "weights gathered for the whole step (pipeline)", "fsdp")
        estimate.add_memory("buffers", lambda e: e.held_params() / e.weight_split * reduce_bytes,
                            "gradients accumulated whole until the last micro-batch (pipeline)", "fsdp")
        return
    # As backward starts, the last block (never resharded) and the output layer's unit are gathered; then the
    # block running backward, the ones prefetched, and the gradients of the one before being reduced.
    estimate.add_memory("buffers", lambda e: (e.largest_block_params() + e.facts.outputs_params * e.holds_outputs)
                        / e.weight_split * gathered_bytes(e), "the last block and the output gathered", "fsdp",
                        when="start")
    in_flight = 1 + max(plugin_config.prefetch, 1)
    estimate.add_memory("buffers", lambda e: e.largest_block_params() / e.weight_split * (
        in_flight * gathered_bytes(e) + reduce_bytes), "gathered blocks and a reduce-scatter", "fsdp", when="blocks")


def gathered_bytes(estimate) -> int:
    """Bytes per weight element as gathered: float8 when a plugin says so, else the compute dtype's."""
    return estimate.gather_bytes or torch.finfo(estimate.compute_dtype).bits // 8


@hookimpl
def plan_options(world_size, hardware):
    """fsdp: shard over every rank the others leave; across nodes, also HSDP with one replica per node."""
    nodes = world_size // hardware.devices_per_node
    return [{"degree": -1, "replicate_degree": 1}] + (
        [{"degree": -1, "replicate_degree": nodes}] if nodes > 1 and world_size % hardware.devices_per_node == 0 else [])
