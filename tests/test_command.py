"""``titan <command>``: one console script for every command, the core's and the plugins' (entry points of
``titan_core.commands``), each as its ``python -m`` form runs it."""

import subprocess
import sys
from pathlib import Path

from titan_core.testing import TINY, merged

TITAN = str(Path(sys.executable).with_name("titan"))  # the console script pip installed beside this interpreter


def titan(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([TITAN, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_titan_lists_the_cores_commands_and_the_plugins_each_saying_what_it_does():
    listed = titan("--help")
    assert listed.returncode == 0 and listed.stdout.startswith("titan: train, plan and compare")
    lines = {line.split()[0]: line for line in listed.stdout.splitlines() if line.startswith("  ")}
    assert {"run", "plan", "compare", "prepare", "generate", "merge"} <= lines.keys()
    assert "Train: compose the config" in lines["run"] and "Merge a PEFT LoRA adapter" in lines["merge"]
    assert titan("run", "--help").stdout.startswith("titan run (or python -m titan_core.run): train a model")
    unknown = titan("trian")
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
        "titan: error: unknown command 'trian'; fix: use one of compare, generate, merge, plan, prepare, run "
        "(titan --help)"]


def test_titan_plan_and_titan_run_are_their_python_m_forms(tmp_path):
    job = ["--hardware", "a100", "model=tiny", "tokenizer.path=bytes", "training.seq_len=64", "launch.world_size=1"]
    planned = titan("plan", *job)
    module = subprocess.run([sys.executable, "-m", "titan_core.planner", *job], capture_output=True, text=True,
                            timeout=300)
    assert planned.returncode == 0 and planned.stdout == module.stdout
    trained = titan("run", *merged(TINY, ["training.steps=2", f"hydra.run.dir={tmp_path / 'run'}"]))
    assert trained.returncode == 0, trained.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
