"""Losses a model adds inside its forward, beside the loss the core computes on its logits.

A mixture-of-experts router's load-balancing loss is computed in every MoE layer, on whichever pipeline
stage holds it, so it cannot be added to the logits' loss on the last stage. ``add_loss(output, loss)``
hands ``output`` on unchanged and, in backward, adds the gradient of ``loss`` weighted exactly like the
logits' loss of the same forward: the schedule divides that one by the forwards of a step on this rank
(grad-accumulation steps x pipeline micro-batches), and the core sets the same weight here before
training (``set_loss_weight``). Data-parallel averaging then treats both alike.
"""

from __future__ import annotations

import torch

_loss_weight = 1.0


def set_loss_weight(weight: float) -> None:
    """The factor the schedule applies to each forward's loss before backward (the core calls this)."""
    global _loss_weight
    _loss_weight = weight


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
