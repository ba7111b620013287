"""MFU's peak comes from the accelerator's own profile, by its exact name; an unknown one asks for it."""

import pytest
import torch

from titan_core.metrics import peak_tflops


@pytest.mark.parametrize("device_name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("AMD Instinct MI300X", 1307.4),
])
def test_mfu_takes_the_peak_of_the_exact_accelerator(monkeypatch, device_name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    peak, source = peak_tflops(None, torch.device("cuda"))
    assert peak == tflops and source.startswith(device_name)


@pytest.mark.parametrize("device_name", ["NVIDIA GH200 480GB", "NVIDIA H100 80GB HBM3e custom", "NVIDIA A10G"])
def test_an_unknown_accelerator_asks_for_its_peak_instead_of_guessing(monkeypatch, device_name):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    peak, source = peak_tflops(None, torch.device("cuda"))
    assert peak is None and f"unknown accelerator '{device_name}'" in source and "set metrics.peak_tflops" in source
    assert peak_tflops(500.0, torch.device("cuda")) == (500.0, "configured")


def test_a_cpu_has_mfu_only_against_the_peak_the_user_gives():
    assert peak_tflops(None, torch.device("cpu"))[0] is None
    assert peak_tflops(2.0, torch.device("cpu")) == (2.0, "configured for this CPU")
