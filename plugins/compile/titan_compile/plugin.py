"""torch.compile of every block the model describes, in place so that parameter names do not change.

Compiling per block rather than the whole model keeps compile time flat in depth (every block has
the same graph, compiled once and reused) and leaves the block boundaries to FSDP and pipeline
stages. Under tensor parallel a whole parallelized block fails in backward in torch 2.13
(``'Tensor' object has no attribute '_local_tensor'`` in the nested redistribute), so there the
sub-layers the model's tensor-parallel layout names (``block_regions``: attention, feed-forward) are
compiled separately. Only their ``forward`` is compiled, not their
module hooks: with sequence parallel, tracing the input hook (all-gather of the sequence, then
``to_local``) into the graph gave wrong gradients (grad norm off by 1e-5 relative at step 1, norm
weights off by 5e-3 after 5 steps), while leaving it eager matches eager TP to fp32 rounding.

With ``compile_loss`` the loss function is compiled too (through the core's ``wrap_loss`` hook):
cross entropy over the vocabulary is a large activation for a small model, and compiled, inductor can
fuse its log-softmax with the gather. Not under tensor parallel, where the logits may be
vocabulary-sharded DTensors inside loss parallel.

Under expert parallel a mixture-of-experts block cannot be one graph: the experts' all-to-all reads its
split sizes on the host, and FSDP shards the experts as a unit of their own whose hooks dynamo must not
trace. Such blocks are compiled with graph breaks around the experts (``fullgraph`` off for them only);
the rest of each block is still compiled.
"""

import torch
from torch import nn

from titan_core import (COMPILE, EXPERT_PARALLEL, TP, ConfigError, Declaration, canonical_name, device_kind, hookimpl,
                        lacks)

STAGE = 500  # after the transforms that rewrite a block (TP, CP, AC), before FSDP wraps it
CUDA_ONLY_MODES = ("reduce-overhead", "max-autotune")  # both capture CUDA graphs


def compile_counts() -> dict[str, int]:
    """How many graphs dynamo compiled and how many graph breaks it took, in this process so far."""
    counters = torch._dynamo.utils.counters
    return {"compiled_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def check_options(config, plugin_config, plan) -> None:
    if plan.model.blocks is None:
        raise ConfigError("plugins.compile", lacks(plan.model, "blocks", "per-block compile"),
                          "remove compile from +plugins=[...], or describe the model's blocks")
    if plugin_config.compile_loss and plan.degree(TP) > 1:
        raise ConfigError("plugins.compile.compile_loss", "the loss is not compiled under tensor parallel (its "
                          "logits may be vocabulary-sharded DTensors)", "set plugins.compile.compile_loss=false")
    backends = torch._dynamo.list_backends(exclude_tags=())
    if plugin_config.backend not in backends:
        raise ConfigError("plugins.compile.backend", f"unknown torch.compile backend '{plugin_config.backend}'",
                          f"use one of {', '.join(backends)}")
    if plugin_config.backend != "inductor":
        if plugin_config.mode != "default":
            raise ConfigError("plugins.compile.mode", f"mode '{plugin_config.mode}' is an inductor option "
                              f"but the backend is '{plugin_config.backend}'", "use mode=default or backend=inductor")
        return
    modes = list(torch._inductor.list_mode_options())
    if plugin_config.mode not in modes:
        raise ConfigError("plugins.compile.mode", f"unknown inductor mode '{plugin_config.mode}'",
                          f"use one of {', '.join(modes)}")
    if plugin_config.mode in CUDA_ONLY_MODES and device_kind(config.launch.device) != "cuda":
        raise ConfigError("plugins.compile.mode", f"mode '{plugin_config.mode}' captures CUDA graphs and this "
                          "job runs on no CUDA device", "use mode=default or max-autotune-no-cudagraphs")


def compile_blocks(model_parts, mesh, plugin_config, plan) -> None:
    options = dict(backend=plugin_config.backend, fullgraph=plugin_config.fullgraph,
                   mode=None if plugin_config.mode == "default" else plugin_config.mode)
    tensor_parallel = TP in mesh.shape
    for part in model_parts:
        for block in plan.model.blocks_of(part).values():
            graph_breaks = plan.provides(EXPERT_PARALLEL) and plan.model.experts_of(block) is not None
            block_options = {**options, "fullgraph": False} if graph_breaks else options
            if tensor_parallel:
                for region in tp_regions(block, plan.model.tensor_parallel.block_regions):
                    region.forward = torch.compile(region.forward, **block_options)
            else:
                block.compile(**block_options)


def compiled_loss(loss_fn, plugin_config):
    options = plugin_config
    if not options.compile_loss:
        return None
    return torch.compile(loss_fn, backend=options.backend, fullgraph=options.fullgraph,
                         mode=None if options.mode == "default" else options.mode)


def tp_regions(block: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The block's tensor-parallel regions, found under whatever wrapper (e.g. checkpointing)."""
    regions = [module for name, module in block.named_modules() if canonical_name(name) in names]
    if len(regions) != len(names):
        raise RuntimeError(f"a block without all of {', '.join(names)}: cannot compile it under tensor parallel, "
                           "where a whole compiled block fails in backward")
    return regions


class CompilePlugin:
    """The compile plugin of one run (the entry point names the class): dynamo's caches and counters are the
    process's, so the run starts them afresh and counts from where they stood, and a sweep's next job in the
    same process compiles and reports as its own."""

    def __init__(self):
        self.counted_from = compile_counts()

    @hookimpl
    def declare(self):
        """compile: stage 500, provides compile."""
        return Declaration(stage=STAGE, provides=frozenset({COMPILE}))

    @hookimpl
    def validate(self, config, plugin_config, plan):
        """compile: the model has blocks; the backend and mode exist here, a CUDA-graph mode for a CUDA job."""
        check_options(config, plugin_config, plan)

    @hookimpl
    def apply_parallelism(self, model_parts, mesh, plugin_config, plan):
        """compile: compile each block's forward (its tensor-parallel regions one by one under tp)."""
        # Dynamo keeps its caches per code object for the process: an earlier job of a sweep with other shapes
        # would make this one's compile dynamic in them (SDPA then refuses a symbolic enable_gqa). As if in a
        # fresh process:
        torch._dynamo.reset()
        self.counted_from = compile_counts()
        compile_blocks(model_parts, mesh, plugin_config, plan)

    @hookimpl
    def step_metrics(self):
        """compile: the graphs dynamo compiled for this run and the graph breaks it took (proof it compiled)."""
        return {name: count - self.counted_from[name] for name, count in compile_counts().items()}

    @hookimpl
    def wrap_loss(self, loss_fn, plugin_config):
        """compile: with compile_loss, the compiled loss function."""
        return compiled_loss(loss_fn, plugin_config)
