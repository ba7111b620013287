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

A model plugin proves itself with the conformance kit, one line in its tests (see docs/writing-models.md)::

    test_my_model = model_conformance(["model=my_model_tiny"])
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from titan_core.data import load_tokenizer, tokenizer_file
from titan_core.errors import ConfigError
from titan_core.forked_jobs import ForkedJobs, fresh_interpreter
from titan_core.initialization import init_weights
from titan_core.launch.prepare import prepare
from titan_core.launch.cluster import job_nodes
from titan_core.job.command_line import check_command_line, composed
from titan_core.plugins import Registry

__all__ = ["TINY", "LOSS_TOL", "PARAM_TOL", "FLOAT8_LOSS_TOL", "FLOAT8_PARAM_TOL", "CONFORMANCE", "Case", "JobResult",
           "ParityReport", "built_model", "compare", "compose", "config_error", "error_line", "init_weights",
           "install_plugins", "merged", "model_conformance", "run_job", "titan_parity", "titan_reference",
           "write_hf_folder"]
# A model and batch small enough that four processes run five steps in seconds on two cores.
TINY = ("model=tiny", "tokenizer.path=bytes", "training.seq_len=32", "training.global_batch_size=8",
        "training.steps=5", "optimizer.lr=1e-3", "optimizer.weight_decay=0.0", "lr_scheduler.warmup_steps=1",
        "metrics.log_every=1", "metrics.tensorboard=false", "metrics.peak_tflops=1", "testing.save_final_weights=true",
        "launch.device=cpu")  # gloo on the CPU on any machine: the parity references are CPU runs


_FORKED_JOBS = ForkedJobs()


@dataclass
class JobResult:
    run_dir: Path
    returncode: int
    stdout: str
    stderr: str
    after_step: int = 0  # only the steps after this one count (a run seen from a checkpoint)

    @property
    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        logged = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [m for m in logged if m["step"] > self.after_step]

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    def final_weights(self) -> dict:
        """Full parameters gathered by every rank, merged; ranks holding the same tensor must agree."""
        merged: dict = {}
        for file in sorted((self.run_dir / "final_weights").glob("rank*.pt")):
            for name, tensor in torch.load(file, weights_only=True).items():
                if name in merged and not torch.equal(merged[name], tensor):
                    raise AssertionError(f"{file.name} disagrees with another rank on {name}")
                merged[name] = tensor
        if not merged:
            raise AssertionError(f"no final weights in {self.run_dir}; was testing.save_final_weights set?")
        return merged


def merged(*groups) -> list[str]:
    """The overrides of ``groups`` in order, a later ``key=value`` replacing an earlier one of the same key
    (Hydra refuses a key given twice, e.g. ``model=tiny`` from TINY and ``model=gpt2_tiny``)."""
    by_key: dict[str, str] = {}
    for override in (o for group in groups for o in group):
        key = override.split("=", 1)[0] if "=" in override and override[0] not in "+~" else override
        by_key.pop(key, None)
        by_key[key] = override
    return list(by_key.values())


def run_job(overrides, run_dir: Path, *, expect_success: bool = True, env: dict | None = None,
            timeout: float = 900) -> JobResult:
    """Run ``python -m titan_core.run`` with ``overrides`` writing into ``run_dir``: forked from an interpreter
    that has imported torch once (:mod:`titan_core.forked_jobs`), or its own with ``TITAN_FRESH_INTERPRETER=1``."""
    arguments = [*merged(overrides), f"hydra.run.dir={run_dir}"]
    command = [sys.executable, "-m", "titan_core.run", *arguments]
    environment = {**os.environ, **(env or {})}
    completed = (subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)
                 if fresh_interpreter() else _FORKED_JOBS.run(arguments, environment, timeout))
    result = JobResult(Path(run_dir), completed.returncode, completed.stdout, completed.stderr)
    if expect_success and completed.returncode != 0:
        # A worker's native crash is one line; its stacks are in the log the line names, gone with tmp_path.
        stacks = [line.rsplit(_CRASH_POINTER, 1)[1] for line in completed.stderr.splitlines()
                  if _CRASH_POINTER in line]
        raise AssertionError(f"{' '.join(command)} exited {completed.returncode}\n"
                             f"--- stdout\n{completed.stdout[-3000:]}\n--- stderr\n{_ends(completed.stderr)}"
                             + "".join(f"\n--- {log}\n{_crash_dump(Path(log))}" for log in stacks))
    return result


_CRASH_POINTER = "its stack is in "


def _crash_dump(log: Path) -> str:
    """The end of ``log`` from its last fatal error on: faulthandler's stacks of every thread, the newest thread's
    first, the one that crashed marked "Current thread"."""
    text = log.read_text()
    return _ends(text[text.rfind("Fatal Python error"):], 10000)


def _ends(text: str, each: int = 2500) -> str:
    """The first and last ``each`` characters of ``text``: a crash's cause is printed first, its stack after."""
    return text if len(text) <= 2 * each else f"{text[:each]}\n[...]\n{text[-each:]}"


