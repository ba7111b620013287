"""Parameters whose gradients do not follow the dense data-parallel pattern (expert and tensor parallel's).

A plugin marks the module holding them with the dimensions that, for those parameters, take the place
of the sharded data-parallel ones (``dp_shard`` x ``cp``): the ranks over which they are replicated and
see different tokens. Expert parallel marks its experts with ``("ep_rest",)``, the borrowed ranks it
leaves (its all-to-all already brought the other ranks' tokens to the experts); tensor parallel marks a
mixture-of-experts layer, whose tokens it splits over its ranks, with ``("dp_shard", "cp", "tp")``. A
data-parallel sharder that provides the capability ``PARTIAL_DATA_PARALLEL`` shards such a module over
these dimensions (beside ``dp_replicate``), innermost marked module first, sums its gradients over them
and divides by the dense parameters' divisor (every rank whose loss is averaged: the data-parallel and
context-parallel ranks), never by the size of the marked dimensions. A sharder without the capability
would average them over the wrong ranks, so the marking plugin requires it.
"""

from __future__ import annotations

from torch import nn

_MARK = "_titan_core_replicated_over"


def replicate_only_over(module: nn.Module, dims: tuple[str, ...]) -> None:
    """Mark ``module``'s parameters as replicated only over ``dims`` among the sharded data-parallel ranks."""
    setattr(module, _MARK, tuple(dims))


def replicated_over(module: nn.Module) -> tuple[str, ...] | None:
    """The dimensions ``module`` was marked with, or None for an ordinary module."""
    return getattr(module, _MARK, None)
