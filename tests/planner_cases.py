"""What the planner's tests (tests/test_planner_*.py) share: a CPU profile, the tiny job, the estimate of a job and
torch's tracker over a step of it (tracked_rank.py), and the plan command run as a user runs it.

Loaded by path, as the tests load tracked_rank.py (the suite imports in importlib mode: tests/ is not on the path).
"""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_core.planner.costs import estimate
from titan_core.planner.estimate import evaluated
from titan_core.planner.hardware import Hardware
from titan_core.plugins import Registry, build_plan
from titan_core.testing import compose

spec = importlib.util.spec_from_file_location("tracked_rank", Path(__file__).with_name("tracked_rank.py"))
tracked_rank = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tracked_rank)
replay_spec = importlib.util.spec_from_file_location("allocator_replay", Path(__file__).with_name("allocator_replay.py"))
allocator_replay = importlib.util.module_from_spec(replay_spec)
replay_spec.loader.exec_module(allocator_replay)

CPU = Hardware("cpu-test", "", bf16_tflops=0.1, memory_gib=16.0, memory_gbps=10.0, intra_node_gbps=1.0,
               inter_node_gbps=1.0, devices_per_node=1024, achievable=1.0, device_type="cpu")
SMALL = ("model=tiny", "tokenizer.path=bytes", "training.seq_len=64", "training.global_batch_size=8")
DISTRIBUTED = ("+plugins=[fsdp]", "plugins.fsdp.degree=4")
TP_NO_SP = ("+plugins=[tp]", "plugins.tp.degree=2", "plugins.tp.sequence_parallel=false")


def _estimate(*overrides):
    config = compose(*SMALL, *overrides)
    registry = Registry(config)
    plan = build_plan(config, registry, None, 256)
    return config, registry, plan, estimate(config, plan, registry, CPU)


def _tracked_step(config, registry, plan, fake_tensors: bool = False, allocations: list | None = None) -> dict:
    """Torch's tracker over a step of rank 0 of the plan, in this process: a fake process group stands in for the
    other ranks (its collectives move nothing but make their results at full size)."""
    return _on_rank0(tracked_rank.tracked_step, config, registry, plan, fake_tensors, allocations)


def _on_rank0(measure, config, registry, plan, *args):
    """``measure(config, registry, plan, *args)`` as rank 0 of the plan's world on a fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        return measure(config, registry, plan, *args)
    finally:
        dist.destroy_process_group()
        tracked_rank.forget_meshes()


def _each_rank_tracked(overrides, tmp_path):
    """Each rank of the plan (``SMALL`` and ``overrides``, as :func:`_estimate` plans it) run on its own real world:
    its number, its estimate (its pipeline stage's) at the expert load it measured, and what torch's tracker
    measured."""
    *_, plan, result = _estimate(*overrides)
    ranks = subprocess.run([sys.executable, tracked_rank.__file__, str(plan.world_size), str(tmp_path), *SMALL,
                            *overrides], timeout=600, capture_output=True, text=True)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    dims = list(plan.mesh_shape)
    inner = math.prod(list(plan.mesh_shape.values())[dims.index("pp") + 1:]) if "pp" in dims else plan.world_size
    for rank in range(plan.world_size):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        estimated = result.each_rank()[rank // inner % len(result.each_rank())]
        loads = {"expert_load": max(1.0, measured["expert_load"]),
                 "expert_load_peak": max(1.0, measured["expert_load_peak"])}
        yield rank, dataclasses.replace(estimated, **loads), measured


def _term(result, what: str) -> float:
    """The bytes of the memory term whose description starts with ``what``."""
    return sum(evaluated(nbytes, result) for _, name, nbytes, _, _ in result.memory_terms if name.startswith(what))


def _printed_bytes(text: str, label: str) -> float:
    """The size the plan command printed after ``label`` on the first line holding it."""
    line = next(line for line in text.splitlines() if label in line)
    number, unit = line.split(label)[1].split()[:2]
    return float(number) * {"MiB": 2**20, "KiB": 2**10}[unit.rstrip(",")]


def _plan_command(*args, env=None):
    return subprocess.run([sys.executable, "-m", "titan_core.planner", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)
