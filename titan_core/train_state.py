"""What a checkpoint keeps of a run: the training state, and the plugins that have state of their own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    """A plugin object whose state must survive a restart (as OLMo-core's stateful callbacks).

    ``state_dict()`` returns a flat dict of tensors, numbers or lists of numbers, equal on every rank (or
    DTensors, which a checkpoint reshards); ``load_state_dict(state)`` restores it, before the first step of
    a resumed run. A checkpoint made without the plugin leaves its state as the plugin made it.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """Everything a checkpoint must hold to resume exactly; plugins read and restore it in place.

    ``plugins`` maps each enabled plugin (and the model plugin) that is :class:`Stateful` to its object.
    """

    model_parts: list[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    dataloader: Any
    step: int = 0
    plugins: Mapping[str, Stateful] = field(default_factory=dict)
