"""Expert parallel: every mixture-of-experts block's experts split over the ``ep`` ranks.

``ep`` borrows its ranks from the data-, context- and tensor-parallel ones (dp_shard x cp x tp, tp's
first: the nearest ranks), so the world is not multiplied; every one of them routes tokens of its own
(tensor parallel splits a mixture-of-experts layer's tokens). The borrowed ranks it leaves, ``ep_rest``,
shard the experts' FSDP. Rank r of ``ep`` keeps
experts [r E/ep, (r+1) E/ep) of each block, as DTensors sharded by expert over ``ep`` (a checkpoint saved
here loads under any other plan). The model routes its own tokens and calls its experts module with the
token copies sorted by expert (``ModelDescription.experts``); under expert parallel that call exchanges
the per-expert counts, sends every copy to the rank holding its expert (all-to-all, variable splits),
runs the local experts over everything received, and sends the outputs back to where they came from.
The router is dropless, so this computes exactly what one process does, and the backward pass takes
the same path in reverse.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titan_core import (CP, DP_SHARD, EXPERT_PARALLEL, PARTIAL_DATA_PARALLEL, TP, ConfigError, Declaration,
                        MeshDimension, hookimpl, lacks, replicate_only_over, rest_of)

log = logging.getLogger("titan_core")
STAGE = 350  # after TP and CP rewrote the dense parts, before AC replays and compile traces the blocks
EP = "ep"  # the mesh dimension this plugin defines, borrowing the data-, context- and tensor-parallel ranks


@hookimpl
def declare(plugin_config):
    return Declaration(stage=STAGE, mesh={EP: plugin_config.degree},
                       dimensions={EP: MeshDimension(borrows=(DP_SHARD, CP, TP))},
                       provides=frozenset({EXPERT_PARALLEL}), requires=frozenset({PARTIAL_DATA_PARALLEL}))


@hookimpl
def validate(plan):
    experts = plan.model.experts
    if experts is None:
        raise ConfigError("plugins.ep", lacks(plan.model, "experts", "expert parallel"),
                          "use a mixture-of-experts model (model=qwen3_moe_tiny)")
    degree = plan.degree(EP)
    if experts.count % degree:
        raise ConfigError("plugins.ep.degree", f"{degree} does not divide the model's {experts.count} experts",
                          "choose a divisor of the number of experts")


@hookimpl
def apply_parallelism(model_parts, mesh, plan):
    """ep: keep this rank's slice of every block's experts; their tokens come and go by all-to-all."""
    ep_mesh = mesh.submesh(EP)
    sharded = []
    for part in model_parts:
        for block in plan.model.blocks_of(part).values():
            experts = plan.model.experts_of(block)
            if experts is not None:  # dense blocks have none
                shard_by_expert(experts, ep_mesh)
                replicate_only_over(experts, (rest_of(EP),))
                sharded.append(experts)
    if sharded:
        held = next(sharded[0].parameters()).to_local().shape[0]
        first = ep_mesh.get_local_rank() * held
        log.info("ep: this rank holds experts %d-%d of %d in each of %d blocks", first, first + held - 1,
                 plan.model.experts.count, len(sharded))


def shard_by_expert(experts: nn.Module, ep_mesh) -> None:
    """Split every parameter by expert over ``ep_mesh`` and make the module's forward expert-parallel."""
    for module in experts.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            # src_data_rank=None: each rank takes its slice without a broadcast (the weights are not drawn yet).
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    experts.ep_group = ep_mesh.get_group()
    # A class is hashable: mypy checks it against Hashable by its instances' __hash__ (python/mypy#11470).
    experts.__class__ = _expert_parallel_class(type(experts))  # type: ignore[arg-type]


@functools.cache
def _expert_parallel_class(cls: type) -> type:
    # A subclass, not a wrapper module: parameter names stay those of the model (checkpoints, HF export).
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})


class ExpertParallel:
    """Mixed into the class of an experts module: the same call, computed on the ranks holding the experts."""

    ep_group: dist.ProcessGroup

    # The splits are read on the host, so a compiled block calls this eagerly, as one opaque function.
    @torch._dynamo.disable
    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = dist.get_world_size(self.ep_group)
        sent = counts.view(ep, -1)  # [destination rank, its local expert]: copies this rank sends there
        received = torch.empty_like(sent)  # [source rank, my local expert]: copies arriving here
        dist.all_to_all_single(received, sent, group=self.ep_group)
        send_splits, receive_splits = sent.sum(1).tolist(), received.sum(1).tolist()
        order = by_expert(received)
        self.routed = len(tokens)  # the even share of what it computes, for a module that measures its load
        # No name holds a copy of the copies once the next is made (sorted as they arrive; the results put back
        # in arrival order, by source rank as each rank sent them): each is freed as soon as it is used.
        with local_parameters(self):
            # A mixin: forward is that of the experts class it is mixed into (made by _expert_parallel_class).
            out = super().forward(  # type: ignore[misc]
                all_to_all_single_autograd(tokens, receive_splits, send_splits, self.ep_group)[order],
                received.sum(0))[order.argsort()]
        return all_to_all_single_autograd(out, send_splits, receive_splits, self.ep_group)


def by_expert(received: torch.Tensor) -> torch.Tensor:
    """The order that groups copies arriving by (source rank, local expert) by local expert instead."""
    ranks, experts = received.shape
    segment = torch.repeat_interleave(torch.arange(ranks * experts, device=received.device), received.flatten())
    return ((segment % experts) * ranks + segment // experts).argsort(stable=True)


@contextlib.contextmanager
def local_parameters(experts: nn.Module):
    """The module's own DTensor parameters seen as this rank's slices during the call; gradients flow back."""
    saved = [(module, dict(module._parameters)) for module in experts.modules()]
    for module, params in saved:
        module._parameters.update({n: p.to_local() for n, p in params.items() if isinstance(p, DTensor)})
    try:
        yield
    finally:
        for module, params in saved:
            module._parameters.update(params)
