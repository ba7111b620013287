"""The plan command (python -m titan_core.planner) and its inputs: hardware profiles (files, calibration, a GPU
planned from a machine without one), bad input refused in one line naming the field, the report of what the
allocator reserves, the dry run's estimate."""

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from titan_core.errors import ConfigError
from titan_core.planner.cli import job_estimate
from titan_core.planner.costs import report
from titan_core.planner.estimate import evaluated
from titan_core.planner.hardware import hardware_profile
from titan_core.testing import compose

# What the planner's tests share, loaded by path as tracked_rank.py is (tests/ is not on the path).
spec = importlib.util.spec_from_file_location("planner_cases", Path(__file__).with_name("planner_cases.py"))
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
SMALL, _estimate, _printed_bytes = cases.SMALL, cases._estimate, cases._printed_bytes
_plan_command = cases._plan_command


@pytest.mark.parametrize("args, field, words", [
    (["--hardware", "tpu9"], "--hardware", "unknown hardware 'tpu9'"),
    (["--hardware", "a100", "+plugins=[fsdp,float8]", "launch.world_size=2"], "plugins.float8", "no float8 matmuls"),
    (["+plugins=[fsdp,tp]", "plugins.tp.degree=4", "launch.world_size=6"], "plugins.fsdp.degree",
     "not divisible by the other degrees"),
    (["--recommend-me"], "--recommend-me", "is not an option of the plan command"),
    (["training.global_batch_size=3", "launch.world_size=2", "+plugins=[fsdp]"], "training.global_batch_size",
     "do not split over 2"),
    (["--expert-load", "0.8", "model=qwen3_moe_tiny"], "--expert-load", "is not a number of 1 or more"),
    (["--expert-load=lots", "model=qwen3_moe_tiny"], "--expert-load", "is not a number of 1 or more"),
    (["--expert-load", "inf", "model=qwen3_moe_tiny"], "--expert-load", "is not a number of 1 or more"),
    (["--expert-load", "1.3"], "--expert-load", "has no experts to route unevenly"),
    (["--expert-load", "1.3", "--calibrate", "mine.yaml"], "--expert-load", "which --calibrate does not"),
    (["--expert-load-peak", "0", "model=qwen3_moe_tiny"], "--expert-load-peak", "is not a number of 1 or more"),
    (["--expert-load", "1.4", "--expert-load-peak", "1.2", "model=qwen3_moe_tiny"], "--expert-load-peak",
     "1.2 is below --expert-load 1.4"),
    (["--expert-load-peak", "1.3"], "--expert-load-peak", "has no experts to route unevenly"),
    (["--expert-load-peak=1.3", "--calibrate", "mine.yaml"], "--expert-load-peak", "which --calibrate does not"),
])
def test_bad_input_is_one_line_naming_the_field(args, field, words):
    with pytest.raises(ConfigError) as error:
        job_estimate([*args[:2], *SMALL, *args[2:]] if args[0] == "--hardware" else [*SMALL, *args])
    assert error.value.field == field and words in str(error.value)


