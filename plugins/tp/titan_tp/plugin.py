"""Tensor parallel: every block's attention and feed-forward split over the ``tp`` mesh dimension.

Megatron-style: wq/wk/wv and w1/w3 are split by output features (each rank holds whole heads and a
slice of the hidden units), wo and w2 by input features, so one block costs one all-reduce in each of
forward and backward per sub-layer. The embedding is split by vocabulary rows and the output layer by
vocabulary columns. With sequence parallel the residual stream and the norms between those regions are
split along the sequence instead of replicated, turning each all-reduce into a reduce-scatter plus an
all-gather and dividing the norms' activation memory by the degree. With loss parallel the logits stay
split by vocabulary and cross entropy reduces across ranks, never materializing the whole vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from titan_core import ConfigError, Declaration, hookimpl

STAGE = 200  # after pipeline splitting (each stage is parallelized like a whole model), before CP, AC, compile, FSDP


@hookimpl
def declare(plugin_config):
    # AsyncTP's fused collective-matmuls are an inductor pass: without a compiler nothing is fused.
    requires = frozenset({"compile"}) if plugin_config.async_tp else frozenset()
    return Declaration(stage=STAGE, mesh={"tp": plugin_config.degree},
                       provides=frozenset({"tensor_parallel"}), requires=requires)


@hookimpl
def validate(config, plugin_config, plan):
    degree = plan.degree("tp")
    n_heads = config.model.n_heads
    n_kv_heads = config.model.get("n_kv_heads") or n_heads
    for field, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if heads % degree:
            raise ConfigError(f"model.{field}", f"{heads} heads do not split over tp degree {degree}",
                              f"choose plugins.tp.degree dividing {heads}")
    if plugin_config.sequence_parallel:
        # The sequence each rank sees (after context parallel's split) is split again over tp.
        local_seq = config.training.seq_len // plan.degree("cp")
        if local_seq % degree:
            raise ConfigError("training.seq_len", f"sequence parallel splits {local_seq} tokens per context-parallel "
                              f"rank over tp degree {degree}", f"use a seq_len divisible by {degree * plan.degree('cp')}"
                              " or plugins.tp.sequence_parallel=false")
    if plugin_config.async_tp:
        _check_async_tp(config, plugin_config)


def _check_async_tp(config, plugin_config) -> None:
    if not torch.cuda.is_available() or (config.launch.backend or "nccl") != "nccl":
        # Off CUDA/NCCL torch accepts the settings and silently runs plain collectives, unfused.
        raise ConfigError("plugins.tp.async_tp", "AsyncTP needs CUDA GPUs with NCCL symmetric memory, which this "
                          "job does not have", "set plugins.tp.async_tp=false")
    if not plugin_config.sequence_parallel:
        raise ConfigError("plugins.tp.async_tp", "AsyncTP fuses the all-gathers and reduce-scatters of sequence "
                          "parallel, which is off", "set plugins.tp.sequence_parallel=true")


@hookimpl
def apply_parallelism(model_parts, mesh, plugin_config):
    tp_mesh = mesh.submesh("tp")
    sp, lp = plugin_config.sequence_parallel, plugin_config.loss_parallel
    for part in model_parts:
        apply_outer_plan(part, tp_mesh, sp, lp)
        for block in part.layers.values():
            apply_block_plan(block, tp_mesh, sp)
    if plugin_config.async_tp:
        apply_async_tp(tp_mesh)


def apply_outer_plan(model: torch.nn.Module, tp_mesh, sp: bool, lp: bool) -> None:
    """Embedding, final norm and output layer; a pipeline stage holds only some of them."""
    stream = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "norm": SequenceParallel() if sp else None,  # replicated below otherwise
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1) if lp else Replicate(),
                                  use_local_output=not lp),  # loss parallel needs the sharded DTensor
    }
    parallelize_module(model, tp_mesh, {name: style for name, style in plan.items()
                                        if style is not None and getattr(model, name) is not None})
    if not sp and model.norm is not None:
        replicate_norm(model.norm, tp_mesh)


def apply_block_plan(block: torch.nn.Module, tp_mesh, sp: bool) -> None:
    stream = Shard(1) if sp else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        "feed_forward.w3": ColwiseParallel(),
    }
    if sp:
        plan |= {
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # All-gather the normed sequence once per sub-layer, not once per projection; RoPE is left alone.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                                            use_local_output=True),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
        }
    parallelize_module(block, tp_mesh, plan)
    if not sp:
        replicate_norm(block.attention_norm, tp_mesh)
        replicate_norm(block.ffn_norm, tp_mesh)


def replicate_norm(norm: nn.Module, tp_mesh) -> None:
    """A norm on the whole (replicated) sequence whose weight is a replicated DTensor like every other parameter.

    As a plain tensor it would sit beside DTensors in gradient clipping and FSDP, which refuse the mix.
    Its gradient needs no reduction: every rank sees the same input and output gradient.
    """
    def replicate_params(name, module, mesh):
        for param_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(param_name, nn.Parameter(
                DTensor.from_local(param, mesh, [Replicate()], run_check=False)))

    distribute_module(
        norm, tp_mesh, replicate_params,
        input_fn=lambda module, inputs, mesh: tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                                                    for x in inputs),
        output_fn=lambda module, output, mesh: output.to_local())


def apply_async_tp(tp_mesh) -> None:
    """Let inductor fuse TP's collectives with the neighbouring matmuls over symmetric memory (CUDA only)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


@hookimpl
def batch_context(config):
    # Cross entropy and its backward dispatch to the vocabulary-sharded versions only inside this context.
    return loss_parallel() if config.plugins.tp.loss_parallel else None
