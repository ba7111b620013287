"""The step's gradient norm over every shard and pipeline stage, its clipping, and the watch that stops a run
whose loss or norm stopped being finite before any checkpoint holds the weights it updated."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_core.mesh import ParallelMesh
from titan_core.plan import PP

# DTensor warns on every rank that a norm's scalar partial over two mesh dimensions (fsdp x tp) is reduced by
# two all-reduces and advises flattening the mesh: two collectives of one number a step, nothing to act on.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def clip_grad_norm_(model_parts: list[torch.nn.Module], max_norm: float | None, mesh: ParallelMesh) -> torch.Tensor:
    """Total L2 norm of all gradients across every shard and pipeline stage (a tensor: reading it is a host
    sync); clips to ``max_norm``."""
    by_mesh: dict[object, list[torch.Tensor]] = {}  # DTensors of different meshes (experts') never mix in one op
    for part in model_parts:
        for p in part.parameters():
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = [torch.zeros((), device=mesh.device_type)]
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    norm = torch.stack(squares).sum()
    pp = mesh.submesh(PP)
    if pp is not None:  # each stage holds different parameters: sum the squares over stages
        dist.all_reduce(norm, group=pp.get_group())
    norm = norm.sqrt()
    if max_norm:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class FiniteWatch:
    """Whether every step's loss and gradient norm were finite, kept on the device: the host asks (a sync)
    only on logged steps and before a checkpoint is written, so a step that logs nothing never waits."""

    def __init__(self, device: torch.device):
        self.first_bad = torch.zeros(3, device=device)  # step (0: none yet), its mean loss, its grad norm

    def record(self, step: int, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> None:
        loss = torch.zeros((), device=grad_norm.device) if loss is None else loss  # a stage without the loss
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        # torch.full, not torch.tensor: a copy from the host would wait for the device to finish the step.
        seen = torch.stack([torch.full((), float(step), device=grad_norm.device), loss, grad_norm.float()])
        self.first_bad = torch.where((self.first_bad[0] == 0) & ~finite, seen, self.first_bad)

    def check(self) -> None:
        step, loss, grad_norm = self.first_bad.tolist()
        if step:
            raise FloatingPointError(f"loss is {loss} at step {int(step)} (grad norm {grad_norm}): stopped before "
                                     "any checkpoint holds the weights it updated; lower optimizer.lr or check the "
                                     "data")
