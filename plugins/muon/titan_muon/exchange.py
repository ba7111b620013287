"""Matrices sharded by rows over a device mesh, gathered whole to one owner each and scattered back.

Newton–Schulz needs each matrix whole. Brought to DTensor's all-rows layout (``Shard(0)`` on every mesh
dimension: FSDP's own; a tensor-parallel split is re-laid out to it), the k-th matrix's rows are spread over
the mesh's ranks, and one rank, its owner, is to orthogonalise it. ``OwnerExchange.gather`` brings every
matrix to its owner with one all-to-all per mesh dimension, the last first: along dimension d the ranks that
already hold a matrix whole along the dimensions after d send their rows to the one whose coordinate d is the
owner's. ``scatter`` takes the owners' results back the same way, first dimension first. A rank receives the
matrices it owns and its own rows of the rest; no process group beyond the mesh's own is made.
"""

from __future__ import annotations

import heapq
import math

import torch
import torch.distributed as dist

__all__ = ["OwnerExchange", "assign_owners", "rows_held"]


def rows_held(rows: int, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...]) -> tuple[int, int]:
    """First row and number of rows of a ``rows``-row matrix sharded by rows over each mesh dimension in turn
    (DTensor's ``Shard(0)`` everywhere, chunks as ``torch.chunk`` cuts them) that the ranks at ``coordinate``, a
    prefix of a mesh coordinate, hold between them."""
    start, count = 0, rows
    for ranks, c in zip(mesh_shape, coordinate):
        chunk = -(-count // ranks)
        first = min(c * chunk, count)
        start, count = start + first, min(first + chunk, count) - first
    return start, count


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """The owning rank of each matrix of ``costs``: the costliest first, each to the rank with the least work so
    far, so that no rank's work exceeds the even share by more than one matrix."""
    load = [(0, rank) for rank in range(ranks)]
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        work, rank = heapq.heappop(load)
        owners[index] = rank
        heapq.heappush(load, (work + costs[index], rank))
    return owners


class OwnerExchange:
    """The owners of matrices of ``shapes`` on ``mesh`` (by ``costs``, the work each takes), and their exchange."""

    def __init__(self, mesh, shapes: list[torch.Size], costs: list[int]):
        self.mesh, self.shapes = mesh, [torch.Size(s) for s in shapes]
        self.mesh_shape, self.coordinate = tuple(mesh.shape), tuple(mesh.get_coordinate())
        owners = torch.unravel_index(torch.tensor(assign_owners(costs, math.prod(self.mesh_shape))), self.mesh_shape)
        self.owners = [tuple(int(c) for c in coordinate) for coordinate in zip(*owners)]
        self.received_bytes = 0  # by this rank in the last gather and scatter, from other ranks

    def _holding(self, dim: int) -> list[int]:
        """The matrices this rank holds whole along the mesh dimensions from ``dim`` on (rows of them: the first
        dimensions' share): those whose owner shares this rank's coordinates from ``dim``."""
        return [i for i, owner in enumerate(self.owners) if owner[dim:] == self.coordinate[dim:]]

    def _rows(self, index: int, prefix: tuple[int, ...]) -> tuple[int, int]:
        return rows_held(self.shapes[index][0], self.mesh_shape, prefix)

    def _all_to_all(self, dim: int, sent: list[list[torch.Tensor]], receive_counts: list[int],
                    dtype: torch.dtype) -> list[torch.Tensor]:
        """Each rank along mesh dimension ``dim`` sends ``sent[m]`` to the m-th and receives ``receive_counts[m]``
        elements from it, returned split by sender."""
        device = self.mesh.device_type
        send_counts = [sum(t.numel() for t in parts) for parts in sent]
        # One buffer for every peer, cut by the counts: the pieces are copied once, not per peer and again joined.
        send = torch.cat([t.reshape(-1).to(dtype) for parts in sent for t in parts] or
                         [torch.empty(0, dtype=dtype, device=device)])
        received = torch.empty(sum(receive_counts), dtype=dtype, device=device)
        dist.all_to_all_single(received, send, receive_counts, send_counts, group=self.mesh.get_group(dim))
        me = self.coordinate[dim]
        self.received_bytes += (sum(receive_counts) - receive_counts[me]) * received.element_size()
        return list(received.split(receive_counts))

    def gather(self, pieces: list[torch.Tensor], dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """Each matrix whole, in ``dtype``, on its owner, from every rank's ``pieces`` (its rows of each matrix, in
        the all-rows layout): {index: matrix} of the matrices this rank owns."""
        self.received_bytes = 0
        for index, piece in enumerate(pieces):  # every rank counts on the others' rows: a mismatch would hang
            if piece.shape[0] != self._rows(index, self.coordinate)[1]:
                raise ValueError(f"a matrix of shape {tuple(self.shapes[index])} is held as {piece.shape[0]} rows on "
                                 f"mesh coordinate {self.coordinate}, not as Shard(0) on every dimension cuts it")
        held = dict(enumerate(pieces))
        for dim in reversed(range(len(self.mesh_shape))):
            ranks, prefix = self.mesh_shape[dim], self.coordinate[:dim]
            sent: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
            for index, rows in held.items():
                sent[self.owners[index][dim]].append(rows)
            arriving = self._holding(dim)
            counts = [sum(self._rows(i, (*prefix, m))[1] * self.shapes[i][1:].numel() for i in arriving)
                      for m in range(ranks)]
            del held  # what was sent: only what arrives is kept from here on
            parts = [part.split([self._rows(i, (*prefix, m))[1] * self.shapes[i][1:].numel() for i in arriving])
                     for m, part in enumerate(self._all_to_all(dim, sent, counts, dtype))]
            del sent
            held = {i: torch.cat([parts[m][n] for m in range(ranks)]).view(-1, *self.shapes[i][1:])
                    for n, i in enumerate(arriving)}
            del parts  # the received buffer, copied into the matrices it holds
        return held

    def scatter(self, results: dict[int, torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's rows of each matrix (in the all-rows layout), in ``dtype``, from the owners' ``results``
        {index: matrix}."""
        held = results
        for dim in range(len(self.mesh_shape)):
            ranks, prefix = self.mesh_shape[dim], self.coordinate[:dim]
            sent: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
            for index in sorted(held):
                start = self._rows(index, prefix)[0]
                for m in range(ranks):
                    first, count = self._rows(index, (*prefix, m))
                    sent[m].append(held[index][first - start:first - start + count])
            arriving = self._holding(dim + 1)
            sizes = [self._rows(i, self.coordinate[:dim + 1])[1] * self.shapes[i][1:].numel() for i in arriving]
            counts = [0] * ranks
            for i, size in zip(arriving, sizes):
                counts[self.owners[i][dim]] += size
            parts, taken, held = self._all_to_all(dim, sent, counts, dtype), [0] * ranks, {}
            for i, size in zip(arriving, sizes):
                source = self.owners[i][dim]
                held[i] = parts[source][taken[source]:taken[source] + size].view(-1, *self.shapes[i][1:])
                taken[source] += size
        return [held[i] for i in range(len(self.shapes))]
