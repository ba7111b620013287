"""The device mesh every plugin shares, built by the core from the plan's mesh shape."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelMesh:
    """The named N-D device mesh of a job, with flattened views made on demand.

    Only the dimensions some plugin declared exist. ``submesh("dp_replicate", ("dp_shard", "cp"))``
    gives a mesh whose first dimension is dp_replicate and whose second is dp_shard and cp flattened
    into one; dimensions the plan does not have are left out, and None comes back when none remain.

    A dimension that borrows ranks (``borrowed``: name -> (degree, the adjacent dimensions it reuses))
    lives in a second mesh over the same ranks, where the borrowed dimensions are flattened and split
    into ``<name>_rest`` (outer) and ``<name>`` (inner, the nearer ranks). ``submesh("ep")`` and
    ``submesh(("ep_rest",))`` come from that mesh, together with any dimension it did not borrow.
    """

    def __init__(self, shape: Mapping[str, int], device_type: str,
                 borrowed: Mapping[str, tuple[int, tuple[str, ...]]] | None = None):
        self.shape = dict(shape)
        self.device_type = device_type
        self._root: DeviceMesh | None = (
            init_device_mesh(device_type, tuple(self.shape.values()), mesh_dim_names=tuple(self.shape))
            if self.shape else None)
        self._borrowing_roots = {dim: self._borrowing_root(dim, degree, lenders)
                                 for dim, (degree, lenders) in (borrowed or {}).items()}
        for dim, root in self._borrowing_roots.items():
            self.shape.setdefault(dim, root.size(root.mesh_dim_names.index(dim)))

    def _borrowing_root(self, dim: str, degree: int, lenders: tuple[str, ...]) -> DeviceMesh:
        names, sizes = [], []
        for name, size in self.shape.items():
            if name not in lenders:
                names.append(name)
                sizes.append(size)
            elif name == lenders[0]:
                lent = math.prod(self.shape[d] for d in lenders)
                names += [f"{dim}_rest", dim]
                sizes += [lent // degree, degree]
        if not lenders:  # nothing lent: the dimension and its rest are single ranks
            names += [f"{dim}_rest", dim]
            sizes += [1, 1]
        # Every rank builds the same groups in the same order, as DeviceMesh requires.
        world = math.prod(sizes)
        return DeviceMesh(self.device_type, torch.arange(world).view(*sizes), mesh_dim_names=tuple(names))

    def degree(self, dim: str) -> int:
        return self.shape.get(dim, 1)

    def submesh(self, *groups: str | tuple[str, ...]) -> DeviceMesh | None:
        wanted = {d for group in groups for d in ((group,) if isinstance(group, str) else group)}
        root = next((root for dim, root in self._borrowing_roots.items() if wanted & {dim, f"{dim}_rest"}), self._root)
        names = []
        for group in groups:
            dims = tuple(d for d in ((group,) if isinstance(group, str) else group)
                         if root is not None and d in root.mesh_dim_names)
            if root is not None and len(dims) > 1:
                root[dims]._flatten("_".join(dims))  # idempotent: the root keeps the view
            if dims:
                names.append("_".join(dims))
        if root is None or not names:
            return None
        with warnings.catch_warnings():
            # Slicing a flattened dimension off the root is what makes 2-D views such as
            # (dp_replicate, dp_shard_cp) possible; torch warns it may change after 2.13.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return root[tuple(names)]

    def local_rank(self, *dims: str) -> int:
        """This rank's coordinate along ``dims`` taken together (0 when none of them exist)."""
        mesh = self.submesh(tuple(dims))
        return 0 if mesh is None else mesh.get_local_rank()


def device_kind(configured: str | None) -> str:
    """``launch.device``: cuda or cpu as set, null for cuda when the machine has it."""
    return configured or ("cuda" if torch.cuda.is_available() else "cpu")


def cpu_threads(launch, world_size: int) -> int | None:
    """The threads a rank computes with on the CPU: ``launch.cpu_threads_per_worker`` when several workers share
    the cores, None when one process has them all (torch's default, every core)."""
    return launch.cpu_threads_per_worker if world_size > 1 else None


def device_for_rank(local_rank: int, configured: str | None) -> torch.device:
    """This local rank's own GPU, or the CPU."""
    if device_kind(configured) == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def set_collective_timeout(seconds: float) -> None:
    """Every process group of this rank (the mesh's sub-groups included) fails a collective that waits
    longer than ``seconds``: a rank that hangs ends the job instead of holding it forever."""
    for group in list(dist.distributed_c10d._world.pg_map):
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
