"""Muon for the hidden matrices, torch's AdamW for every other parameter, in one optimizer.

Muon (Keller Jordan, 2024; Moonshot's "Muon is Scalable for LLM Training", 2025) keeps a momentum of each
matrix's gradient and steps along its orthogonalisation: a few Newton–Schulz iterations push every singular
value of the (Nesterov) momentum towards 1. The update is torch's ``torch.optim.Muon``, step for step; a 3-D
expert stack is orthogonalised one expert's matrix at a time.

Newton–Schulz needs each matrix whole, and under FSDP or tensor parallel a rank holds a piece of it. For a
matrix held as a DTensor, the ranks of its mesh gather the whole update (one all-gather, as FSDP's forward
does), one rank of the mesh orthogonalises it (the k-th matrix's owner is the mesh's rank k mod its size, so
the work spreads evenly), and broadcasts the result, from which each rank keeps its own piece. Per rank and
step that is one matrix at a time in memory, the Newton–Schulz work of its share of the matrices, and every
matrix received twice: flat in the number of ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor


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

    def __call__(self, update: torch.Tensor) -> torch.Tensor:
        if update.ndim == 3:  # an expert stack: each expert's matrix is a matrix of its own (a rank may hold none)
            return torch.stack([self(matrix) for matrix in update]) if len(update) else update.to(self.dtype)
        a, b, c = self.coefficients
        small, large = sorted(update.shape)
        self.flops += self.steps * (4 * small * small * large + 2 * small**3)  # two Gram products and the cube
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


def broadcast_from(tensor: torch.Tensor, mesh, owner: tuple[int, ...]) -> None:
    """Send ``tensor`` from the rank at mesh coordinate ``owner`` to every rank of ``mesh``, one mesh dimension at
    a time, the last first: along dimension d only the ranks sharing the owner's coordinates before d take part,
    and they already hold it along the dimensions after d."""
    coordinate = mesh.get_coordinate()
    for dim in reversed(range(mesh.ndim)):
        if all(coordinate[d] == owner[d] for d in range(dim)):
            dist.broadcast(tensor, group=mesh.get_group(dim), group_src=owner[dim])


def orthogonalized(update: torch.Tensor, index: int, newton_schulz: NewtonSchulz) -> tuple[torch.Tensor, int]:
    """This rank's piece of ``newton_schulz`` of the whole matrix ``update``, and the bytes this rank received for it.
    A DTensor is gathered, orthogonalised by the ``index``-th matrix's owner and broadcast, but for an expert stack
    split only by expert (expert parallel, FSDP's dim-0 shards), whose every rank holds whole experts and
    orthogonalises its own."""
    if not isinstance(update, DTensor):
        return newton_schulz(update), 0
    if update.ndim == 3 and all(placement.is_shard(0) for placement in update.placements):
        return newton_schulz(update.to_local()), 0
    mesh = update.device_mesh
    whole = update.full_tensor()
    owner = tuple(int(c) for c in torch.unravel_index(torch.tensor(index % mesh.size()), tuple(mesh.shape)))
    if tuple(mesh.get_coordinate()) == owner:
        result = newton_schulz(whole).contiguous()  # a tall matrix comes back transposed; collectives send storage
    else:
        result = torch.empty_like(whole, dtype=newton_schulz.dtype)
    received = (whole.numel() - update.to_local().numel()) * whole.element_size()
    received += 0 if tuple(mesh.get_coordinate()) == owner else result.numel() * result.element_size()
    broadcast_from(result, mesh, owner)
    return distribute_tensor(result, mesh, update.placements, src_data_rank=None).to_local(), received


class MuonWithAdamW(torch.optim.AdamW):
    """torch's AdamW whose groups marked ``muon`` (matrices: 2-D, or 3-D expert stacks) step by Muon instead.

    A Muon group holds ``momentum``, ``nesterov`` and ``adjust_lr`` besides AdamW's keys; its parameters keep one
    state, ``momentum_buffer`` (shaped and sharded as the parameter, so checkpoints save and reshard it; stored in
    ``momentum_dtype``, updated in the gradient's), and the others AdamW's. ``newton_schulz`` orthogonalises every
    Muon update and counts its work.
    """

    def __init__(self, groups: list[dict], newton_schulz: NewtonSchulz, momentum_dtype: torch.dtype = torch.float32,
                 **adamw):
        super().__init__(groups, **adamw)
        self.newton_schulz, self.momentum_dtype = newton_schulz, momentum_dtype
        self.received_bytes = 0  # by this rank in the last step, for the matrices' gathers and broadcasts
        bad = [tuple(p.shape) for group in self.param_groups if group.get("muon") for p in group["params"]
               if p.ndim not in (2, 3)]
        if bad:
            raise ValueError(f"Muon steps matrices (2-D) and expert stacks (3-D), not a parameter of shape {bad[0]}")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:  # the loss would have to be taken before the matrices step, AdamW's after
            raise ValueError("MuonWithAdamW.step takes no closure")
        index, self.newton_schulz.flops, self.received_bytes = 0, 0, 0
        for group in self.param_groups:
            if not group.get("muon"):
                continue
            for param in group["params"]:
                index += 1  # counted with or without a gradient: every rank of a mesh agrees on the owners
                if param.grad is not None:
                    self._muon_step(param, group, index)
        adamw_groups = [group for group in self.param_groups if not group.get("muon")]
        every_group, self.param_groups = self.param_groups, adamw_groups  # AdamW steps its own groups alone
        try:
            super().step()
        finally:
            self.param_groups = every_group

    def _muon_step(self, param: torch.Tensor, group: dict, index: int) -> None:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad, dtype=self.momentum_dtype)
        momentum, stored = group["momentum"], state["momentum_buffer"]
        buffer = stored.to(param.grad.dtype).lerp_(param.grad, 1 - momentum)  # the stored one unless it is narrower
        if buffer is not stored:
            stored.copy_(buffer)
        update = param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
        local = param.to_local() if isinstance(param, DTensor) else param
        local.mul_(1 - group["lr"] * group["weight_decay"])
        orthogonal, received = orthogonalized(update, index, self.newton_schulz)
        self.received_bytes += received
        local.add_(orthogonal, alpha=-adjusted_lr(group["lr"], param.shape, group["adjust_lr"]))
