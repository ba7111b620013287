"""Saves that become visible only complete, damaged ones caught, and what a killed save left put right.

Every folder is written under ``<name>.partial`` and renamed once finished; a folder it replaces (the
same step saved again) is first renamed ``<name>.replaced`` and removed only after; a folder to delete is
renamed ``<name>.removed-<id>`` at once and deleted on a background thread (a checkpoint at scale is
thousands of files, minutes of deleting that must not hold up a step or a load), so that a half-deleted
one never looks complete. At start, :func:`recover` settles each leftover whatever step of the swap the
process died at.

Each rank records the size and CRC-32 of the files it wrote into a checkpoint (``checksums/rank<r>.json``,
before the folder is renamed); before loading, each rank checks the files of the saving ranks r with
r = its rank modulo the world, so the reading is spread and no rank's share grows with the world.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger("titan_core")
PARTIAL, REPLACED, REMOVED = ".partial", ".replaced", ".removed"
CHECKSUMS = "checksums"
CHUNK = 1 << 24


def finished(folder: Path) -> bool:
    """Whether a save's folder holds its last-written file: DCP's ``.metadata``, or an HF ``config.json``."""
    return (folder / ".metadata").is_file() or (folder / "config.json").is_file()


def partial_of(folder: Path) -> Path:
    return folder.with_name(folder.name + PARTIAL)


def swap_in(partial: Path, complete: Path, deletions: Deletions) -> None:
    """Make the finished folder ``partial`` visible as ``complete``; the one it replaces goes only after."""
    replaced = complete.with_name(complete.name + REPLACED)
    if complete.exists():
        complete.rename(replaced)
    partial.rename(complete)
    if replaced.exists():
        deletions.delete(replaced)


class Deletions:
    """Folders deleted on a background thread of a run's own; the run waits for them before it ends."""

    def __init__(self):
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-checkpoint-delete")
        self.under_way: list[Future] = []

    def delete(self, folder: Path) -> None:
        """Rename ``folder`` out of every listing now and delete it on the deleting thread."""
        doomed = folder.with_name(f"{folder.name}{REMOVED}-{uuid.uuid4().hex[:8]}")
        folder.rename(doomed)
        self.later(doomed)

    def later(self, folder: Path) -> None:
        self._settle(waiting=False)  # the list holds the deletions under way only, however long the run
        self.under_way.append(self.executor.submit(shutil.rmtree, folder))

    def done(self) -> None:
        """Wait for the deletions under way; one that failed is a warning (its leftover goes at the next start)."""
        self._settle(waiting=True)

    def close(self) -> None:
        self.done()
        self.executor.shutdown()

    def _settle(self, waiting: bool) -> None:
        for deletion in [d for d in self.under_way if waiting or d.done()]:
            self.under_way.remove(deletion)
            if deletion.exception() is not None:
                log.warning("could not delete an old checkpoint: %s", deletion.exception())


def recover(folder: Path, deletions: Deletions) -> None:
    """Settle what saves interrupted in ``folder`` left: a finished save is published (unless its name is
    taken), the folder it was replacing comes back if it was not finished, the rest is deleted."""
    for leftover in sorted(folder.glob(f"*{REPLACED}")):
        complete = leftover.with_name(leftover.name.removesuffix(REPLACED))
        if not complete.exists() and not finished(partial_of(complete)):
            leftover.rename(complete)
            log.warning("restored %s: the save replacing it did not finish", complete)
        else:
            deletions.delete(leftover)
    for leftover in sorted(folder.glob(f"*{PARTIAL}")):
        complete = leftover.with_name(leftover.name.removesuffix(PARTIAL))
        if finished(leftover) and not complete.exists():
            leftover.rename(complete)
            log.warning("published %s: its save finished but was not renamed", complete)
        else:
            log.info("removing %s, an incomplete save of an earlier attempt", leftover)
            deletions.delete(leftover)
    for leftover in folder.glob(f"*{REMOVED}*"):  # a deletion the process died in the middle of
        deletions.later(leftover)


def save_file(tensors: dict, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary name: the file appears whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + PARTIAL)
    torch.save(tensors, partial)
    os.replace(partial, path)


def crc32(path: Path) -> int:
    value = 0
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def record_checksums(folder: Path, rank: int) -> None:
    """Write the size and CRC-32 of every file rank ``rank`` wrote into the DCP folder ``folder``."""
    written = {path.name: [path.stat().st_size, crc32(path)] for path in sorted(folder.glob(f"__{rank}_*"))}
    (folder / CHECKSUMS).mkdir(exist_ok=True)
    target = folder / CHECKSUMS / f"rank{rank}.json"
    target.with_name(target.name + PARTIAL).write_text(json.dumps(written))
    os.replace(target.with_name(target.name + PARTIAL), target)


def damaged_files(folder: Path, rank: int, world: int) -> list[str]:
    """This rank's share of the check of ``folder``: its missing, truncated or altered files, as
    "<file>: <what>" (none for a checkpoint saved without checksums)."""
    damaged = []
    for record in sorted((folder / CHECKSUMS).glob("rank*.json")):
        if int(record.stem.removeprefix("rank")) % world != rank:
            continue
        for name, (size, checksum) in json.loads(record.read_text()).items():
            path = folder / name
            if not path.is_file():
                damaged.append(f"{path}: missing")
            elif path.stat().st_size != size:
                damaged.append(f"{path}: {path.stat().st_size} bytes instead of {size} (truncated)")
            elif crc32(path) != checksum:
                damaged.append(f"{path}: contents differ from when it was saved (checksum)")
    return damaged
