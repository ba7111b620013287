"""Host time of a plan's forward and backward relative to one process's: what DTensor's sharding propagation
costs on top of eager PyTorch's dispatch.

    python bench/dtensor_dispatch.py [override ...]

Each plan's rank 0 is built as a worker builds it, in this process, with a fake process group standing in for
the other ranks (its collectives move nothing), and runs forward and backward on 2 tokens of a narrow model, where
arithmetic is negligible: what is left is the host's time. The tp plugin's ``DTENSOR_DISPATCH`` (the factor the planner
applies to the host time of the operators it counts in one process's trace) is this bench's ``tp 2`` ratio.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_core.mesh import ParallelMesh
from titan_core.plugins import Hooks, Registry, build_plan
from titan_core.planner.facts import timed_step
from titan_core.testing import compose
from titan_core.train import build_model_parts

PLANS = {"1 process": [], "tp 2": ["+plugins=[tp]", "plugins.tp.degree=2"],
         "tp 2, no sequence parallel": ["+plugins=[tp]", "plugins.tp.degree=2", "plugins.tp.sequence_parallel=false"]}
# The debug model's structure at a width where the arithmetic is a few percent of the step.
DEFAULTS = ("model=debug", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=32",
            "tokenizer.path=bytes", "training.seq_len=2", "training.global_batch_size=2")
REPEATS = 30


def step_seconds(overrides: list[str]) -> tuple[float, int]:
    """Seconds of a forward and backward of the plan's rank 0, and the aten operators it runs."""
    config = compose(*DEFAULTS, *overrides)
    registry = Registry(config)
    plan = build_plan(config, registry, None, 256)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        hooks = Hooks(registry, plan, config)
        (model,) = build_model_parts(hooks, ParallelMesh(plan.mesh_shape, "cpu", plan.borrowed()), config,
                                     torch.device("cpu"))
        tokens = torch.zeros(1, config.training.seq_len, dtype=torch.long)

        step = lambda: model(tokens).float().sum().backward()  # noqa: E731
        step()  # DTensor fills its sharding caches
        return timed_step(step, REPEATS)
    finally:
        dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    measured = {name: step_seconds([*plan, *sys.argv[1:]]) for name, plan in PLANS.items()}
    single = measured["1 process"][0]
    print(f"{'plan':<28} {'ms per step':>12} {'operators':>10} {'vs 1 process':>13}")
    for name, (seconds, ops) in measured.items():
        print(f"{name:<28} {seconds * 1e3:>12.2f} {ops:>10} {seconds / single:>12.1f}x")


if __name__ == "__main__":
    main()
