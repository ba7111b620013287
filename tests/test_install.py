"""The distributions as a user outside this checkout gets them: wheels of the core and of every plugin, built from
copies of their sources, installed (not editable) into a fresh virtual environment, and a run from another
directory using only what the wheels hold (the built-in tokenizer and corpus, the Hydra options, entry points)."""

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
NOT_SOURCE = shutil.ignore_patterns(".git", "*.egg-info", "__pycache__", "build", "tests", "multirun", "outputs")


def sources(into: Path) -> list[Path]:
    """Copies of the core's and every plugin's and example's source tree (a build writes into its tree)."""
    core = into / "core"
    core.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, core / name)
    shutil.copytree(ROOT / "titan_core", core / "titan_core", ignore=NOT_SOURCE)
    trees = [core]
    for project in sorted([*ROOT.glob("plugins/*/pyproject.toml"), *ROOT.glob("examples/*/pyproject.toml")]):
        trees.append(into / project.parent.name)
        shutil.copytree(project.parent, trees[-1], ignore=NOT_SOURCE)
    return trees


def requires(wheel: Path, extra: str) -> set[str]:
    """The distributions ``wheel``'s metadata brings with ``extra``."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    return {re.split(r"[ ;<>=\[]", line.split(": ", 1)[1])[0] for line in metadata.splitlines()
            if line.startswith("Requires-Dist:") and f'extra == "{extra}"' in line}


def test_wheels_install_outside_the_checkout_and_train(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels,
                    *sources(tmp_path / "src")], check=True, capture_output=True)
    built = {wheel.name.split("-")[0].replace("_", "-"): wheel for wheel in wheels.glob("*.whl")}
    plugins = {name for name in built if name != "titan-trainer" and not name.endswith("-example")}
    assert len(plugins) == len(list(ROOT.glob("plugins/*/pyproject.toml")))
    assert requires(built["titan-trainer"], "all") == plugins  # the extra that brings every first-party plugin

    # The environment sees torch and the other libraries of this machine; ours come from the wheels alone.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
                    *built.values()], check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run([python, "-c", "import titan_core, titan_fsdp, titan_checkpoint, titan_gpt2; "
                            "print(titan_core.__file__, titan_fsdp.__file__, titan_checkpoint.__file__, "
                            "titan_gpt2.__file__)"], cwd=elsewhere, check=True, capture_output=True, text=True)
    for module_file in where.stdout.split():
        assert Path(module_file).is_relative_to(venv), module_file

    run_dir = elsewhere / "run"
    subprocess.run([python, "-m", "titan_core.run", "model=tiny", "training.steps=2", "training.seq_len=32",
                    "metrics.tensorboard=false", "launch.device=cpu", "+plugins=[ac,checkpoint]",
                    f"hydra.run.dir={run_dir}"], cwd=elsewhere, check=True, capture_output=True, timeout=600)
    record = json.loads((run_dir / "run.json").read_text())
    assert {"titan-trainer", "titan-ac", "titan-checkpoint", "titan-llama3"} <= record["versions"].keys()
    assert (run_dir / "checkpoints" / "step-2" / ".metadata").exists()
