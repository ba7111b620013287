"""Context parallel: every sequence split over the ``cp`` mesh dimension, attention computed as a ring.

Each micro-batch's tokens, labels and the model's position buffers (``ModelDescription.position_buffers``:
RoPE tables, position ids) are split along the sequence inside torch's ``context_parallel`` context, the
same way for all of them, so every shard sees its global positions: with head-tail load balancing the
sequence is cut into 2 x degree chunks and rank r keeps chunks r and 2 x degree - 1 - r, so that every
rank does the same share of causal attention work. Attention then passes key/value shards around the
cp ranks (all-gather or all-to-all) and merges the partial results by their log-sum-exp.

Each cp rank's loss is the mean over its own tokens, an equal share of the sample, so the gradient of
the whole batch is the mean of the ranks' gradients. A data-parallel sharding plugin that spans cp
(FSDP shards over dp_shard x cp) averages them in its reduce-scatter; without one this plugin
all-reduces each gradient over the cp group itself, once per step (``after_backward``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single, all_gather_tensor_autograd
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import context_parallel

from titan_cp.ring import configure_ring, pinned_torch_problem, register_cpu_ring_attention
from titan_core import (CONTEXT_PARALLEL, CORE_ATTENTION, CP, DATA_PARALLEL_SHARDING, SDPA_CAUSAL, ConfigError,
                        Declaration, attention_mask, attribute, hookimpl, lacks, masked_attention,
                        route_masked_attention, shared_mask)

STAGE = 300  # after TP (attention then sees local heads), before AC, compile and FSDP
ROTATE_METHODS = ("allgather", "alltoall")


@hookimpl
def declare(plugin_config):
    return Declaration(stage=STAGE, mesh={CP: plugin_config.degree}, provides=frozenset({CONTEXT_PARALLEL}))


@hookimpl
def validate(config, plugin_config, plan):
    degree = plan.degree(CP)
    if plan.model.attention not in (SDPA_CAUSAL, CORE_ATTENTION):
        # Ring attention replaces causal SDPA; any other attention would see only its own shard's keys.
        raise ConfigError("plugins.cp", lacks(plan.model, "attention", "context parallel") if plan.model.attention is None
                          else f"model '{plan.model.family}' attends through '{plan.model.attention}', but context "
                          f"parallel rings only '{SDPA_CAUSAL}'", "remove cp from +plugins=[...]")
    if plan.model.position_buffers is None:
        # Without them every shard's positions would restart at 0: a silently wrong model.
        raise ConfigError("plugins.cp", lacks(plan.model, "position_buffers", "context parallel"),
                          "remove cp from +plugins=[...], or describe the model's position buffers")
    if plugin_config.rotate_method not in ROTATE_METHODS:
        raise ConfigError("plugins.cp.rotate_method", f"unknown rotate method '{plugin_config.rotate_method}'",
                          f"use one of {', '.join(ROTATE_METHODS)}")
    seq_len = config.training.seq_len
    if seq_len % (2 * degree):
        # Head-tail balancing cuts the sequence into 2 x degree equal chunks.
        raise ConfigError("training.seq_len", f"{seq_len} tokens do not split into 2 x cp degree = {2 * degree} "
                          "equal chunks", f"use a seq_len divisible by {2 * degree}")
    problem = pinned_torch_problem()
    if problem:
        raise ConfigError("plugins.cp", problem, "install torch 2.13.x (the version titan-cp is tested with)")


@hookimpl
def apply_parallelism(plugin_config, mesh):
    """cp: set up the ring."""
    if mesh.device_type == "cpu":
        register_cpu_ring_attention()
    configure_ring(plugin_config.rotate_method, plugin_config.load_balance)


@hookimpl
def after_backward(model_parts, mesh, plan):
    """cp: without a data-parallel sharding plugin, average the step's gradients over the cp ranks, once, after
    every micro-batch's backward (a pipeline's split backward included)."""
    if plan.provides(DATA_PARALLEL_SHARDING):
        return
    group = mesh.submesh(CP).get_group()
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for part in model_parts for p in part.parameters() if p.grad is not None]
    for work in [dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=group, async_op=True) for grad in grads]:
        work.wait()


@hookimpl
def batch_context(inputs, labels, model_kwargs, model_parts, mesh, plan):
    """cp: split the batch and the model's position buffers along the sequence for one micro-batch."""
    return _sequence_split(inputs, labels, model_kwargs, model_parts, mesh.submesh(CP), plan)


@contextlib.contextmanager
def _sequence_split(inputs, labels, model_kwargs, model_parts, cp_mesh, plan):
    # A generator, so that nothing is entered before the core enters it in plan order, inside tp's
    # loss_parallel: context_parallel's exit resets DTensor's custom op handlers, which loss_parallel's
    # exit must find as it left them.
    positions = [attribute(part, name) for part in model_parts for name in plan.model.position_buffers]
    per_token = list(model_kwargs.values())
    # Each token's global position, split like the tokens: document masks compare positions across shards.
    token_positions = torch.arange(inputs.shape[1], device=inputs.device)
    spent = [inputs, labels, *per_token, token_positions]
    with contextlib.ExitStack() as context:
        # Split in place for the forward and backward; the positions are restored on exit, the batch is spent.
        context.enter_context(context_parallel(cp_mesh, buffers=[*spent, *positions],
                                               buffer_seq_dims=[1, 1, *(1 for _ in per_token), 0,
                                                                *(0 for _ in positions)],
                                               no_restore_buffers=set(spent)))
        context.enter_context(route_masked_attention(gathered_attention(cp_mesh.get_group(), token_positions)))
        yield


def gathered_attention(group, token_positions: torch.Tensor):
    """Masked attention (documents, sliding windows, sinks) over the whole sequence: every rank gathers all keys
    and values.

    The ring's log-sum-exp merging has no mask, so here each rank all-gathers the keys, values, document ids
    and positions of the cp group and masks by global position (and document, and window). A sink joins each
    query's softmax once, on the rank holding the query. Memory per rank is that of the whole sequence's keys
    and values; the gradient of the gathered keys and values is reduce-scattered back to their ranks.
    """
    def attend(q, k, v, document_ids, window, sinks):
        keys = all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=group)
        values = all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=group)
        key_positions = all_gather_single(token_positions, gather_dim=0, group=group)
        key_documents = (None if document_ids is None
                         else all_gather_single(document_ids.contiguous(), gather_dim=1, group=group))
        # Made once a micro-batch for its blocks (by window), which then keep one between them.
        mask = shared_mask(token_positions if document_ids is None else document_ids, (window,),
                           lambda: attention_mask(token_positions, key_positions, document_ids, key_documents, window),
                           sinks is not None, q.dtype)
        return masked_attention(q, keys, values, mask, sinks)
    return attend
