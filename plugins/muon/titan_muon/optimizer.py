"""Muon for the hidden matrices, torch's AdamW for every other parameter, in one optimizer.

Muon (Keller Jordan, 2024; Moonshot's "Muon is Scalable for LLM Training", 2025) keeps a momentum of each
matrix's gradient and steps along its orthogonalisation: a few Newton–Schulz iterations push every singular
value of the (Nesterov) momentum towards 1. The update is torch's ``torch.optim.Muon``, step for step; a 3-D
expert stack is orthogonalised one expert's matrix at a time.

Newton–Schulz needs each matrix whole, and under FSDP or tensor parallel a rank holds a piece of it. Every matrix
held as a DTensor is laid out by rows over its mesh (FSDP's own layout; a tensor-parallel split is re-laid), then
all the matrices of a mesh go at once to their owners, one rank each chosen by the work so that it spreads evenly
(:mod:`titan_muon.exchange`); every owner orthogonalises its own, all at the same time, and sends each rank its
rows back. An expert stack laid out by rows is whole expert by expert where it is and needs no exchange. Per rank
and step: the Newton–Schulz work of its share of the matrices, and it receives its owned matrices and its own
rows of the others: both fall as the ranks grow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Shard

from titan_muon.exchange import OwnerExchange


@dataclass
class NewtonSchulz:
    """The orthogonalisation torch's Muon applies: ``steps`` quintic iterations with ``coefficients`` (a, b, c),
    in ``dtype``, after scaling the matrix to a Frobenius norm of at most 1 (``eps`` guards a zero matrix).
    ``flops`` counts the multiply-adds (x2) of the matrices it orthogonalised: this rank's share of the work."""

    coefficients: tuple[float, float, float]
    steps: int
    eps: float
    dtype: torch.dtype
    flops: int = 0

    def cost(self, shape: torch.Size) -> int:
        """The FLOPs of orthogonalising a matrix of ``shape`` (each expert's, for a stack)."""
        return self.cost_of(shape, self.steps)

    @staticmethod
    def cost_of(shape: torch.Size, steps: int) -> int:
        small, large = sorted(shape[-2:])
        experts = shape[0] if len(shape) == 3 else 1
        return experts * steps * (4 * small * small * large + 2 * small**3)  # two Gram products and the cube

    def __call__(self, update: torch.Tensor) -> torch.Tensor:
        if update.ndim == 3:  # an expert stack: each expert's matrix is a matrix of its own (a rank may hold none)
            return torch.stack([self(matrix) for matrix in update]) if len(update) else update.to(self.dtype)
        a, b, c = self.coefficients
        self.flops += self.cost(update.shape)
        x = update.to(self.dtype)
        tall = x.size(0) > x.size(1)
        if tall:  # iterate on the smaller Gram matrix
            x = x.T
        x = x / x.norm().clamp(min=self.eps)
        for _ in range(self.steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x


def adjusted_lr(lr: float, shape: torch.Size, rule: str) -> float:
    """Muon's rate for a matrix of ``shape`` (an expert's: the last two dimensions). ``original``: scaled by
    sqrt(max(1, rows / columns)) (Keller Jordan's); ``match_rms_adamw``: by 0.2 sqrt(max(rows, columns)), which
    gives updates of AdamW's RMS so that AdamW's learning rate carries over (Moonlight's)."""
    rows, columns = shape[-2:]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, columns))
    return lr * math.sqrt(max(1, rows / columns))


def rows_layout(tensor: DTensor) -> list[Shard]:
    """The all-rows layout of ``tensor``'s mesh: each dimension splits dim 0 (FSDP's; a 3-D expert stack is then
    whole expert by expert on every rank)."""
    return [Shard(0)] * tensor.device_mesh.ndim


def laid_back(update: DTensor, rows: torch.Tensor) -> torch.Tensor:
    """This rank's piece, in ``update``'s layout, of a result whose rows (all-rows layout) it holds."""
    if list(update.placements) == rows_layout(update):
        return rows
    mesh = update.device_mesh
    spread = DTensor.from_local(rows, mesh, rows_layout(update), shape=update.shape, stride=update.stride())
    return spread.redistribute(mesh, update.placements).to_local()


def relaid_bytes(update: DTensor) -> int:
    """What re-laying ``update`` out to rows and back moves at most, when it is not in that layout already."""
    if list(update.placements) == rows_layout(update):
        return 0
    return 2 * update.to_local().numel() * update.element_size()


