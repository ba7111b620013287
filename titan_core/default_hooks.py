"""The core's own answers to the builder hooks, registered as the plugin ``titan_core``: any enabled plugin
that implements one of these hooks replaces the core's answer."""

from __future__ import annotations

import torch

from titan_core.adamw import AdamWNarrowStates
from titan_core.data import training_loader, validation_batches
from titan_core.hookspecs import hookimpl
from titan_core.lr_schedule import StepSchedule, lr_schedule
from titan_core.options import FLOAT_DTYPES
from titan_core.parameter_roles import param_groups


class ForwardBackward:
    """One model part, one micro-batch: forward, loss, backward of the loss scaled for accumulation (or, to
    evaluate, forward and loss only)."""

    def __init__(self, model, loss_fn, grad_accum_steps: int):
        self.model = model
        self.loss_fn = loss_fn
        self.grad_accum_steps = grad_accum_steps

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
        loss = self.loss_fn(self.model(inputs, **model_kwargs), labels)
        (loss / self.grad_accum_steps).backward()
        return loss.detach()

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
        return self.loss_fn(self.model(inputs, **model_kwargs), labels)


@hookimpl
def build_schedule(model_parts, config, loss_fn):
    if len(model_parts) != 1:
        raise RuntimeError(f"{len(model_parts)} model parts but no plugin builds a schedule for them")
    return ForwardBackward(model_parts[0], loss_fn, config.training.grad_accum_steps)


@hookimpl
def build_optimizer(model_parts, config, plan):
    opt = config.optimizer
    groups = param_groups(model_parts, plan.model, opt.lr, opt.weight_decay, opt.no_weight_decay, opt.lr_multipliers)
    hyper = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
    if opt.state_dtype != "float32":
        return AdamWNarrowStates(groups, state_dtype=FLOAT_DTYPES[opt.state_dtype], **hyper)
    return torch.optim.AdamW(groups, **hyper, **ADAMW_IMPLEMENTATIONS[opt.implementation or "foreach"])


# torch's three AdamW kernels: one update per parameter, one batched over all of them, one fused kernel.
ADAMW_IMPLEMENTATIONS = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@hookimpl
def build_lr_scheduler(optimizer, config):
    return StepSchedule(optimizer, lr_schedule(config))


@hookimpl
def build_dataloader(config, tokenizer, dp_rank, dp_size):
    """The core's loader: prepared token shards read by offset, or documents packed by every rank."""
    return training_loader(config, tokenizer, dp_rank, dp_size)


@hookimpl
def build_validation_batches(config, tokenizer, dp_rank, dp_size):
    """The core's held-out batches: validation's own data, or what it holds out of the training data."""
    return validation_batches(config, tokenizer, dp_rank, dp_size)
