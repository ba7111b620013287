"""Tensor parallel: every block's attention and feed-forward split over the ``tp`` mesh dimension.

Megatron-style, by the layout the model describes (``ModelDescription.tensor_parallel``): the query, key,
value and up-projections are split by output features (each rank holds whole heads and a slice of the
hidden units), the projections back into the residual stream by input features, so one block costs one
all-reduce in each of forward and backward per sub-layer. Embeddings are split by rows and the output
layer by vocabulary columns. With sequence parallel the residual stream and the norms between those regions are
split along the sequence instead of replicated, turning each all-reduce into a reduce-scatter plus an
all-gather and dividing the norms' activation memory by the degree. With loss parallel the logits stay
split by vocabulary and cross entropy reduces across ranks, never materializing the whole vocabulary.

A mixture-of-experts layer (``ModelDescription.experts``) computes each token on its own, so its tokens
are split instead of its weights: each rank routes and computes its share of the sequence (already its
own under sequence parallel; otherwise taken from the replicated stream and gathered back after), with
the router, experts and shared experts whole on every rank. Their gradients then differ per rank: the
layer is marked for the data-parallel sharder to sum them over tp as well (``replicate_only_over``),
which is why such a model needs a sharder with ``partial_data_parallel``. Expert parallel borrows tp's
ranks, sending each rank's tokens to the experts' ranks, so no expert is computed twice.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from titan_core import (COMPILE, CP, DP_SHARD, PARTIAL_DATA_PARALLEL, TENSOR_PARALLEL, TP, ConfigError,
                        Declaration, TensorParallelLayout, attribute, device_kind, gather_casts, hookimpl, lacks,
                        replicate_only_over)

# The ranks over which a mixture-of-experts layer computing its share of the tokens is whole: its sharder sums
# its gradients over all of them.
TOKEN_SPLIT_REPLICAS = (DP_SHARD, CP, TP)
STAGE = 200  # after pipeline splitting (each stage is parallelized like a whole model), before CP, AC, compile, FSDP


@hookimpl
def declare(plugin_config):
    # AsyncTP's fused collective-matmuls are an inductor pass: without a compiler nothing is fused.
    requires = frozenset({COMPILE}) if plugin_config.async_tp else frozenset()
    return Declaration(stage=STAGE, mesh={TP: plugin_config.degree},
                       provides=frozenset({TENSOR_PARALLEL}), requires=requires)


@hookimpl
def validate(config, plugin_config, plan):
    degree = plan.degree(TP)
    layout = plan.model.tensor_parallel
    if layout is None or plan.model.blocks is None:
        raise ConfigError("plugins.tp", lacks(plan.model, "tensor_parallel" if layout is None else "blocks",
                                              "tensor parallel"), "remove tp from +plugins=[...]")
    for field, count in layout.divisible.items():
        if count % degree:
            raise ConfigError(field, f"{count} does not split over tp degree {degree}",
                              f"choose plugins.tp.degree dividing {count}")
    if plugin_config.sequence_parallel and not layout.sequence_parallel:
        raise ConfigError("plugins.tp.sequence_parallel", f"model '{plan.model.family}' cannot take a residual stream "
                          "split by sequence (its layout says sequence_parallel=False)",
                          "set plugins.tp.sequence_parallel=false")
    experts = plan.model.experts
    if experts is not None:
        _check_token_split(experts, plan)
    if plugin_config.sequence_parallel or experts is not None:
        # The sequence each rank sees (after context parallel's split) is split again over tp.
        local_seq = config.training.seq_len // plan.degree(CP)
        if local_seq % degree:
            split = "sequence parallel" if plugin_config.sequence_parallel else "a mixture-of-experts layer"
            raise ConfigError("training.seq_len", f"{split} splits {local_seq} tokens per context-parallel "
                              f"rank over tp degree {degree}", f"use a seq_len divisible by {degree * plan.degree('cp')}"
                              + (" or plugins.tp.sequence_parallel=false" if experts is None else ""))
    if plugin_config.async_tp:
        _check_async_tp(config, plugin_config)


def _check_token_split(experts, plan) -> None:
    if not experts.layer:
        raise ConfigError("plugins.tp", f"model '{plan.model.family}' keeps its experts at the root of a block "
                          f"('{experts.module}'), not in a mixture-of-experts sub-layer whose tokens tp can split",
                          "describe ExpertsLayout.module inside the layer (e.g. 'mlp.experts'), or remove tp")
    if not plan.provides(PARTIAL_DATA_PARALLEL):
        raise ConfigError("plugins.tp", "on a mixture-of-experts model each tp rank trains the experts' layer on "
                          "its own tokens, whose gradients a data-parallel sharder with partial_data_parallel must sum",
                          "add fsdp to +plugins=[...] (plugins.fsdp.degree=1 if the ranks are all for tp)")


def _check_async_tp(config, plugin_config) -> None:
    if device_kind(config.launch.device) != "cuda" or (config.launch.backend or "nccl") != "nccl":
        # Off CUDA/NCCL torch accepts the settings and silently runs plain collectives, unfused.
        raise ConfigError("plugins.tp.async_tp", "AsyncTP needs CUDA GPUs with NCCL symmetric memory, which this "
                          "job does not have", "set plugins.tp.async_tp=false")
    if not plugin_config.sequence_parallel:
        raise ConfigError("plugins.tp.async_tp", "AsyncTP fuses the all-gathers and reduce-scatters of sequence "
                          "parallel, which is off", "set plugins.tp.sequence_parallel=true")


@hookimpl
def apply_parallelism(model_parts, mesh, plugin_config, plan):
    """tp: split every part's outer modules and blocks over the tp mesh, as the model's layout says."""
    tp_mesh = mesh.submesh(TP)
    layout = plan.model.tensor_parallel
    sp, lp = plugin_config.sequence_parallel, plugin_config.loss_parallel
    for part in model_parts:
        frozen = {name for name, param in part.named_parameters() if not param.requires_grad}
        apply_outer_plan(part, layout, tp_mesh, sp, lp)
        for block in plan.model.blocks_of(part).values():
            experts_layer = plan.model.experts.layer if plan.model.experts_of(block) is not None else None
            apply_block_plan(block, layout, tp_mesh, sp, experts_layer)
        # torch's SequenceParallel, like any fresh nn.Parameter, makes a replicated norm weight trainable again:
        # a frozen model (LoRA's base) would train its norms under tp and no longer be the model it was.
        for name, param in part.named_parameters():
            param.requires_grad_(name not in frozen)
    if plugin_config.async_tp:
        apply_async_tp(tp_mesh)


def apply_outer_plan(model: nn.Module, layout: TensorParallelLayout, tp_mesh, sp: bool, lp: bool) -> None:
    """Embeddings, final norms and output layer; a pipeline stage holds only some of them (None for the rest)."""
    stream = Shard(1) if sp else Replicate()
    plan = {name: RowwiseParallel(input_layouts=Replicate(), output_layouts=stream) for name in layout.embeddings}
    plan[layout.output] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if lp else Replicate(),
                                          use_local_output=not lp)  # loss parallel needs the sharded DTensor
    if sp:
        plan |= {name: SequenceParallel() for name in layout.final_norms}
    parallelize_module(model, tp_mesh, {name: style for name, style in plan.items()
                                        if attribute(model, name) is not None})
    if not sp:
        for name in layout.final_norms:
            if attribute(model, name) is not None:
                replicate_norm(attribute(model, name), tp_mesh)


def apply_block_plan(block: nn.Module, layout: TensorParallelLayout, tp_mesh, sp: bool,
                     experts_layer: str | None = None) -> None:
    """Split the block's weights as the layout says, except inside ``experts_layer`` (a mixture-of-experts
    sub-layer, present in sparse blocks only), whose tokens are split instead."""
    def weights_split(name: str) -> bool:
        return not within(name, experts_layer)

    stream = Shard(1) if sp else Replicate()
    plan = {name: OwnColwise() for name in layout.block_colwise if weights_split(name)}
    plan |= {name: OwnRowwise(output_layouts=stream) for name in layout.block_rowwise if weights_split(name)}
    # Each rank normalizes its own heads: the norm's weight is replicated and its gradient summed over ranks.
    plan |= {name: SequenceParallel(sequence_dim=2, use_local_output=True) for name in layout.head_norms}
    if sp:
        plan |= {name: SequenceParallel() for name in layout.block_norms}
    parallelize_module(block, tp_mesh, plan)
    for name in filter(weights_split, layout.block_regions):
        readers = [block.get_submodule(path) for path in stream_readers(layout, name)]
        enter_whole(block.get_submodule(name), tp_mesh, sp, readers)
    if not sp:
        for name in layout.block_norms:
            replicate_norm(block.get_submodule(name), tp_mesh)
    for name in layout.block_replicated:
        replicate_norm(block.get_submodule(name), tp_mesh)
    for name in layout.head_shared:
        block.get_submodule(name).register_forward_hook(lambda module, args, output: sum_gradient_over(output, tp_mesh))
    for name in layout.head_parameters:
        split_by_heads(block, name, tp_mesh)
    if experts_layer is not None:
        split_tokens(block.get_submodule(experts_layer), tp_mesh, sp)


def stream_readers(layout: TensorParallelLayout, region: str) -> list[str]:
    """The paths of the linears of ``region`` that read the stream entering it: its column-wise ones, unless whole
    modules take the stream there (low-rank attention), whose outputs those linears read instead."""
    if any(within(path, region) for path in layout.block_replicated):
        return []
    return [path for path in layout.block_colwise if within(path, region)]


def shared_input_cast(linears: list[nn.Module]):
    """The cast every one of ``linears`` asks for its gathered input (the same for all), or None."""
    casts = [gather_casts(linear) for linear in linears]
    marked = [c for c in casts if c is not None and c.input is not None]
    if not casts or len(marked) < len(casts) or len({c.same for c in marked}) > 1:
        return None
    return marked[0].input


def within(path: str, module: str | None) -> bool:
    """Whether ``path`` (within a block) is ``module`` or below it."""
    return module is not None and (path == module or path.startswith(module + "."))


class SplitsOwnWeights:
    """A linear's style that splits the linear's own weight and bias only. torch's styles split every parameter
    below the module, and a conversion may have hung modules on a linear (LoRA's adapters), whose split is the
    converting plugin's to choose; they are detached while torch splits the linear."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        children = dict(module.named_children())
        for name in children:
            delattr(module, name)
        try:
            # A mixin: _apply is that of the torch style it is mixed into (OwnColwise, OwnRowwise).
            return super()._apply(module, device_mesh)  # type: ignore[misc]
        finally:
            for name, child in children.items():
                module.add_module(name, child)


class OwnColwise(SplitsOwnWeights, ColwiseParallel):
    """ColwiseParallel of the linear's own weight and bias."""


class OwnRowwise(SplitsOwnWeights, RowwiseParallel):
    """RowwiseParallel of the linear's own weight and bias; an output split along the sequence, whose gradient
    backward gathers, has that gradient cast first when the linear asks (``GatherCasts.output_grad``)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = RowwiseParallel._prepare_output_fn(output_layouts, False, mod, outputs, device_mesh)
        casts = gather_casts(mod)
        if casts is not None and casts.output_grad is not None and any(p.is_shard() for p in output_layouts):
            outputs = casts.output_grad(outputs)
        return outputs.to_local() if use_local_output else outputs


def split_tokens(layer: nn.Module, tp_mesh, sp: bool) -> None:
    """Each rank computes the layer on its share of the sequence; the gradients of the layer's (whole)
    weights are summed over tp by the data-parallel sharder, like those of more data-parallel ranks."""
    def take_share(module, args):
        stream = args[0]
        if isinstance(stream, DTensor):  # sequence parallel: a norm's Shard(1) output, this rank's share already
            share = stream.to_local()
        elif sp:
            share = stream
        else:  # the replicated stream: keep this rank's slice (backward all-gathers the slices' gradients)
            share = DTensor.from_local(stream, tp_mesh, [Replicate()], run_check=False).redistribute(
                placements=[Shard(1)]).to_local()
        return (share, *args[1:])

    def gather_shares(module, args, output):
        return DTensor.from_local(output, tp_mesh, [Shard(1)], run_check=False).redistribute(
            placements=[Replicate()]).to_local()

    layer.register_forward_pre_hook(take_share)
    if not sp:  # under sequence parallel the residual stream stays split: the shares go on as they are
        layer.register_forward_hook(gather_shares)
    replicate_only_over(layer, TOKEN_SPLIT_REPLICAS)


def enter_whole(region: nn.Module, tp_mesh, sp: bool, readers: list[nn.Module]) -> None:
    """The residual stream (the region's first argument: its first positional one, else its first keyword one)
    enters a sub-layer as one replicated DTensor that all its linears share: under sequence parallel gathered once,
    not once per projection, and cast before the gather when every linear reading it asks for the same cast
    (``GatherCasts.input``); in backward the column-wise linears' partial input gradients add up before one
    reduction (a reduce-scatter, or without sequence parallel an all-reduce), where a plain tensor would have each
    linear all-reduce its own. Other arguments (RoPE tables, masks) pass untouched."""
    def enter(module, args, kwargs):
        key = None if args else next(iter(kwargs))
        stream = args[0] if key is None else kwargs[key]  # a DTensor when a sequence-parallel norm produced it
        if not isinstance(stream, DTensor):
            stream = DTensor.from_local(stream, tp_mesh, [Shard(1) if sp else Replicate()], run_check=False)
        # Read at each call: a conversion after this plugin's stage may keep a reader's precision.
        cast = shared_input_cast(readers) if sp else None
        if cast is not None:
            stream = cast(stream)
        whole = stream.redistribute(placements=[Replicate()])
        return ((whole, *args[1:]), kwargs) if key is None else (args, {**kwargs, key: whole})
    region.register_forward_pre_hook(enter, with_kwargs=True)


def split_by_heads(block: nn.Module, name: str, tp_mesh) -> None:
    """A parameter with one row per query head, split by rows like the heads (each rank keeps its own heads')."""
    path, _, attr = name.rpartition(".")
    module = block.get_submodule(path)
    param = getattr(module, attr)
    module.register_parameter(attr, nn.Parameter(distribute_tensor(param, tp_mesh, [Shard(0)], src_data_rank=None),
                                                 requires_grad=param.requires_grad))


def sum_gradient_over(shared: torch.Tensor, tp_mesh) -> torch.Tensor:
    """``shared`` unchanged, its gradient summed over the tp ranks in backward: each rank's heads used it and
    sent back their own part of its gradient (Megatron's copy to the tensor-parallel region)."""
    return DTensor.from_local(shared, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def replicate_norm(norm: nn.Module, tp_mesh) -> None:
    """A norm on the whole (replicated) sequence, or a module every rank runs whole (``block_replicated``), whose
    weights are replicated DTensors like every other parameter.

    As plain tensors they would sit beside DTensors in gradient clipping and FSDP, which refuse the mix.
    Their gradients need no reduction: every rank sees the same input and output gradient.
    """
    def replicate_params(name, module, mesh):
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(
                DTensor.from_local(param, mesh, [Replicate()], run_check=False)))

    distribute_module(
        norm, tp_mesh, replicate_params,
        input_fn=lambda module, inputs, mesh: tuple(x if isinstance(x, DTensor) else
                                                    DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                                                    for x in inputs),
        output_fn=lambda module, output, mesh: output.to_local())


def apply_async_tp(tp_mesh) -> None:
    """Let inductor fuse TP's collectives with the neighbouring matmuls over symmetric memory (CUDA only)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


@hookimpl
def batch_context(plugin_config):
    """tp: cross entropy and its backward dispatch to the vocabulary-sharded versions inside this context."""
    return loss_parallel() if plugin_config.loss_parallel else None
