"""Parameters a plugin has already split over part of the data-parallel ranks (expert parallel's experts).

Such a plugin marks the module holding them with the dimensions that, for those parameters, take the place
of the sharded data-parallel ones (``dp_shard`` x ``cp``): expert parallel marks its experts with
``("ep_rest",)``, the borrowed ranks it leaves. A data-parallel sharder that provides the capability
``PARTIAL_DATA_PARALLEL`` shards such a module over these dimensions (beside ``dp_replicate``) and divides
its gradients by the whole data-parallel size (``plan.dp_size``): the marking plugin's own collectives (the
all-to-all that brought every data-parallel rank's tokens to the experts) already summed the other ranks'
contributions. A sharder without the capability would average them over the wrong ranks, so the marking
plugin requires it.
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
