"""What every replica group must run alike, compared across the groups at each quorum.

A group started with another learning rate, batch, seed, model or plan would otherwise average its gradients into
the others' every step and train one wrong model without a word. Each group hashes each part of its job (the config
sections that make what trains, its plan, its plugins' options) and the groups sum a table of those digests, a row
per group, over the cross-group collective they already share: every group then reads every participating group's
row. A group whose part differs from what most groups run (group 0's on a tie) stops with one line naming the part;
the others train on, as they do when a group dies.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed import ReduceOp
from torchft import Manager

from titan_core import ConfigError, Plan

log = logging.getLogger("titan_core")
# The config sections that make what trains (metrics, launch, validation, testing and hydra may differ by group).
SECTIONS = ("model", "training", "optimizer", "lr_scheduler", "data", "tokenizer")
PARTS = (*SECTIONS, "plan", "plugins")  # a fixed layout: the groups' tables line up whatever their jobs hold
LABELS = {**{section: f"{section} options" for section in SECTIONS}, "plan": "plan (its plugins in order, its mesh)",
          "plugins": "plugin options"}
# What names a group rather than the training: its index, how it reaches the lighthouse, what it lets differ.
GROUP_OWN = ("plugins.ft.replica_group", "plugins.ft.lighthouse", "plugins.ft.may_differ")
DIGEST_BITS = 52  # a digest is summed with zeros only, so any integer a float64 holds exactly survives


def check_paths(config: DictConfig, paths: Any) -> None:
    """``plugins.ft.may_differ`` names options of this job (a section, a plugin or one option), none of the plan."""
    if not isinstance(paths, (list, tuple)) and not OmegaConf.is_list(paths):
        raise ConfigError("plugins.ft.may_differ", f"{paths!r} is not a list", "list option paths, e.g. [plugins.mlflow]")
    for path in paths:
        if not isinstance(path, str) or not _present(config, path):
            raise ConfigError("plugins.ft.may_differ", f"{path!r} is not an option of this job",
                              "name options as the command line does, e.g. plugins.mlflow or data.path")


def _present(config: DictConfig, path: str) -> bool:
    parent, _, key = path.rpartition(".")
    node = OmegaConf.select(config, parent, default=None) if parent else config
    return isinstance(node, DictConfig) and key in node


def shared_parts(config: DictConfig, plan: Plan, may_differ: list[str]) -> dict[str, str]:
    """Each part the groups must share, as canonical text (the paths in ``may_differ`` and the group's own left out)."""
    container = OmegaConf.to_container(config, resolve=True)
    for path in (*GROUP_OWN, *may_differ):
        *parents, key = path.split(".")
        node = container
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(key, None)
    values = {section: container.get(section) for section in SECTIONS}
    values["plan"] = {"plugins": plan.names, "mesh": dict(plan.mesh_shape)}
    values["plugins"] = container.get("plugins")
    return {part: json.dumps(values[part], sort_keys=True, default=str) for part in PARTS}


def digests(parts: dict[str, str]) -> list[int]:
    """Each part's digest: a nonzero integer below 2**DIGEST_BITS (zero is a row no group filled)."""
    return [int.from_bytes(hashlib.sha256(parts[part].encode()).digest()[:8], "big") % (1 << DIGEST_BITS) | 1
            for part in PARTS]


def check_agreement(manager: Manager, own: list[int], group: int, count: int, warned: set) -> None:
    """Sum every group's digests over the quorum (one all-reduce of ``count`` x 8 numbers) and stop this group, in
    one line, if a part of it differs from what most groups run. A step whose all-reduce failed checks nothing."""
    table = torch.zeros(count, len(PARTS), dtype=torch.float64)
    table[group] = torch.tensor(own, dtype=torch.float64)
    manager.allreduce(table.view(-1), reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None or not manager.is_participating():
        return  # a failed sum may hold anything; a group not yet counted sent zeros
    rows = {index: [int(value) for value in row.tolist()] for index, row in enumerate(table) if row.any()}
    for column, part in enumerate(PARTS):
        runs: dict[int, list[int]] = {}
        for index, row in rows.items():
            runs.setdefault(row[column], []).append(index)
        common = max(runs.values(), key=lambda groups: (len(groups), -groups[0]))
        if group not in common:
            raise ConfigError(part, f"replica group {group} runs other {LABELS[part]} than group {common[0]} "
                              f"({len(common)} of {len(rows)} groups run those)",
                              "start every group with the same options but plugins.ft.replica_group (list an option "
                              "that does not change what trains in plugins.ft.may_differ)")
        for index in sorted(set(rows) - set(common) - warned):
            warned.add(index)
            log.warning("ft: replica group %d runs other %s than this group: it stops", index, LABELS[part])
