"""What hooks pass that torch and OmegaConf do not type: the tokenizer, the training batches a loader makes, and the
schedule that runs a micro-batch. Structural (``typing.Protocol``): any object with these members fits; the hooks'
docstrings (:mod:`titan_core.hookspecs`) say what each member must do."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Tokenizer", "Batches", "Schedule"]


@runtime_checkable
class Tokenizer(Protocol):
    """The run's tokenizer: its vocabulary's size, its begin- and end-of-text ids (None: it has none), and text to ids."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...


@runtime_checkable
class Batches(Protocol):
    """A data-parallel rank's training batches: ``(inputs, labels)`` local batches, with the loader's position as of
    the batches taken, for an exact resume."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Schedule(Protocol):
    """What runs forward and backward of one micro-batch and returns its detached loss (None where a rank computes
    none); ``evaluate``, the same without backward, and ``loss_weight`` are optional."""

    def run(self, inputs: torch.Tensor, labels: torch.Tensor,
            model_kwargs: dict[str, torch.Tensor]) -> torch.Tensor | None: ...
