"""Accelerators' datasheets: the vendor's figures for each device titan-core knows, found by the exact device name.

Plain data, read by the training metrics (MFU's peak) and by the planner (which adds, in its own room, the shares
of these peaks that training reaches). A figure is the vendor's dense (no sparsity) peak per device. A device that
matches no datasheet is unknown: the caller asks for ``metrics.peak_tflops`` rather than taking a neighbour's
figure (an H100 PCIe peaks at three quarters of an H100 SXM, and a substring match on "H100" used to give it the
SXM's figure).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Datasheet", "DATASHEETS", "datasheet_by_device_name", "GH100", "GB100"]

GH100 = "gh100"  # the H100s' and the H200's die
GB100 = "gb100"  # the B200's and the GB200's


@dataclass(frozen=True)
class Datasheet:
    """One accelerator model as its vendor states it. Bandwidths are per device and per direction, in GB/s."""

    name: str
    device_names: str  # a regular expression that must match the whole of torch.cuda.get_device_name()
    bf16_tflops: float
    fp8_tflops: float | None = None  # None: no float8 matmuls
    memory_gib: float = 80.0
    memory_gbps: float = 3350.0  # device memory bandwidth, for the step's elementwise work
    intra_node_gbps: float = 450.0  # NVLink-class links between the devices of one node (or NVLink domain)
    inter_node_gbps: float = 50.0  # the network between nodes (400 Gb/s per device)
    devices_per_node: int = 8  # devices that share the intra-node links
    chip: str = ""  # the die, for measurements made on another card with it: plugins' tables are keyed by it
    # NVIDIA's compute capability (major, minor); None for other vendors. Kernels that need a generation
    # (MXFP8's block-scaled matmuls: 10.0, Blackwell) are judged by it.
    compute_capability: tuple[int, int] | None = None


DATASHEETS = (
    Datasheet("h100_sxm", r"NVIDIA H100 80GB HBM3|NVIDIA H100 SXM5 80GB", 989.4, 1978.9, 79.6, chip=GH100,
              compute_capability=(9, 0)),
    # The H100 SXM with 96 GB of HBM2e (2.4 TB/s) that TorchTitan's published Llama 3.1 tables ran on.
    Datasheet("h100_sxm_96gb", r"NVIDIA H100 SXM5 96GB|NVIDIA H100 96GB HBM2e", 989.4, 1978.9, 94.5, 2400.0,
              chip=GH100, compute_capability=(9, 0)),
    Datasheet("h100_pcie", r"NVIDIA H100 PCIe", 756.0, 1513.0, 79.6, 2000.0, 64.0, chip=GH100,
              compute_capability=(9, 0)),
    Datasheet("h100_nvl", r"NVIDIA H100 NVL", 835.5, 1670.9, 93.0, 3900.0, 300.0, chip=GH100,
              compute_capability=(9, 0)),
    Datasheet("h200", r"NVIDIA H200", 989.4, 1978.9, 139.8, 4800.0, chip=GH100, compute_capability=(9, 0)),
    Datasheet("a100", r"NVIDIA A100-SXM4-(40|80)GB|NVIDIA A100-PCIE-40GB|NVIDIA A100 80GB PCIe", 312.0, None, 79.2,
              2039.0, 300.0, 25.0, compute_capability=(8, 0)),
    Datasheet("l40s", r"NVIDIA L40S", 362.1, 733.0, 44.4, 864.0, 32.0, 25.0, compute_capability=(8, 9)),
    Datasheet("mi300x", r"AMD Instinct MI300X", 1307.4, 2614.9, 191.5, 5300.0, 448.0),
    # NVIDIA's Blackwell datasheets (HGX B200: 180 GB; GB200 NVL72, per GPU: 186 GB, its 72 GPUs one NVLink domain);
    # 1.8 TB/s of NVLink 5 per GPU both ways, 800 Gb/s of network per GPU. Memory as torch sees it: a B200 run of
    # TorchTitan's reserved 167.93 GiB, "94.15%" of the device (PR 2237's DeepEP README), so 178.4 GiB where the
    # datasheet's 180 GB is 167.6; the GB200's, with no such log read, is its datasheet's GB in GiB.
    Datasheet("b200", r"NVIDIA B200", 2250.0, 4500.0, 178.4, 7700.0, 900.0, 100.0, chip=GB100,
              compute_capability=(10, 0)),
    Datasheet("gb200", r"NVIDIA GB200", 2500.0, 5000.0, 173.2, 8000.0, 900.0, 100.0, devices_per_node=72,
              chip=GB100, compute_capability=(10, 0)),
)


def datasheet_by_device_name(device_name: str) -> Datasheet | None:
    """The datasheet whose pattern matches the whole device name, or None for a device it does not know."""
    return next((sheet for sheet in DATASHEETS if re.fullmatch(sheet.device_names, device_name.strip())), None)
