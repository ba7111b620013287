"""Muon's orthogonalisation across the ranks of a gloo world, against one process's, every layout a plan makes.

Run by torchrun on 4 ranks; each rank writes ``<out>/rank<r>.json`` for plugins/muon/tests/test_muon.py:

    python -m torch.distributed.run --standalone --nproc-per-node=4 exchange_ranks.py OUT
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from titan_muon.exchange import rows_held
from titan_muon.optimizer import MuonWithAdamW, NewtonSchulz

# Uneven rows, fewer rows than ranks, a tall and a wide matrix, an expert stack; laid out as FSDP (rows), tensor
# parallel (columns), HSDP (replicated then rows) and fully replicated.
SHAPES = [(10, 6), (7, 9), (3, 5), (16, 8), (1, 4), (9, 9), (4, 3, 5)]


def layouts(ndim: int) -> list[list]:
    rows, columns = [Shard(0)] * ndim, [Shard(1)] * ndim
    return [rows, [Shard(1)] + rows[1:], [Replicate()] * ndim, rows, columns, [Replicate()] + rows[1:], columns]


def orthogonalised_on(mesh, newton_schulz: NewtonSchulz) -> dict:
    """Every matrix orthogonalised across ``mesh``, each rank's piece put back whole, against one process's."""
    generator = torch.Generator().manual_seed(0)
    matrices = [torch.randn(shape, generator=generator) for shape in SHAPES]
    updates = [distribute_tensor(m, mesh, layout) for m, layout in zip(matrices, layouts(mesh.ndim))]
    optimizer = MuonWithAdamW([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "muon": True}], newton_schulz)
    newton_schulz.flops = 0
    pieces, flops = optimizer._orthogonalized(updates), newton_schulz.flops
    worst = max((DTensor.from_local(piece, mesh, u.placements, shape=u.shape, stride=u.stride()).full_tensor()
                 - newton_schulz(m)).abs().max().item() for piece, u, m in zip(pieces, updates, matrices))
    exchange = next(iter(optimizer._exchanges.values()))
    return {"worst": worst, "flops": flops, "received": optimizer.received_bytes,
            "expected_received": expected_received(exchange, updates) if mesh.ndim == 1 else None}


def expected_received(exchange, updates) -> int:
    """On one mesh dimension: the owned matrices' rows this rank does not hold, every other matrix's own rows back,
    and the re-layouts of what is not laid out by rows (its piece each way), in float32."""
    rank, ranks, total = exchange.coordinate, exchange.mesh_shape, 0
    matrices = [u for u in updates if u.ndim == 2]
    for index, update in enumerate(matrices):
        mine = rows_held(update.shape[0], ranks, rank)[1] * update.shape[1]
        total += update.numel() - mine if exchange.owners[index] == rank else mine
    return 4 * (total + sum(2 * u.to_local().numel() for u in updates if u.placements[0] != Shard(0)))


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    newton_schulz = NewtonSchulz((3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
    found = {"flat 4": orthogonalised_on(init_device_mesh("cpu", (4,), mesh_dim_names=("a",)), newton_schulz),
             "2 x 2": orthogonalised_on(init_device_mesh("cpu", (2, 2), mesh_dim_names=("b", "c")), newton_schulz)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(found))
    # No rank leaves while another may still read its last exchange: a peer gone mid-read aborts the reader's gloo
    # thread (seen once under a loaded machine: SIGABRT, "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
