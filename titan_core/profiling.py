"""What a window of steps did, for the user who switches it on with ``metrics.profile_steps=[first,last]``.

Each rank writes into ``profile/`` of the run dir:

- ``rank<r>.trace.json``: torch profiler's Chrome/Perfetto trace of the window (CPU ops, and the CUDA
  kernels on a GPU), one ``ProfilerStep#<step>`` range per step; open it in https://ui.perfetto.dev;
- ``rank<r>.memory.jsonl``: a line per step of the window: the process's resident and peak resident memory
  and the live bytes of the parameters, gradients and optimizer state this rank holds (and on CUDA the
  allocated and reserved memory), for plotting;
- ``rank<r>.cuda_memory.pickle`` on CUDA: the allocator's snapshot of the window, for
  https://pytorch.org/memory_viz.

Only the steps of the window pay for it: the profiler starts before the first and stops after the last.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

GIB = 2**30


def _bytes(tensors) -> int:
    """Bytes of the memory holding ``tensors``, each block counted once (FSDP's gradients share one)."""
    storages = {}
    for tensor in tensors:
        storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def memory_record(step: int, model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                  device: torch.device) -> dict:
    """Memory of this process after ``step``, by what holds it, in GiB."""
    params = [p for part in model_parts for p in part.parameters()]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    with open("/proc/self/statm") as statm:  # the second field is the resident set, in pages
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    record = {"step": step, "rss_gib": resident / GIB,
              "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: KiB
              "parameters_gib": _bytes(params) / GIB,
              "gradients_gib": _bytes(p.grad for p in params if p.grad is not None) / GIB,
              "optimizer_state_gib": _bytes(states) / GIB}
    if device.type == "cuda":
        record |= {"cuda_allocated_gib": torch.cuda.memory_allocated(device) / GIB,
                   "cuda_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                   "cuda_reserved_gib": torch.cuda.memory_reserved(device) / GIB}
    return record


class StepProfiler:
    """Profiles the steps ``window[0]`` to ``window[1]``; does nothing when the window is empty."""

    def __init__(self, window: list[int], run_dir: Path, rank: int, device: torch.device):
        self.first: int | None
        self.last: int | None
        self.first, self.last = window if window else (None, None)
        self.folder = run_dir / "profile"
        self.rank, self.device = rank, device
        self.profiler: torch.profiler.profile | None = None

    def step_begins(self, step: int) -> None:
        """Start profiling at the window's first step (or its first step after a resume inside it)."""
        if self.profiler is not None or self.first is None or self.last is None or not self.first <= step <= self.last:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        # Kineto prints a line at every start and stop whatever its log level up to errors (6 is above its last).
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        # A schedule (recording throughout) makes the profiler mark each step as a range ProfilerStep#<n>,
        # numbered from the training step it starts at.
        self.profiler = profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                                          schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
        profiler.step_num = step
        profiler.__enter__()

    def step_ended(self, step: int, model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        if self.profiler is None:
            return
        with open(self.folder / f"rank{self.rank}.memory.jsonl", "a") as memory:
            memory.write(json.dumps(memory_record(step, model_parts, optimizer, self.device)) + "\n")
        if step == self.last:
            self.stop()
        else:
            self.profiler.step()

    def stop(self) -> None:
        """End the window early (the run ended inside it) or at its last step, and write the files."""
        if self.profiler is None:
            return
        self.profiler.__exit__(None, None, None)
        self.profiler.export_chrome_trace(str(self.folder / f"rank{self.rank}.trace.json"))
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{self.rank}.cuda_memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.profiler = None
