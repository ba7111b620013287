"""Losses a model adds inside its forward, beside the loss the core computes on its logits.

A mixture-of-experts router's load-balancing loss is computed in every MoE layer, on whichever pipeline
stage holds it, so it cannot be added to the logits' loss on the last stage. ``add_loss(output, loss)``
hands ``output`` on unchanged and, in backward, adds the gradient of ``loss`` weighted exactly like the
logits' loss of the same forward: the schedule scales that one by its ``loss_weight`` (1 / the forwards of a
step on this rank: grad-accumulation steps x pipeline micro-batches), and the core binds the same weight here
for the duration of the run (:func:`loss_weight`). Data-parallel averaging then treats both alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

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
