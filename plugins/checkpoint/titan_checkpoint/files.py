"""Saves that become visible only complete, and what a process killed while saving leaves put right.

Every folder is written under ``<name>.partial`` and renamed once finished; a folder it replaces (the
same step saved again) is first renamed ``<name>.replaced`` and removed only after; an old checkpoint
is renamed ``<name>.removed`` before it is deleted, so that a half-deleted one never looks complete.
At start, :func:`recover` settles each leftover whatever step of the swap the process died at.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger("titan_core")
PARTIAL, REPLACED, REMOVED = ".partial", ".replaced", ".removed"


def finished(folder: Path) -> bool:
    """Whether a save's folder holds its last-written file: DCP's ``.metadata``, or an HF ``config.json``."""
    return (folder / ".metadata").is_file() or (folder / "config.json").is_file()


def partial_of(folder: Path) -> Path:
    return folder.with_name(folder.name + PARTIAL)


def swap_in(partial: Path, complete: Path) -> None:
    """Make the finished folder ``partial`` visible as ``complete``; the one it replaces goes only after."""
    replaced = complete.with_name(complete.name + REPLACED)
    if complete.exists():
        complete.rename(replaced)
    partial.rename(complete)
    shutil.rmtree(replaced, ignore_errors=True)


def remove(folder: Path) -> None:
    """Delete a complete checkpoint so that no moment shows it complete with files missing."""
    doomed = folder.with_name(folder.name + REMOVED)
    folder.rename(doomed)
    shutil.rmtree(doomed)


def recover(folder: Path) -> None:
    """Settle what saves interrupted in ``folder`` left: a finished save is published (unless its name is
    taken), the folder it was replacing comes back if it was not finished, the rest is deleted."""
    for leftover in sorted(folder.glob(f"*{REPLACED}")):
        complete = leftover.with_name(leftover.name.removesuffix(REPLACED))
        if not complete.exists() and not finished(partial_of(complete)):
            leftover.rename(complete)
            log.warning("restored %s: the save replacing it did not finish", complete)
        else:
            shutil.rmtree(leftover)
    for leftover in sorted(folder.glob(f"*{PARTIAL}")):
        complete = leftover.with_name(leftover.name.removesuffix(PARTIAL))
        if finished(leftover) and not complete.exists():
            leftover.rename(complete)
            log.warning("published %s: its save finished but was not renamed", complete)
        else:
            log.info("removing %s, an incomplete save of an earlier attempt", leftover)
            shutil.rmtree(leftover)
    for leftover in folder.glob(f"*{REMOVED}"):
        shutil.rmtree(leftover)


def save_file(tensors: dict, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary name: the file appears whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + PARTIAL)
    torch.save(tensors, partial)
    os.replace(partial, path)
