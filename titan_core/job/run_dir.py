"""Where a run writes: the same folder for every rank of a world, and for every restart of it."""

from __future__ import annotations

import os
from datetime import datetime


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def default_run_dir() -> str:
    """Where a run writes. Every torchrun rank must agree, so it derives from the rendezvous there."""
    if under_torchrun():
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        if run_id == "none":  # torchrun without --rdzv-id
            run_id = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
        return f"outputs/torchrun-{run_id}"
    return datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")
