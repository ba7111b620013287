"""The nodes of a job started without torchrun: this machine alone, or a SLURM allocation that submitit
started (``-m hydra/launcher=submitit_slurm``, see docs/cluster.md).

Under submitit each node runs one task: the launcher, which starts the node's workers with torch's elastic
agent; the agents of all nodes meet in a c10d rendezvous on the allocation's first host, as torchrun's do.
"""

from __future__ import annotations

import os
import uuid
import zlib
from dataclasses import dataclass

import torch

from titan_core.errors import ConfigError
from titan_core.mesh import device_kind

# The rendezvous port of a multi-node job: derived from the job id, so every node computes the same one
# and two jobs sharing a host rarely collide.
PORTS = range(20000, 60000)


@dataclass(frozen=True)
class Nodes:
    count: int
    index: int  # this node's, from 0
    rendezvous: str  # host:port of the c10d rendezvous
    run_id: str


def job_nodes() -> Nodes:
    """The nodes of this job as the scheduler placed it (one node when no scheduler started it)."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return Nodes(1, 0, "127.0.0.1:0", uuid.uuid4().hex)  # port 0: the OS picks a free one
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks != job.num_nodes:
        raise ConfigError("hydra.launcher.tasks_per_node", f"{job.num_tasks // job.num_nodes} tasks per node, but "
                          "titan-core starts a node's workers itself", "set hydra.launcher.tasks_per_node=1 and "
                          "hydra.launcher.gpus_per_node to the GPUs of a node")
    if job.num_nodes == 1:
        return Nodes(1, 0, "127.0.0.1:0", f"submitit-{job.job_id}")
    port = PORTS[zlib.crc32(job.job_id.encode()) % len(PORTS)]
    return Nodes(job.num_nodes, job.node, f"{job.hostnames[0]}:{port}", f"submitit-{job.job_id}")


def allocated_world_size(nodes: Nodes, configured_device: str | None) -> int | None:
    """A multi-node GPU job's world: a worker per GPU of every node, as torchrun's would be; None for a job on
    one machine or on CPUs, whose degrees (or launch.world_size) set it."""
    if nodes.count == 1 or device_kind(configured_device) != "cuda":
        return None
    return nodes.count * torch.cuda.device_count()


def workers_per_node(world_size: int, nodes: Nodes) -> int:
    """The local workers each node starts; the world must split evenly over the nodes."""
    if world_size % nodes.count:
        raise ConfigError("launch.world_size", f"a world of {world_size} rank(s) does not split over "
                          f"{nodes.count} nodes", f"use a multiple of {nodes.count} ranks (the degrees' product, "
                          "or launch.world_size), or change hydra.launcher.nodes")
    return world_size // nodes.count
