"""``python -m titan_core.planner --calibrate FILE.yaml [--hardware BASE] [overrides of the probe]``: this machine's
own profile, from a short run on its device.

The probe is a real one-process run (``python -m titan_core.run``, a few steps of a small job: the defaults of
``PROBES`` or the overrides given). The planner plans the same job on the base profile (``--hardware``, else
the device's own: its datasheet profile on a GPU, ``cpu-measured`` on the CPU), and the profile written keeps
every figure of the base but the share of the matmul peak a step reaches (``achievable``; on a card with float8,
``fp8_achievable`` moves by the same factor), chosen so that the plan of the probe takes the median time its
steps took. ``--hardware FILE.yaml`` then plans any job with it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from titan_core.errors import ConfigError
from titan_core.mesh import device_kind
from titan_core.planner.costs import planned_job
from titan_core.planner.estimate import Estimate
from titan_core.planner.hardware import Hardware, by_device_name, cpu_measured, hardware_profile

__all__ = ["PROBES", "calibrate"]

# A job whose steps the matmuls dominate on each kind of device, and which fits one of them.
PROBES = {
    "cpu": ("model=debug", "tokenizer.path=bytes", "training.seq_len=256", "training.global_batch_size=4"),
    "cuda": ("model=8B", "model.n_layers=2", "training.seq_len=4096", "training.global_batch_size=2",
             "training.compute_dtype=bfloat16"),
}
STEPS, WARMUP_STEPS = 8, 3  # the first steps pay for the allocator's growth and the caches' warm-up
MATMUL_SHARE = 0.5  # of the probe's step, at least, for its time to say how fast the matmuls run


def calibrate(out: Path, base_name: str | None, overrides: list[str]) -> str:
    """Run the probe, write the calibrated profile to ``out``; returns the line that says what was measured."""
    if out.suffix not in (".yaml", ".yml"):
        raise ConfigError("--calibrate", f"{out} is not a .yaml file", "give the path of the profile to write, e.g. "
                          "--calibrate mygpu.yaml")
    _check_writable(out)  # before the probe's minutes, not after
    kind = device_kind(None)
    base = _base_profile(base_name, kind)
    # The defaults, each replaced by an override of the same key.
    job = list({o.partition("=")[0]: o for o in [*PROBES[kind], *overrides]}.values())
    probe = [*job, "launch.world_size=1", f"launch.device={kind}"]
    _, planned = planned_job(probe, base)  # bad overrides are refused here, before anything runs
    seconds = planned.step_seconds()
    if seconds["matmul"] < MATMUL_SHARE * seconds["step"]:
        # A fit would put into the matmuls' speed what the host or the memory costs.
        raise ConfigError("--calibrate", f"the probe's matmuls are {seconds['matmul'] / seconds['step']:.0%} of its "
                          f"planned step on {base.name}, too little to measure their speed by",
                          "give the probe more tokens or a wider model (training.global_batch_size, "
                          "training.seq_len, model=)")
    measured = _median_step_seconds(probe)
    achievable = _fitted_share(planned, measured)
    scale = achievable / base.achievable
    calibrated = dataclasses.replace(base, name=f"calibrated-{base.name}", device_names="", achievable=achievable,
                                     fp8_achievable=base.fp8_achievable and base.fp8_achievable * scale)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(dataclasses.asdict(calibrated)), out)
    except OSError as error:  # a full disk, a read-only folder: the measurement is lost, say so in one line
        raise ConfigError("--calibrate", f"cannot write {out}: {error.strerror or error}",
                          "give a path in a writable folder with room") from None
    return (f"titan-core: the probe ({' '.join(job)}) took {measured:.4g} s a step on "
            f"{kind} (median after {WARMUP_STEPS} warm-up steps), planned {seconds['step']:.4g} s on "
            f"{base.name}; wrote {out} (achievable {base.achievable:.3g} -> {achievable:.3g}): plan with --hardware {out}")


def _check_writable(out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent):
            pass
    except OSError as error:  # a read-only or full disk, a file where the folder should be
        raise ConfigError("--calibrate", f"cannot write {out}: {error.strerror or error}",
                          "give a path in a writable folder with room") from None


def _base_profile(name: str | None, kind: str) -> Hardware:
    if name is not None:
        return hardware_profile(name)
    if kind == "cpu":
        return cpu_measured()
    device = torch.cuda.get_device_name()
    profile = by_device_name(device)
    if profile is None:
        raise ConfigError("--hardware", f"no profile for '{device}'", "give --hardware FILE.yaml with its "
                          "datasheet figures (docs/planner.md lists the fields); the calibration fits the rest")
    return profile


def _median_step_seconds(probe: list[str]) -> float:
    """The median step time of a real run of the probe, after its warm-up steps."""
    with tempfile.TemporaryDirectory(prefix="titan-calibrate-") as run_dir:
        done = subprocess.run([sys.executable, "-m", "titan_core.run", *probe, f"training.steps={STEPS}",
                               "metrics.log_every=1", "metrics.tensorboard=false", "validation.every=0",
                               f"hydra.run.dir={run_dir}"], capture_output=True, text=True)
        if done.returncode != 0:
            error = next((line for line in reversed(done.stderr.splitlines()) if line.startswith("titan-core:")),
                         f"exit code {done.returncode}")
            raise ConfigError("--calibrate", f"the probe run failed: {error.removeprefix('titan-core: ')}",
                              "fix the probe's overrides, or run it with python -m titan_core.run to see why")
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return statistics.median(json.loads(line)["step_time_s"] for line in lines[WARMUP_STEPS:])


def _fitted_share(planned: Estimate, measured: float) -> float:
    """The matmul share under which the plan of the probe takes ``measured`` seconds a step (bisection: the step
    shortens as the share grows)."""
    def step(share: float) -> float:
        hardware = dataclasses.replace(planned.hardware, achievable=share)
        return dataclasses.replace(planned, hardware=hardware).step_seconds()["step"]

    if step(1.0) > measured:
        raise ConfigError("--calibrate", f"a step of the probe took {measured:.4g} s, less than the plan's "
                          f"{step(1.0):.4g} s with its matmuls at {planned.hardware.name}'s full peak",
                          "give --hardware a profile with this device's real peak (bf16_tflops)")
    low, high = 1e-4, 1.0
    if step(low) < measured:
        raise ConfigError("--calibrate", f"a step of the probe took {measured:.4g} s, more than the plan gives it "
                          "even with its matmuls at a ten-thousandth of the peak: its time is not in its matmuls",
                          "give the probe more tokens (training.global_batch_size, training.seq_len)")
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) > measured else (low, middle)
    return (low + high) / 2
