"""Device choice: the suite pins gloo on the CPU on any machine, a job never puts two ranks on one GPU, and the
GPU-only paths run where CUDA exists (skipped with their reason elsewhere, listed by ``-ra``)."""

import importlib.util

import pytest
import torch
from omegaconf import OmegaConf

from titan_core.errors import ConfigError
from titan_core.mesh import device_for_rank
from titan_core.launch.prepare import check_devices
from titan_core.testing import TINY

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, this machine has {GPUS}")


@pytest.fixture
def four_gpu_machine(monkeypatch):
    """torch's view of a machine with 4 GPUs; selecting one is recorded, not done."""
    selected = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    return selected


def launch(**fields):
    return OmegaConf.create({"device": None, "backend": None, **fields})


def test_the_suite_pins_the_cpu():
    assert "launch.device=cpu" in TINY


def test_cpu_stays_the_cpu_on_a_gpu_machine(four_gpu_machine):
    assert device_for_rank(3, "cpu") == torch.device("cpu") and four_gpu_machine == []
    assert device_for_rank(3, None) == torch.device("cuda", 3) and four_gpu_machine == [3]


def test_more_local_ranks_than_gpus_is_refused_before_launch(four_gpu_machine):
    with pytest.raises(ConfigError, match=r"^launch\.world_size: 8 ranks on this machine but 4 GPU\(s\)"):
        check_devices(launch(), local_ranks=8)
    check_devices(launch(), local_ranks=4)
    check_devices(launch(device="cpu"), local_ranks=8)


def test_under_torchrun_the_ranks_of_this_node_count(four_gpu_machine, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match=r"6 ranks on this machine"):
        check_devices(launch(), local_ranks=48)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_devices(launch(), local_ranks=48)


@pytest.mark.parametrize("fields, message", [
    (dict(device="tpu"), "launch.device: unknown device 'tpu'"),
    (dict(device="cpu", backend="nccl"), "launch.backend: nccl needs CUDA devices"),
])
def test_impossible_devices_are_refused(fields, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        check_devices(launch(**fields), local_ranks=1)


@pytest.mark.skipif(GPUS > 0, reason="checks the refusal of cuda on a machine without it")
def test_cuda_asked_for_on_a_machine_without_it():
    with pytest.raises(ConfigError, match=r"^launch\.device: this machine has no CUDA device"):
        check_devices(launch(device="cuda"), local_ranks=1)


def test_a_fill_degree_counts_gpus_only_when_the_job_uses_them(four_gpu_machine):
    from titan_core.launch.cluster import job_nodes
    from titan_core.launch.prepare import prepare
    from titan_core.testing import compose, config_error

    base = ("model=tiny", "tokenizer.path=bytes", "training.seq_len=32", "+plugins=[fsdp]")
    assert prepare(compose(*base), job_nodes()).world_size == 4
    assert "-1 needs a world size" in str(config_error(*base, "launch.device=cpu"))


# The GPU paths, on CUDA only. Both runs of a parity check use the GPU; the tolerance allows for other
# reduction orders of cuBLAS and NCCL, still 10x below what a wrong gradient shows (1e-3 in the weights).
ON_GPUS = ("launch.device=cuda",)


@TWO_GPUS
def test_fsdp_on_two_gpus_trains_like_one(titan_parity):
    report = titan_parity(["+plugins=[fsdp]", "plugins.fsdp.degree=2"], reference_overrides=ON_GPUS)
    assert report.max_loss_diff <= 1e-4 and report.max_param_diff <= 1e-4, report


@TWO_GPUS
def test_async_tp_on_two_gpus_trains_like_one(titan_parity):
    report = titan_parity(["+plugins=[tp,compile]", "plugins.tp.degree=2", "plugins.tp.async_tp=true"],
                          reference_overrides=ON_GPUS)
    assert report.max_loss_diff <= 1e-4 and report.max_param_diff <= 1e-4, report


@pytest.mark.skipif(not (GPUS and importlib.util.find_spec("triton") and torch.cuda.get_device_capability() >= (10, 0)),
                    reason="MXFP8 needs a Blackwell GPU (compute capability 10.0) and triton")
def test_mxfp8_on_a_gpu_trains_close_to_fp32(titan_parity):
    report = titan_parity(["+plugins=[float8]", "plugins.float8.recipe=mxfp8_rceil"], reference_overrides=ON_GPUS)
    assert 0 < report.max_loss_diff <= 1e-2, report


def test_sharded_parameters_compute_in_bf16_on_gpus_and_fp32_on_the_cpu_by_default():
    from titan_core.options import compute_dtype

    assert compute_dtype(None, "plugins.fsdp.param_dtype", "cuda") == torch.bfloat16
    assert compute_dtype(None, "plugins.fsdp.param_dtype", "cpu") == torch.float32
    assert compute_dtype("float32", "plugins.fsdp.param_dtype", "cuda") == torch.float32


def test_a_multi_node_gpu_job_gets_every_gpu_of_every_node(four_gpu_machine):
    from titan_core.launch.cluster import Nodes, allocated_world_size

    assert allocated_world_size(Nodes(3, 0, "gpu07:20000", "x"), None) == 12
    assert allocated_world_size(Nodes(3, 0, "gpu07:20000", "x"), "cpu") is None  # the degrees set a CPU world
    assert allocated_world_size(Nodes(1, 0, "127.0.0.1:0", "x"), None) is None  # one machine: the degrees do
