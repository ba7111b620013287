"""Where a run writes: the same folder for every rank of a world, for every restart of it, and for the same command
run again, so that running it again resumes it."""

from __future__ import annotations

import hashlib
import os
import re

READABLE = 48  # characters of the overrides kept in the folder's name, before their hash


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def default_run_dir(overrides: str = "") -> str:
    """Where a run writes: ``outputs/`` and a name made of the job's overrides (Hydra's ``override_dirname``, less
    the keys that leave a run the same run: conf/config.yaml's ``exclude_keys``), readable and hashed;
    ``outputs/default`` without any. Every torchrun rank must agree, so there it derives from the rendezvous."""
    if under_torchrun():
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        if run_id == "none":  # torchrun without --rdzv-id
            run_id = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
        return f"outputs/torchrun-{run_id}"
    if not overrides:
        return "outputs/default"
    readable = re.sub(r"[^A-Za-z0-9._=+-]+", "_", overrides)[:READABLE].strip("_")
    return f"outputs/{readable}-{hashlib.sha1(overrides.encode()).hexdigest()[:8]}"
