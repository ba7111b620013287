"""Conversations packed into training rows, resumable, with the same global batches under every plan.

Row ``j`` of every global batch (``R`` rows) is filled from its own stream of conversations, ``j``, ``j + R``,
``j + 2R``, ... of the set, wrapping around at its end: whole conversations while they fit (packing), or one
(padding), then padded with labels that train nothing. A data-parallel rank builds only its own rows, and the
rows are the same however many ranks share them, so every plan trains on what one process trains on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from titan_core import IGNORE_INDEX
from titan_sft.chat import Example


class ChatRows:
    """This rank's rows of each global batch, as ``(inputs, labels)`` of ``seq_len`` tokens."""

    def __init__(self, example: Callable[[int], Example], conversations: Sequence[int], global_rows: int,
                 rows: range, seq_len: int, pad_id: int, packing: bool):
        self.example = example
        self.rows, self.seq_len, self.pad_id, self.packing = rows, seq_len, pad_id, packing
        self.streams = [conversations[row::global_rows] for row in rows]
        self.taken = [0] * len(rows)  # conversations each row's stream has used, across epochs

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self._row(index, row) for index, row in enumerate(self.rows)]
        return torch.stack([inputs for inputs, _ in rows]), torch.stack([labels for _, labels in rows])

    def _row(self, index: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = self.streams[index]
        ids: list[int] = []
        trained: list[bool] = []
        for _ in range(len(stream)):  # a stream of conversations that cannot be used ends the search
            example = self.example(stream[self.taken[index] % len(stream)])
            if example.problem is not None:
                self.taken[index] += 1
                continue
            if len(ids) + len(example.ids) > self.seq_len + 1:
                break
            ids, trained = ids + list(example.ids), trained + list(example.trained)
            self.taken[index] += 1
            if not self.packing:
                break
        if not ids:
            raise RuntimeError(f"no conversation of row {row}'s stream can be trained on")
        padding = self.seq_len + 1 - len(ids)
        tokens = torch.tensor(ids + [self.pad_id] * padding)
        targets = torch.tensor(trained + [False] * padding)
        labels = torch.where(targets[1:], tokens[1:], IGNORE_INDEX)
        return tokens[:-1], labels

    def state_dict(self) -> dict:
        return {"taken": list(self.taken)}

    def load_state_dict(self, state: dict) -> None:
        self.taken = list(state["taken"])
