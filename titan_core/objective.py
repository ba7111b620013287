"""The step's objective: the loss of the trained tokens, normalised over the whole step, and losses a model adds
inside its forward.

A loss function returns the loss **summed** over the tokens whose label is not ``IGNORE_INDEX``; the core
multiplies it by :class:`TokenNormalisation`'s ``scale``, set before each step from the trained tokens of the
global batch, so that the gradient is that of the mean loss per trained token of the global batch, as one
process computes it, however unevenly masks fall on ranks and micro-batches.

A mixture-of-experts router's load-balancing loss is computed in every MoE layer, on whichever pipeline stage
holds it. ``add_loss(output, loss)`` hands ``output`` on unchanged and, in backward, adds the gradient of
``loss`` weighted like the logits' loss of the same forward: by the schedule's ``loss_weight`` (1 / the
forwards of a step on this rank), which the core binds here for the run (:func:`loss_weight`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from titan_core.plan import Plan

IGNORE_INDEX = -100  # a label that trains nothing (torch's cross entropy default)

# Bound by the core for one run and restored after it (a dynamic scope, as titan_core.attention's document
# attention): a module global rather than a ContextVar because torch.compile guards on globals and breaks its
# graph on a ContextVar lookup (measured: one graph break per compiled block).
_loss_weight = 1.0


@contextlib.contextmanager
def loss_weight(weight: float) -> Iterator[None]:
    """Weight the losses added inside the model by ``weight`` until the block exits (the core's training loop
    enters it with its schedule's ``loss_weight``)."""
    global _loss_weight
    previous, _loss_weight = _loss_weight, weight
    try:
        yield
    finally:
        _loss_weight = previous


def add_loss(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``output``, through which backward also adds the gradient of the scalar ``loss`` to the step's."""
    return _AddLoss.apply(output, loss, _loss_weight)


class _AddLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, loss, weight):
        ctx.weight = weight
        ctx.save_for_backward(loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.weight), None


class TokenNormalisation:
    """The loss function the schedules call: the plugins' summed loss times ``scale``, set for every step."""

    def __init__(self, loss_fn, plan: Plan, device: torch.device):
        self.loss_fn, self.plan = loss_fn, plan
        self.scale = torch.ones((), device=device)

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, labels) * self.scale

    def set_for(self, batches_labels: list[torch.Tensor], forwards_per_batch: float) -> None:
        """Scale the coming forwards of ``batches_labels`` (this rank's rows of global batches, on the device),
        ``forwards_per_batch`` each: backward weighs each by 1 / forwards and gradients are averaged over the
        token shards, so scale = shards x forwards / trained tokens. The all-reduce over the world counts each
        row once per rank that loads it."""
        plan = self.plan
        trained = torch.stack([(labels != IGNORE_INDEX).sum() for labels in batches_labels]).sum().float()
        dist.all_reduce(trained)
        loaders_per_row = plan.world_size / plan.dp_size
        forwards = forwards_per_batch * len(batches_labels)
        # No trained token at all: a zero loss, not 0/0.
        self.scale = plan.token_shards * forwards * loaders_per_row / trained.clamp(min=1)
