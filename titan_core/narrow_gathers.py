"""The format a converted linear's tensors travel in when tensor parallel gathers them.

Under sequence parallel, tensor parallel gathers the residual stream along the sequence before a region's
column-wise linears read it (forward), and a row-wise linear's output gradient before its backward reads it.
A module conversion whose linears compute on a narrower format than the stream (float8) marks them with
:class:`GatherCasts`: the tensor parallel plugin then casts the shard before the gather, which moves the
narrow bytes, instead of gathering the wide stream for each linear to cast on its own. The cast must be what
the linear would do with the gathered tensor itself (float8's tensorwise scale is the same: its amax is
reduced over the shards), so the step computes the same numbers.

A conversion that computes beside a linear (an adapter reading the linear's input and adding its own product to
the output) calls :func:`keep_precision`: that linear's input, and that of every linear sharing its gather, then
reaches it in the stream's precision, and its output's gradient comes back in it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor

_MARK = "_titan_core_gather_casts"


@dataclass(frozen=True)
class GatherCasts:
    """``input`` casts the linear's input (a DTensor split along the sequence) before the forward all-gather;
    ``output_grad`` returns its output (a DTensor split along the sequence) unchanged in forward and casts that
    output's gradient before the backward all-gather; either may be None (gathered as it is). ``same`` says which
    linears may share one cast input: those whose ``same`` are equal (one format, one configuration)."""

    input: Callable[[DTensor], DTensor] | None
    output_grad: Callable[[DTensor], DTensor] | None
    same: Hashable


def cast_gathers(linear: nn.Module, casts: GatherCasts) -> None:
    """Mark ``linear``: tensor parallel's gathers bring it its tensors cast by ``casts``."""
    setattr(linear, _MARK, casts)


def gather_casts(linear: nn.Module) -> GatherCasts | None:
    """What ``linear`` was marked with, or None: its gathered tensors travel in the stream's format."""
    return getattr(linear, _MARK, None)


def keep_precision(linear: nn.Module) -> None:
    """Gather ``linear``'s tensors uncast: something beside the linear reads its input and adds to its output."""
    if hasattr(linear, _MARK):
        delattr(linear, _MARK)
