"""Accelerator profiles: datasheet figures of the devices titan-core knows, found by the exact device name.

A figure is the vendor's dense (no sparsity) peak per device. A device that matches no profile is unknown:
the caller asks for ``metrics.peak_tflops`` rather than taking a neighbour's figure (an H100 PCIe peaks at
three quarters of an H100 SXM, and a substring match on "H100" used to give it the SXM's figure).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and its dense bf16 peak (the figure MFU is quoted against)."""

    name: str
    device_names: str  # a regular expression that must match the whole of torch.cuda.get_device_name()
    bf16_tflops: float


PROFILES = (
    Hardware("h100_sxm", r"NVIDIA H100 80GB HBM3|NVIDIA H100 SXM5 80GB", 989.4),
    Hardware("h100_pcie", r"NVIDIA H100 PCIe", 756.0),
    Hardware("h100_nvl", r"NVIDIA H100 NVL", 835.5),
    Hardware("h200", r"NVIDIA H200", 989.4),
    Hardware("a100", r"NVIDIA A100-SXM4-(40|80)GB|NVIDIA A100-PCIE-40GB|NVIDIA A100 80GB PCIe", 312.0),
    Hardware("l40s", r"NVIDIA L40S", 362.1),
    Hardware("mi300x", r"AMD Instinct MI300X", 1307.4),
)


def by_device_name(device_name: str) -> Hardware | None:
    """The profile whose pattern matches the whole device name, or None for a device it does not know."""
    return next((profile for profile in PROFILES if re.fullmatch(profile.device_names, device_name.strip())), None)
