"""Chunked cross entropy: the loss computes the logits itself, ``chunk_tokens`` tokens at a time.

The model's logits layer (``ModelDescription.logits``) is replaced in the model by a pass-through that
holds the same weight under the same name, so the model returns its final hidden state and init,
checkpoints, the optimizer and FSDP see the parameter they always saw. The loss multiplies one chunk of
hidden states by that weight, takes its summed cross entropy and moves on; each chunk runs under
activation checkpointing, so backward too recomputes one chunk's logits at a time. A 151k-token
vocabulary at 8k tokens per sample is 4.6 GiB of fp32 logits per sample; in chunks of 1024 tokens it
is 0.6 GiB. Under tensor parallel the weight stays split by vocabulary and, with loss parallel, so do
each chunk's logits.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from titan_core import IGNORE_INDEX, ConfigError, Declaration, attribute, hookimpl, lacks, replace

STAGE = 250  # after TP split the logits layer by vocabulary (the loss keeps it split), before FSDP shards it


class LogitsWeight(nn.Module):
    """Stands where the logits layer stood: passes the hidden state through and keeps the layer's weight."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@hookimpl
def declare():
    return Declaration(stage=STAGE)


@hookimpl
def validate(plugin_config, plan):
    if plan.model.logits is None:
        raise ConfigError("plugins.chunked_loss", lacks(plan.model, "logits", "chunked cross entropy"),
                          "remove chunked_loss from +plugins=[...]")
    if plugin_config.chunk_tokens < 1:
        raise ConfigError("plugins.chunked_loss.chunk_tokens", f"{plugin_config.chunk_tokens!r} is not a positive "
                          "integer", "set the number of tokens whose logits are computed at once, e.g. 1024")


@hookimpl
def apply_parallelism(model_parts, plan):
    """chunked_loss: the logits layer becomes a pass-through; the loss applies its weight chunk by chunk."""
    path = plan.model.logits
    for part in model_parts:
        layer = attribute(part, path)
        if layer is None:  # a pipeline stage that does not end the model
            continue
        if type(layer) is not nn.Linear or layer.bias is not None:
            # e.g. a float8 linear: the loss would bypass its forward and train in high precision unnoticed.
            raise ConfigError("plugins.chunked_loss", f"the logits layer {path} is a {type(layer).__name__}"
                              f"{' with a bias' if layer.bias is not None else ''}, but chunked cross entropy "
                              "multiplies by its weight itself", "keep the logits layer a plain nn.Linear without "
                              "bias (float8 must skip it)")
        replace(part, path, LogitsWeight(layer.weight))


@hookimpl
def wrap_loss(model_parts, plugin_config, plan):
    """chunked_loss: cross entropy that projects each chunk of hidden states onto the vocabulary itself."""
    owners = [(part, attribute(part, plan.model.logits)) for part in model_parts]
    owner, holder = next(((part, layer) for part, layer in owners if layer is not None), (None, None))
    if holder is None:  # no stage on this rank ends the model: it computes no loss
        return None
    return functools.partial(chunked_cross_entropy, owner=owner, holder=holder,
                             chunk_tokens=plugin_config.chunk_tokens)


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, owner: nn.Module, holder: LogitsWeight,
                          chunk_tokens: int) -> torch.Tensor:
    """Cross entropy of ``hidden @ weight.T`` against ``labels`` summed over the trained tokens, one chunk of
    tokens at a time."""
    for module in (owner, holder):
        if isinstance(module, FSDPModule):
            # A unit resharded after forward holds only its shard now; gathering it twice is a no-op.
            module.unshard()
    weight = holder.weight
    if isinstance(hidden, DTensor):  # sequence parallel: each rank holds a slice of the sequence
        hidden = hidden.full_tensor()
    hidden, labels = hidden.flatten(0, 1), labels.flatten(0, 1)
    return sum(checkpoint(_summed_cross_entropy, hidden[start:start + chunk_tokens], weight,
                          labels[start:start + chunk_tokens], use_reentrant=False)
               for start in range(0, labels.numel(), chunk_tokens))


def _summed_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if isinstance(weight, DTensor):
        # Split by vocabulary over tensor parallel: every rank holds the same tokens and labels.
        hidden = DTensor.from_local(hidden, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim,
                                    run_check=False)
        labels = DTensor.from_local(labels, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim,
                                    run_check=False)
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
