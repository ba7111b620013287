"""Accelerator profiles: each device's datasheet (:mod:`titan_core.devices`) with the shares of its peaks that
training reaches, found by name or by the exact device name, and a profile of this machine's CPU measured on the spot.

``achievable`` and ``fp8_achievable`` are the figures that are not a datasheet's: the share of the dense peak
(bf16, float8) that a training step's matmuls reach end to end on that card, kernels' efficiency and everything
the step does between them. Each is set from one published run on the card, named beside it, and every other
run of that card in ``bench/planner_vs_seeds.py`` is a prediction (docs/planner.md prints the errors). A card
without a published run takes the H100's shares (the L40S and the GB200: unchecked, and the plan says their
expected error is unknown), and so do the H100 profiles, all set from the seeds' power-limited H100s: a
full-power H100 SXM is likely planned slow.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from titan_core.devices import DATASHEETS, Datasheet
from titan_core.errors import ConfigError
from titan_core.planner.facts import timed_step

# H100: TorchTitan's Llama 3.1 8B FSDP job on 8 H100s (bf16), and its FSDP + compile + float8 job (float8). A recipe
# whose speed-ups by shape are tabled for the card's chip (titan_float8.measured: tensorwise and rowwise on GH100)
# reads the table instead of the float8 share; that job now sets tensorwise's factor there.
ACHIEVABLE = 0.41
H100_FP8_ACHIEVABLE = 0.40
# Of a device's memory, what a plan may fill: the rest goes to the CUDA context, the kernels' workspaces and
# the caching allocator's fragmentation, none of which the planner counts.
USABLE_SHARE = 0.9
# H200: TorchTitan's Llama 3 8B FSDP + compile + float8 job on 32 H200s (June 2025), float8; bf16 by the same
# factor, 1.2 times the H100's shares: those came from the seeds' H100s, which ran at a 500 W limit (TorchTitan:
# their peak lies between the SXM's and the NVL's) and with December 2024's software. Set while tensorwise was priced
# at the float8 share; at the H100's table and factor (2026-12-06) its two runs are -3% and -1%.
H200_ACHIEVABLE = 0.49
H200_FP8_ACHIEVABLE = 0.48


@dataclass(frozen=True)
class Hardware(Datasheet):
    """One accelerator model: its datasheet, and what the planner adds to it."""

    achievable: float = ACHIEVABLE
    fp8_achievable: float | None = None  # the share of the float8 peak float8 matmuls reach (None: achievable)
    # Fixed costs the bandwidths miss: one collective call's latency (NCCL's small-message figure within an
    # NVLink node), and the host's time to issue one operator eagerly (dispatch and autograd's bookkeeping).
    collective_latency_us: float = 10.0
    op_overhead_us: float = 10.0
    device_type: str = "cuda"  # what torch calls it: the dtypes plugins choose follow it (bf16 on GPUs)
    cores: int | None = None  # CPU profiles, measured on one thread: the cores a node's workers share

    @property
    def blackwell(self) -> bool:
        """An NVIDIA card of compute capability 10 or later, whose tensor cores take MXFP8's block scales."""
        return self.compute_capability is not None and self.compute_capability >= (10, 0)

    @property
    def usable_gib(self) -> float:
        """What a plan may fill of one device's memory."""
        return self.memory_gib * USABLE_SHARE

    def peak_tflops(self, float8: bool = False) -> float:
        return self.fp8_tflops if float8 and self.fp8_tflops else self.bf16_tflops

    def matmul_tflops(self, float8: bool = False) -> float:
        """What a training step's matmuls reach end to end: the dense peak times the share this card reaches."""
        if float8 and self.fp8_tflops:
            return self.fp8_tflops * (self.fp8_achievable or self.achievable)
        return self.bf16_tflops * self.achievable


# The shares set from published runs, by datasheet (the rest take the H100's: ACHIEVABLE, H100_FP8_ACHIEVABLE).
SHARES = {
    "h200": {"achievable": H200_ACHIEVABLE, "fp8_achievable": H200_FP8_ACHIEVABLE},
    # TorchTitan's Llama 3 8B FSDP job on 64 A100s, selective op checkpointing (docs/performance.md, April 2024).
    "a100": {"achievable": 0.64},
    # torchao's Llama 3 8B FSDP + compile runs on 8 MI300X, bf16 and float8 tensorwise (torchao/float8/README.md).
    "mi300x": {"achievable": 0.27, "fp8_achievable": 0.17},
    # torchao's Llama 3 8B FSDP + compile runs on 8 B200s limited to 750 W, bf16 and float8 tensorwise (pytorch/ao
    # docs/source/workflows/training.md): a B200 at its full 1,000 W is likely planned slow.
    "b200": {"achievable": 0.24, "fp8_achievable": 0.17},
}


def _profile(sheet: Datasheet) -> Hardware:
    shares = SHARES.get(sheet.name, {"fp8_achievable": H100_FP8_ACHIEVABLE if sheet.fp8_tflops else None})
    return Hardware(**dataclasses.asdict(sheet), **shares)


PROFILES = tuple(_profile(sheet) for sheet in DATASHEETS)
ALIASES = {"h100": "h100_sxm"}
CPU_MEASURED = "cpu-measured"


def by_device_name(device_name: str) -> Hardware | None:
    """The profile whose pattern matches the whole device name, or None for a device it does not know."""
    return next((profile for profile in PROFILES if re.fullmatch(profile.device_names, device_name.strip())), None)


