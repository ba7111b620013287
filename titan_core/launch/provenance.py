"""``run.json``: what a run was, so that it can be told apart from others and repeated.

Rank 0 writes it into the run dir before training: the command line's overrides, the versions of Python,
torch and every distribution taking part (the core, the enabled plugins, the model's), the git commit of
the working directory when it is a checkout, the host and the world's layout. ``config.yaml`` beside it
holds the whole resolved config; ``python -m titan_core.compare`` reads both.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from titan_core.plan import Plan
from titan_core.discovery import installed_models


def distributions(plan: Plan, model_name: str) -> list[str]:
    """The distributions whose code runs in this job, the core's first."""
    names = ["titan-trainer", *(p.distribution for p in plan.plugins)]
    model = installed_models().get(model_name)
    if model is not None and model.dist is not None:
        names.append(model.dist.name)
    return list(dict.fromkeys(names))


def _version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:  # imported from a source tree without being installed
        return "not installed"


def git_state(directory: Path) -> dict | None:
    """The commit checked out in ``directory`` and whether files differ from it; None outside a checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
        return None


def write_run_record(run_dir: Path, overrides: list[str], plan: Plan, model_name: str, nodes: int) -> dict:
    """Write ``run.json`` into ``run_dir`` and return what it holds."""
    record = {
        "overrides": list(overrides),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     **{name: _version(name) for name in distributions(plan, model_name)}},
        "git": git_state(Path.cwd()),
        "host": socket.gethostname(),
        "world": {"size": plan.world_size, "nodes": int(os.environ.get("GROUP_WORLD_SIZE", nodes)),  # torchrun's
                  "mesh": dict(plan.mesh_shape), "plugins": plan.names, "model": plan.model.family},
    }
    (run_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def read_run_record(run_dir: Path) -> dict:
    """What ``run.json`` in ``run_dir`` holds; empty when the launcher wrote none (a worker started alone)."""
    record = run_dir / "run.json"
    return json.loads(record.read_text()) if record.exists() else {}