def compose(*overrides: str):
    """The job config of ``overrides`` as the launcher composes it, in this process."""
    return composed(list(overrides), checked=False)


def built_model(*overrides: str, seed: int = 0) -> torch.nn.Module:
    """The model ``overrides`` select (``model=<preset>``, ``model.<option>=...``), built by its model plugin and
    initialized as a one-process run initializes it, on the CPU, in this process: ``built_model("model=tiny")(tokens)``
    gives its logits for ``tokens`` (batch, seq), a (batch, seq, vocabulary) tensor."""
    config = compose(*overrides)
    registry = Registry(config, model_only=True)
    description = registry.describe_model(config, load_tokenizer(config.tokenizer).vocab_size)
    with torch.device("meta"):
        model = registry.call(registry.model, "build_model", description=description)
    model.to_empty(device="cpu")
    init_weights(model, description, seed)
    return model


def transformers_folder(hf_config: dict, folder: Path) -> Path:
    """A Hugging Face folder whose config.json is ``hf_config`` word for word (keys it leaves out stay out), with the
    weights of transformers' model of it: norms in [0.5, 1.5], the rest N(0, 1/fan-in), from seed 0, so that logits
    keep one scale whatever width a left-out key gives."""
    transformers = pytest.importorskip("transformers")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config))
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.rand(param.shape, generator=generator) + 0.5 if "norm" in name
                        else torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(hf_config))  # save_pretrained wrote every key out
    return folder


def write_hf_folder(model: torch.nn.Module, folder: Path) -> Path:
    """Save a transformers model as a Hugging Face folder with the shipped tokenizer, after drawing its weights
    large enough that a misplaced one shows in the logits (transformers' own initialization leaves them near
    zero): norms in [0.5, 1.5], the rest N(0, 0.1), from seed 0."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = (torch.rand(param.shape, generator=generator) + 0.5 if "norm" in name
                      else torch.randn(param.shape, generator=generator) * 0.1)
            param.copy_(values)
    model.save_pretrained(folder)
    shipped = tokenizer_file(OmegaConf.create({"path": "builtin"}))
    assert shipped is not None  # "builtin" names a file; only "bytes" has none
    shutil.copyfile(shipped, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    return folder


def config_error(*overrides: str):
    """The ConfigError the launcher refuses ``overrides`` with, found its way in this process (no worker, no
    subprocess: a table of bad values costs milliseconds per row)."""
    with pytest.raises(ConfigError) as error:
        check_command_line(list(overrides))
        prepare(compose(*overrides), job_nodes())
    return error.value


def error_line(result: JobResult) -> str:
    """The launcher's one-line error for bad input, checked to be its only error line and exit code 2."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("titan-core: error: ")]
    assert result.returncode == 2 and len(lines) == 1, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    return lines[0]


def install_plugins(site: Path, plugins: dict[str, tuple[str, str]], distribution: str = "test-plugins",
                    models: dict[str, tuple[str, dict[str, str]]] | None = None,
                    plugin_objects: dict[str, str] | None = None, costs: dict[str, str] | None = None) -> dict:
    """Install throwaway plugins for a test: ``{name: (module_source, options_yaml)}`` as one distribution,
    and model plugins ``{name: (module_source, {preset: preset_yaml})}`` beside them. ``plugin_objects`` names,
    for a plugin or model, the class (or factory) in its module that the entry point names instead of the module;
    ``costs`` gives a plugin's or model's pricing module (``{name: module_source}``, group ``titan_core.costs``).

    Writes dist-info metadata with the entry points, one module per plugin and its option or preset files
    into the folder ``site``; returns the environment that puts them on the path of a ``run_job``.
    """
    package = distribution.replace("-", "_")
    dist = site / f"{package}-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.0.0\n")
    points: dict[str, list[str]] = {"titan_core.plugins": [], "titan_core.models": [], "titan_core.conf": [],
                                    "titan_core.costs": []}
    configs = {name: (source, "plugins", {name: f"{name}:\n  _plugin_: {name}\n{textwrap.indent(options, '  ')}"})
               for name, (source, options) in plugins.items()}
    configs |= {name: (source, "model", presets) for name, (source, presets) in (models or {}).items()}
    for name, (source, group, files) in configs.items():
        module = f"{package}_{name}"
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        conf = site / f"{module}_conf" / group
        conf.mkdir(parents=True)
        (conf.parent / "__init__.py").write_text("")
        for file, body in files.items():
            (conf / f"{file}.yaml").write_text(textwrap.dedent(body))
        target = f"{module}:{plugin_objects[name]}" if plugin_objects and name in plugin_objects else module
        points["titan_core.plugins" if group == "plugins" else "titan_core.models"].append(f"{name} = {target}")
        points["titan_core.conf"].append(f"{name} = {module}_conf")
    for name, source in (costs or {}).items():
        (site / f"{package}_{name}_costs.py").write_text(textwrap.dedent(source))
        points["titan_core.costs"].append(f"{name} = {package}_{name}_costs")
    (dist / "entry_points.txt").write_text("".join(f"[{group}]\n" + "".join(f"{line}\n" for line in lines) + "\n"
                                                   for group, lines in points.items() if lines))
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