def hardware_profile(name: str) -> Hardware:
    """A profile by name (``h100``, ``a100``, ...), ``cpu-measured`` (this machine, measured now), or the path
    of a YAML file with the fields of :class:`Hardware`."""
    known = {p.name: p for p in PROFILES}
    if name in known or name in ALIASES:
        return known[ALIASES.get(name, name)]
    if name == CPU_MEASURED:
        return cpu_measured()
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError("--hardware", f"no file {path}", "give the path of a hardware YAML file")
        try:
            fields = OmegaConf.to_container(OmegaConf.load(path))
        except Exception as error:  # noqa: BLE001 - yaml's and OmegaConf's parse errors alike: one line
            reason = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
            raise ConfigError("--hardware", f"{path} is not a YAML mapping of a device's figures ({reason})",
                              "fix the file's syntax (key: value lines; see docs/planner.md)") from None
        if not isinstance(fields, dict):
            raise ConfigError("--hardware", f"{path} is not a YAML mapping of a device's figures",
                              "write key: value lines (see docs/planner.md)")
        fields.setdefault("name", path.stem)
        fields.setdefault("device_names", "")
        if isinstance(fields.get("compute_capability"), list):  # YAML has no tuples
            fields["compute_capability"] = tuple(fields["compute_capability"])
        numbers = {f.name for f in dataclasses.fields(Hardware) if f.type.split(" |")[0] in ("float", "int")}
        for key, value in fields.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key in numbers and value is not None and not number:
                raise ConfigError("--hardware", f"{path}: {key} is {value!r}, not a number", f"set {key} to a number")
            if number and value <= 0:
                raise ConfigError("--hardware", f"{path}: {key} is {value}", f"set {key} to a positive number")
        try:
            return Hardware(**fields)
        except TypeError as error:
            raise ConfigError("--hardware", f"{path}: {error}",
                              "use the fields of titan_core.planner.hardware.Hardware") from None
    choices = ", ".join([*known, *ALIASES, CPU_MEASURED])
    raise ConfigError("--hardware", f"unknown hardware '{name}'", f"use one of {choices}, or a YAML file")


def cpu_measured() -> Hardware:
    """This machine, measured now as one worker sees it (one thread): a float32 matmul's speed, a memory
    copy's and a loopback socket's bandwidth (what gloo moves over between local workers), a gloo all-reduce's
    latency and an eager operator's host time; all its workers on one node, sharing its cores."""
    link = loopback_gbps()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tflops, copy_gbps, op_us = measured_matmul_tflops(), _copy_gbps(), _op_overhead_us()
    finally:
        torch.set_num_threads(threads)
    return Hardware(CPU_MEASURED, "", bf16_tflops=tflops, memory_gib=memory, memory_gbps=copy_gbps,
                    intra_node_gbps=link, inter_node_gbps=link, devices_per_node=1 << 20, achievable=1.0,
                    collective_latency_us=_gloo_latency_us(), op_overhead_us=op_us,
                    device_type="cpu", cores=os.cpu_count())


def measured_matmul_tflops(size: int = 1024, seconds: float = 0.3) -> float:
    """TFLOPS of a float32 matmul on this CPU, on the threads torch has now."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up: first call pays for thread pool start-up
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        runs += 1
    return 2 * size**3 * runs / (time.perf_counter() - start) / 1e12


def _copy_gbps() -> float:
    source = torch.empty(64 << 20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    start = time.perf_counter()
    for _ in range(4):
        target.copy_(source)
    return 4 * 2 * source.numel() / (time.perf_counter() - start) / 1e9


def _op_overhead_us(repeats: int = 200) -> float:
    """Microseconds per operator of a forward and backward on tensors too small for arithmetic to count."""
    weight, inputs = torch.zeros(4, 4, requires_grad=True), torch.zeros(2, 4)
    seconds, operators = timed_step(
        lambda: torch.nn.functional.linear(inputs, weight).mul(2).relu().sum().backward(), repeats)
    return seconds / operators * 1e6


def _gloo_latency_us(rounds: int = 5, repeats: int = 20) -> float:
    """Microseconds of a small all-reduce between two gloo ranks, run as two threads of this process: the
    fastest of a few rounds, as the machine's other work slows some."""
    store, seconds = dist.HashStore(), []

    def rank(index: int) -> None:
        group, tensor = dist.ProcessGroupGloo(store, index, 2), torch.zeros(16)
        group.allreduce([tensor]).wait()
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(repeats):
                group.allreduce([tensor]).wait()
            seconds.append((time.perf_counter() - start) / repeats)

    ranks = [threading.Thread(target=rank, args=(index,)) for index in range(2)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    return min(seconds) * 1e6


def loopback_gbps(megabytes: int = 64) -> float:
    """GB/s of one TCP stream over the loopback interface."""
    server = socket.create_server(("127.0.0.1", 0))
    payload = bytes(1 << 20)

    def send():
        with socket.create_connection(server.getsockname()) as out:
            for _ in range(megabytes):
                out.sendall(payload)

    sender = threading.Thread(target=send)
    start = time.perf_counter()
    sender.start()
    connection, _ = server.accept()
    received = 0
    with connection, server:
        while received < megabytes << 20:
            chunk = connection.recv(1 << 20)
            if not chunk:
                break
            received += len(chunk)
    sender.join()
    return received / (time.perf_counter() - start) / 1e9