@pytest.mark.parametrize("args, words", [
    (["--calibrate", "mine.txt"], "is not a .yaml file"),
    (["--calibrate", "mine.yaml", "--recommend"], "cannot be given with --recommend"),
    (["--calibrate", "mine.yaml", "model=tiny", "training.seq_len=64"], "too little to measure"),  # the host dominates
    (["--calibrate"], "needs a value"),
    (["--calibrate", "a-file/mine.yaml"], "cannot write a-file/mine.yaml"),  # checked first, not after the probe
])
def test_a_calibration_that_cannot_measure_is_refused_before_the_probe_runs(args, words, tmp_path, monkeypatch):
    from titan_core.planner import calibrate
    from titan_core.planner.cli import plan_costs

    monkeypatch.setattr(calibrate, "_median_step_seconds", lambda probe: pytest.fail("the probe ran"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")  # a file where the profile's folder should be
    with pytest.raises(ConfigError) as error:
        plan_costs(args)
    assert error.value.field == "--calibrate" and words in str(error.value)
    assert not (tmp_path / "mine.yaml").exists()


@pytest.mark.slow
def test_calibration_writes_the_profile_under_which_the_probe_takes_the_time_it_took(tmp_path):
    """A real run of the default CPU probe; the profile written, read back by --hardware, plans the probe at the
    median step time the run measured (what the share of the matmul peak was fitted to)."""
    from titan_core.planner.calibrate import PROBES

    out = tmp_path / "here.yaml"
    done = _plan_command("--calibrate", str(out))
    assert done.returncode == 0, done.stderr
    measured = float(done.stdout.split(" took ")[1].split(" s a step")[0])
    profile = hardware_profile(str(out))
    assert profile.name == "calibrated-cpu-measured" and profile.device_type == "cpu" and 0 < profile.achievable <= 1
    _, planned = job_estimate(["--hardware", str(out), *PROBES["cpu"], "launch.world_size=1", "launch.device=cpu"])
    assert planned.step_seconds()["step"] == pytest.approx(measured, rel=1e-3)


def test_an_optimizer_the_planner_cannot_step_is_named_in_one_line():
    from titan_core.planner.facts import optimizer_facts

    def refusing(model_parts, config):
        raise RuntimeError("wants DTensor parameters\nand a long traceback")

    with pytest.raises(ConfigError) as error:
        optimizer_facts(refusing, compose(*SMALL))
    assert error.value.field == "optimizer" and "failed there: wants DTensor parameters" in str(error.value)
    assert "traceback" not in str(error.value)


def test_the_command_exits_2_with_one_line():
    done = _plan_command("--hardware", "tpu9", *SMALL)
    lines = [line for line in done.stderr.splitlines() if line.startswith("titan-core: error: ")]
    assert done.returncode == 2 and lines == [lines[0]] and "--hardware" in lines[0], done.stderr


def test_a_hardware_file_is_a_profile(tmp_path):
    path = tmp_path / "mygpu.yaml"
    path.write_text("bf16_tflops: 500\nfp8_tflops: 1000\nmemory_gib: 40\ndevices_per_node: 4\n")
    profile = hardware_profile(str(path))
    assert (profile.name, profile.bf16_tflops, profile.memory_gib, profile.devices_per_node) == ("mygpu", 500, 40, 4)
    path.write_text("bf16_tflops: 500\nflops: 3\n")
    with pytest.raises(ConfigError, match="flops"):
        hardware_profile(str(path))
    path.write_text("bf16_tflops: 500\ndevice_type: cpu\ncores: 0\n")
    with pytest.raises(ConfigError, match="cores is 0; fix: set cores to a positive number"):
        hardware_profile(str(path))


def test_a_gpu_job_is_checked_for_the_gpu_from_a_machine_without_one():
    """Planned for an H100 from this CPU machine, a job with no compute dtype set computes in bfloat16, as it will
    there: LoRA's bfloat16 base, which needs bfloat16 compute, is accepted (it was refused: the check read this
    machine's float32), and planned 4 bytes a frozen weight lighter, printed with its sign and unit; on a CPU
    profile the same job is still refused, in one line naming the field."""
    job = [*SMALL, "+plugins=[lora]", "plugins.lora.base_dtype=bfloat16"]
    _, result = job_estimate(["--hardware", "h100", *job])
    assert result.compute_dtype == torch.bfloat16
    line = next(line for line in report(result).splitlines() if "frozen linears held in bfloat16" in line)
    assert re.search(r" -\d+\.\d\d (KiB|MiB|GiB) ", line), line
    with pytest.raises(ConfigError, match="a bfloat16 base needs bfloat16 compute") as refused:
        job_estimate(["--hardware", "cpu-measured", *job])
    assert refused.value.field == "plugins.lora.base_dtype"


@pytest.mark.parametrize("option, refusal", [
    (("+plugins=[tp,compile]", "launch.world_size=2", "plugins.tp.degree=2", "plugins.tp.async_tp=true"),
     "AsyncTP needs CUDA GPUs"),
    (("+plugins=[float8]", "plugins.float8.recipe=mxfp8_rceil"), "needs a CUDA device with triton"),
    (("+plugins=[compile]", "plugins.compile.mode=reduce-overhead"), "captures CUDA graphs"),
], ids=["async-tp", "mxfp8", "cuda-graphs"])
def test_gpu_only_options_are_planned_for_a_gpu_from_a_machine_without_one(option, refusal):
    """AsyncTP, MXFP8's triton kernels and CUDA graphs are refused on the CPU, and were refused when planned for
    a GPU from a CPU machine, so TorchTitan's AsyncTP jobs were planned without it; for an H100 they are planned
    (AsyncTP then hides half of tp's collective time behind its matmuls: tp.ASYNC_TP_HIDDEN; MXFP8 for a B200, its
    block-scaled matmuls being Blackwell's), for this CPU still refused in one line."""
    from titan_tp.costs import ASYNC_TP_HIDDEN

    card = "b200" if "plugins.float8.recipe=mxfp8_rceil" in option else "h100"
    _, planned = job_estimate(["--hardware", card, *SMALL, *option])
    if "async_tp" in str(option):
        waited, hidden = (c for c in planned.collectives if c.plugin == "tp")
        assert (waited.overlapped, hidden.overlapped) == (False, True) and hidden.calls == 0
        assert evaluated(hidden.bytes, planned) == pytest.approx(
            evaluated(waited.bytes, planned) * ASYNC_TP_HIDDEN / (1 - ASYNC_TP_HIDDEN))
    with pytest.raises(ConfigError, match=refusal):
        job_estimate(["--hardware", "cpu-measured", *SMALL, *option])


def test_the_estimate_prints_what_the_allocator_reserves_and_why():
    """On a GPU the report adds to the allocated peak what the caching allocator keeps then, each term named by
    its plugin (fsdp's streams, the core's eager loss); "fits" stays judged on what is allocated. A CPU's
    allocator returns what is freed: nothing is added."""
    *_, sharded = _estimate("launch.world_size=2", "+plugins=[fsdp]", "plugins.fsdp.degree=2",
                            "plugins.fsdp.param_dtype=bfloat16")
    gpu = dataclasses.replace(sharded, device_type="cuda")
    allocated, text = sum(gpu.memory().values()), report(gpu)
    cached = {what: evaluated(nbytes, gpu) for _, what, nbytes, _, when in gpu.memory_terms if when == "cached"}
    assert len(cached) == 3 and all(nbytes > 0 for nbytes in cached.values())
    assert gpu.reserved() == pytest.approx(allocated + sum(cached.values()))
    assert _printed_bytes(text, "reserved by the caching allocator at that peak:") == pytest.approx(
        gpu.reserved(), abs=0.006 * 2**20)
    assert _printed_bytes(text, "memory per rank (the most loaded), at its peak:") == pytest.approx(
        allocated, abs=0.006 * 2**20)
    assert "fsdp: the reduce-scatters' stream" in text and "core: the logits' room" in text
    # A GPU's memory band measures what published runs give, the reserved figure, and is printed beside it.
    band = [line for line in text.splitlines() if "[expected error:" in line]
    assert [line.split(":")[0].strip() for line in band] == ["reserved by the caching allocator at that peak",
                                                              "throughput"]
    assert sharded.reserved() == sum(sharded.memory().values()) and "reserved by" not in report(sharded)


def test_the_dry_run_prints_the_estimate_for_this_machine(tmp_path):
    from titan_core.testing import TINY, run_job

    result = run_job([*TINY, "launch.dry_run=true", "+plugins=[fsdp]", "plugins.fsdp.degree=2"], tmp_path / "run")
    estimate_lines = result.stdout.split("titan-core estimate: ")[1].splitlines()
    assert estimate_lines[0].startswith("llama3, world 2 (dp_shard 2), cpu-measured")
    assert any("fsdp: gathered blocks and a reduce-scatter" in line for line in estimate_lines)
    assert any(line.strip().startswith("throughput:") and "tokens/s/device" in line for line in estimate_lines)
    # The band of the profile measured on the spot: its tokens/s as printed, not relative to one process.
    assert "10 plans' step times, docs/planner.md): memory mean 1%, worst -3%; tokens/s mean 67%, worst +129%" in \
        result.stdout