@dataclass
class ParityReport:
    losses: list[float]
    reference_losses: list[float]
    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    stderr: str  # what the run showed the user besides its progress: empty for a run that went right

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
    worst = max(diffs, key=lambda name: diffs[name])
    return ParityReport(result.losses, reference.losses, loss_diff, diffs[worst], worst, result.stderr)


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


# ----------------------------------------------------------------------------------------------------------------
# The model conformance kit: every first-party plugin against the model's own single-process run.

LOSS_TOL = 1e-5
# An Adam step moves each weight by about lr (1e-3 in TINY) whatever its gradient's size, so a wrong gradient
# shows as ~1e-3 in the weights; 1e-4 is 10x below that and far above fp32 reduction-order noise.
PARAM_TOL = 1e-4
# Float8 matmuls round every operand to 3 mantissa bits. Measured over 5 steps of the tiny models: losses
# 8.7e-4 (GPT-2), 3.4e-3 (Qwen3), weights <= 5.9e-3. A wrong scale or a dropped cast moves the loss by > 0.1.
FLOAT8_LOSS_TOL, FLOAT8_PARAM_TOL = 1e-2, 3e-2
CHECKPOINT_STEP = 3


@dataclass(frozen=True)
class Case:
    overrides: tuple[str, ...]
    loss_tol: float = LOSS_TOL
    param_tol: float = PARAM_TOL
    must_differ: bool = False  # float8: an exact match would mean nothing was converted


CONFORMANCE = {
    "fsdp2": Case(("+plugins=[fsdp]", "plugins.fsdp.degree=2")),
    "tp2-sp-lossparallel": Case(("+plugins=[tp]", "plugins.tp.degree=2", "plugins.tp.sequence_parallel=true",
                                 "plugins.tp.loss_parallel=true")),
    "cp2": Case(("+plugins=[cp]", "plugins.cp.degree=2")),
    "pp2-gpipe": Case(("+plugins=[pp]", "plugins.pp.degree=2", "plugins.pp.schedule=GPipe")),
    "pp2-interleaved1f1b": Case(("+plugins=[pp]", "plugins.pp.degree=2", "plugins.pp.schedule=Interleaved1F1B")),
    "ac-full": Case(("+plugins=[ac]", "plugins.ac.mode=full")),
    "ac-selective-op": Case(("+plugins=[ac]", "plugins.ac.mode=selective_op")),
    "compile": Case(("+plugins=[compile]",)),
    "chunked-loss-tp2": Case(("+plugins=[tp,chunked_loss]", "plugins.tp.degree=2",
                              "plugins.chunked_loss.chunk_tokens=40")),
    "float8": Case(("+plugins=[float8]",), FLOAT8_LOSS_TOL, FLOAT8_PARAM_TOL, must_differ=True),
    # Saved under fsdp 2 after step 3, resumed in one process: the last steps must continue the reference.
    "checkpoint-fsdp2-to-one": Case(("+plugins=[fsdp,checkpoint]", "plugins.fsdp.degree=2",
                                     f"plugins.checkpoint.interval={CHECKPOINT_STEP}")),
}


def model_conformance(model_overrides, cases=None):
    """A pytest test running the conformance matrix on the model that ``model_overrides`` select.

    Assign it in a test module: ``test_my_model = model_conformance(["model=my_model_tiny"])``. Each case
    trains the tiny job under one plugin stack and compares every step's loss and the final weights with
    the same model in one process; ``cases`` picks a subset of :data:`CONFORMANCE` by name.
    """
    chosen = {name: CONFORMANCE[name] for name in (cases or CONFORMANCE)}

    @pytest.mark.slow
    @pytest.mark.parametrize("case", list(chosen))
    def test_model_conformance(case, titan_reference, tmp_path):
        spec, reference = chosen[case], titan_reference(tuple(model_overrides))
        result = run_job([*TINY, *model_overrides, *spec.overrides], tmp_path / "run")
        if case.startswith("checkpoint"):
            saved = tmp_path / "run" / "checkpoints" / f"step-{CHECKPOINT_STEP}"
            result = run_job([*TINY, *model_overrides, "+plugins=[checkpoint]",
                              f"plugins.checkpoint.load_path={saved}"], tmp_path / "resumed")
            steps = [m["step"] for m in result.metrics]
            assert steps == list(range(CHECKPOINT_STEP + 1, len(reference.losses) + 1)), steps
            reference = dataclasses.replace(reference, after_step=CHECKPOINT_STEP)
        report = compare(result, reference)
        print(f"conformance {' '.join(model_overrides)} {case}: {report}")
        assert report.max_loss_diff <= spec.loss_tol, report
        assert report.max_param_diff <= spec.param_tol, report
        if spec.must_differ:
            assert report.max_loss_diff > 0, "bit-identical to fp32: nothing was converted"
        if case == "compile":  # the compile plugin logs dynamo's counters
            assert result.metrics[-1].get("compiled_graphs", 0) >= 1, "nothing was compiled"
    return test_model_conformance