class MuonWithAdamW(torch.optim.AdamW):
    """torch's AdamW whose groups marked ``muon`` (matrices: 2-D, or 3-D expert stacks) step by Muon instead.

    A Muon group holds ``momentum``, ``nesterov`` and ``adjust_lr`` besides AdamW's keys; its parameters keep one
    state, ``momentum_buffer`` (shaped and sharded as the parameter, so checkpoints save and reshard it; stored in
    ``momentum_dtype``, updated in the gradient's), and the others AdamW's. ``newton_schulz`` orthogonalises every
    Muon update and counts its work.
    """

    param_groups: list[dict]  # torch's, which mypy reads as untyped

    def __init__(self, groups: list[dict], newton_schulz: NewtonSchulz, momentum_dtype: torch.dtype = torch.float32,
                 **adamw):
        super().__init__(groups, **adamw)
        self.newton_schulz, self.momentum_dtype = newton_schulz, momentum_dtype
        self.received_bytes = 0  # by this rank in the last step, to lay out, gather and scatter the matrices
        self._exchanges: dict[tuple, OwnerExchange] = {}
        bad = [tuple(p.shape) for group in self.param_groups if group.get("muon") for p in group["params"]
               if p.ndim not in (2, 3)]
        if bad:
            raise ValueError(f"Muon steps matrices (2-D) and expert stacks (3-D), not a parameter of shape {bad[0]}")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:  # the loss would have to be taken before the matrices step, AdamW's after
            raise ValueError("MuonWithAdamW.step takes no closure")
        self.newton_schulz.flops, self.received_bytes = 0, 0
        stepped = [(param, group) for group in self.param_groups if group.get("muon")
                   for param in group["params"] if param.grad is not None]
        orthogonalized = self._orthogonalized([self._momentum_update(param, group) for param, group in stepped])
        for (param, group), orthogonal in zip(stepped, orthogonalized):
            local = param.to_local() if isinstance(param, DTensor) else param
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(orthogonal, alpha=-adjusted_lr(group["lr"], param.shape, group["adjust_lr"]))
        adamw_groups = [group for group in self.param_groups if not group.get("muon")]
        every_group, self.param_groups = self.param_groups, adamw_groups  # AdamW steps its own groups alone
        try:
            super().step()
        finally:
            self.param_groups = every_group

    def _momentum_update(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """The momentum kept, and the (Nesterov) update to orthogonalise."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad, dtype=self.momentum_dtype)
        momentum, stored = group["momentum"], state["momentum_buffer"]
        buffer = stored.to(param.grad.dtype).lerp_(param.grad, 1 - momentum)  # the stored one unless it is narrower
        if buffer is not stored:
            stored.copy_(buffer)
        return param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer

    def _orthogonalized(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's piece of each update's orthogonalisation. A DTensor is laid out by rows first: an expert stack
        is then whole expert by expert and orthogonalised where it is; a matrix is gathered to its owner with the
        other matrices of its mesh, orthogonalised there, and its rows scattered back."""
        results: list[torch.Tensor | None] = [None] * len(updates)
        batches: dict[tuple, list[tuple[int, DTensor]]] = {}
        for position, update in enumerate(updates):
            if not isinstance(update, DTensor):
                results[position] = self.newton_schulz(update)
                continue
            self.received_bytes += relaid_bytes(update)
            rows = update.redistribute(update.device_mesh, rows_layout(update))
            if update.ndim == 3:
                results[position] = laid_back(update, self.newton_schulz(rows.to_local()))
            else:
                batches.setdefault((update.device_mesh, update.dtype), []).append((position, rows))
        for mesh, dtype in list(batches):
            batch = batches.pop((mesh, dtype))
            positions = [position for position, _ in batch]
            exchange = self._exchange(mesh, tuple(rows.shape for _, rows in batch))
            wholes = exchange.gather([rows.to_local() for _, rows in batch], dtype)
            # The rows laid out for the exchange go once gathered, each whole matrix once orthogonalised: beside the
            # updates, the step holds one copy of this rank's share of them at a time, and the exchange's buffers.
            del batch
            pieces = exchange.scatter({i: self.newton_schulz(wholes.pop(i)) for i in list(wholes)},
                                      self.newton_schulz.dtype)
            self.received_bytes += exchange.received_bytes
            for position, piece in zip(positions, pieces):
                results[position] = laid_back(updates[position], piece)
        return results

    def _exchange(self, mesh, shapes: tuple[torch.Size, ...]) -> OwnerExchange:
        """The owners of these matrices of ``mesh``, by their Newton–Schulz work: fixed once the shapes are."""
        key = (mesh, shapes)
        if key not in self._exchanges:
            self._exchanges[key] = OwnerExchange(mesh, list(shapes), [self.newton_schulz.cost(s) for s in shapes])
        return self._exchanges[key]
