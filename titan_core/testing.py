"""The parity harness: prove a plugin set trains exactly like one process.

A run of a tiny Llama under some plugins on a local gloo world is compared with a single-process run
of the same model, init and global batches: loss at every step, and every parameter at the end. Both
runs go through the real command line (``python -m titan_core.run``), so the check covers planning,
launching and the training loop too.

It is a pytest plugin (entry point ``pytest11``), so a third-party plugin's tests get the fixtures by
installing titan-core::

    def test_my_plugin(titan_parity):
        report = titan_parity(["+plugins=[fsdp,myplugin]", "plugins.fsdp.degree=2"])
        assert report.max_loss_diff <= 1e-5
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

# A model and batch small enough that four processes run five steps in seconds on two cores.
TINY = ("model=tiny", "tokenizer.path=bytes", "training.seq_len=32", "training.global_batch_size=8",
        "training.steps=5", "optimizer.lr=1e-3", "optimizer.weight_decay=0.0", "lr_scheduler.warmup_steps=1",
        "metrics.log_every=1", "metrics.tensorboard=false", "metrics.peak_tflops=1", "testing.save_final_weights=true")


@dataclass
class JobResult:
    run_dir: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    def final_weights(self) -> dict:
        """Full parameters gathered by every rank, merged; ranks holding the same tensor must agree."""
        import torch

        merged: dict = {}
        for file in sorted((self.run_dir / "final_weights").glob("rank*.pt")):
            for name, tensor in torch.load(file, weights_only=True).items():
                if name in merged and not torch.equal(merged[name], tensor):
                    raise AssertionError(f"{file.name} disagrees with another rank on {name}")
                merged[name] = tensor
        if not merged:
            raise AssertionError(f"no final weights in {self.run_dir}; was testing.save_final_weights set?")
        return merged


def run_job(overrides, run_dir: Path, *, expect_success: bool = True, env: dict | None = None,
            timeout: float = 900) -> JobResult:
    """Run ``python -m titan_core.run`` with ``overrides`` writing into ``run_dir``."""
    command = [sys.executable, "-m", "titan_core.run", *overrides, f"hydra.run.dir={run_dir}"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                               env={**os.environ, **(env or {})})
    result = JobResult(Path(run_dir), completed.returncode, completed.stdout, completed.stderr)
    if expect_success and completed.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {completed.returncode}\n"
                             f"--- stdout\n{completed.stdout[-3000:]}\n--- stderr\n{completed.stderr[-5000:]}")
    return result


def error_line(result: JobResult) -> str:
    """The launcher's one-line error for bad input, checked to be its only error line and exit code 2."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("titan-core: error: ")]
    assert result.returncode == 2 and len(lines) == 1, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    return lines[0]


def install_plugins(site: Path, plugins: dict[str, tuple[str, str]], distribution: str = "test-plugins") -> dict:
    """Install throwaway plugins for a test: ``{name: (module_source, options_yaml)}`` as one distribution.

    Writes dist-info metadata with both entry points, one module per plugin and its option file into
    the folder ``site``; returns the environment that puts them on the path of a ``run_job``.
    """
    dist = site / f"{distribution.replace('-', '_')}-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.0.0\n")
    plugin_points, conf_points = ["[titan_core.plugins]"], ["[titan_core.conf]"]
    for name, (source, options) in plugins.items():
        module = f"{distribution.replace('-', '_')}_{name}"
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        conf = site / f"{module}_conf" / "plugins"
        conf.mkdir(parents=True)
        (conf.parent / "__init__.py").write_text("")
        (conf / f"{name}.yaml").write_text(f"{name}:\n  _plugin_: {name}\n{textwrap.indent(options, '  ')}")
        plugin_points.append(f"{name} = {module}")
        conf_points.append(f"{name} = {module}_conf")
    (dist / "entry_points.txt").write_text("\n".join(plugin_points + [""] + conf_points) + "\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


@dataclass
class ParityReport:
    losses: list[float]
    reference_losses: list[float]
    max_loss_diff: float
    max_param_diff: float
    worst_param: str

    def __str__(self) -> str:
        return (f"max loss diff {self.max_loss_diff:.2e} over {len(self.losses)} steps; "
                f"max param diff {self.max_param_diff:.2e} ({self.worst_param})")


def compare(result: JobResult, reference: JobResult) -> ParityReport:
    """Per-step loss and final-parameter differences of ``result`` against ``reference``."""
    if len(result.losses) != len(reference.losses) or not result.losses:
        raise AssertionError(f"{len(result.losses)} logged steps vs {len(reference.losses)} in the reference")
    loss_diff = max(abs(a - b) for a, b in zip(result.losses, reference.losses))
    weights, expected = result.final_weights(), reference.final_weights()
    if weights.keys() != expected.keys():
        raise AssertionError(f"parameter names differ: {sorted(weights.keys() ^ expected.keys())[:5]}")
    diffs = {name: (weights[name].float() - expected[name].float()).abs().max().item() for name in expected}
    worst = max(diffs, key=diffs.get)
    return ParityReport(result.losses, reference.losses, loss_diff, diffs[worst], worst)


@pytest.fixture(scope="session")
def titan_reference(tmp_path_factory):
    """``titan_reference(extra_overrides)`` -> the single-process tiny run, computed once per session."""
    cache: dict[tuple, JobResult] = {}

    def reference(extra=()) -> JobResult:
        key = tuple(extra)
        if key not in cache:
            cache[key] = run_job([*TINY, *key], tmp_path_factory.mktemp("reference"))
        return cache[key]
    return reference


@pytest.fixture
def titan_parity(titan_reference, tmp_path):
    """``titan_parity(overrides, reference_overrides=())`` runs the tiny model with ``overrides`` and
    returns its :class:`ParityReport` against the single-process reference."""

    def parity(overrides, reference_overrides=()) -> ParityReport:
        result = run_job([*TINY, *reference_overrides, *overrides], tmp_path / "run")
        report = compare(result, titan_reference(reference_overrides))
        print(f"parity {' '.join(overrides)}: {report}")
        return report
    return parity
