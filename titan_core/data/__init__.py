"""Training data: where documents or tokens come from, how each rank gets its rows, and the checks before launch.

    tokenizer.py  the byte-level tokenizer and Hugging Face tokenizer.json files
    chat.py       a tokenizer folder's chat template, and a conversation rendered with it
    text.py       documents as text (shipped corpus, local files, hub), packed by every rank: small data
    tokens.py     prepared token shards: each rank reads only its rows; mixtures, shuffling, O(1) resume
    prepare.py    ``python -m titan_core.data.prepare``: text to token shards, once
    prefetch.py   the next batches made on a background thread while the step runs

Whatever the source, the global batches are those of one process and the position in the data does not
depend on the data-parallel degree: a sharded run trains on exactly one process's batches, and resumes
at another degree.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf

from titan_core.data.chat import find_chat_template, render_chat
from titan_core.data.prefetch import Prefetcher
from titan_core.data.text import PackedLoader, check_documents, document_opener, every_nth
from titan_core.data.tokenizer import (load_tokenizer, shared_tokenizer, special_tokens, tokenizer_file,
                                       tokenizer_identity)
from titan_core.data.tokens import Samples, TokenLoader, TokenShards, check_prepared
from titan_core.errors import ConfigError

log = logging.getLogger("titan_core")
DAMAGED = ("stop", "skip")  # what a run does with prepared tokens that are not what prepare wrote

__all__ = ["Prefetcher", "check_data", "check_documents", "document_opener", "every_nth", "find_chat_template",
           "load_tokenizer", "reads_text", "render_chat", "shared_tokenizer", "special_tokens", "tokenizer_file",
           "training_loader", "validation_batches"]


def holds_out(config) -> bool:
    """Whether validation takes its data out of the training data (rather than reading its own)."""
    return config.validation.every > 0 and config.validation.source is None


def reads_text(config) -> bool:
    """Whether the job reads documents as text (training data, or validation's own), not only prepared tokens."""
    validation = config.validation
    return config.data.source != "tokens" or (bool(validation.every) and validation.source not in (None, "tokens"))


def token_sources(section) -> list[tuple[str, str, float]]:
    """``(name, folder, weight)`` of each prepared source of a section: its ``mixture``, or its ``path``."""
    mixture = section.get("mixture") or []
    if not mixture:
        return [(Path(section.path).name, section.path, 1.0)]
    return [(entry.get("name") or Path(entry["path"]).name, entry["path"], float(entry["weight"])) for entry in mixture]


def token_loader(config, section, field: str, dp_rank: int, dp_size: int, *, holdout_every: int = 0,
                 held: bool = False, seed: int | None = None) -> TokenLoader:
    """A loader of ``section``'s prepared sources (``field`` names them in errors)."""
    sources, training = token_sources(section), config.training
    return TokenLoader([Samples(TokenShards(path, field), training.seq_len + 1, holdout_every, held, seed)
                        for _, path, _ in sources], [name for name, _, _ in sources],
                       [weight for _, _, weight in sources], training.global_batch_size, dp_rank, dp_size,
                       skip_damaged=config.data.damaged == "skip")


def training_loader(config, tokenizer, dp_rank: int, dp_size: int):
    """This rank's training batches from ``config.data``, less what validation holds out of them."""
    training, data = config.training, config.data
    every = config.validation.holdout_every if holds_out(config) else 0
    if data.source == "tokens":
        loader = token_loader(config, data, "data.path", dp_rank, dp_size, holdout_every=every,
                              seed=training.seed if data.shuffle else None)
        for line in loader.describe(training.steps):
            log.info(line)
        return loader
    return PackedLoader(document_opener(data), tokenizer, training.seq_len, training.global_batch_size,
                        dp_rank, dp_size, every_nth(every, held=False) if every else None)


def validation_batches(config, tokenizer, dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the ``validation.batches`` global batches every evaluation uses (none when off):
    validation's own source, or what it holds out of the training source, read by the same loaders."""
    training, validation = config.training, config.validation
    if not validation.every:
        return []
    name, every = ("data", validation.holdout_every) if holds_out(config) else ("validation", 0)
    section = config[name]
    loader: TokenLoader | PackedLoader
    if section.source == "tokens":
        loader = token_loader(config, section, f"{name}.path", dp_rank, dp_size, holdout_every=every, held=True)
    else:
        loader = PackedLoader(document_opener(section, name), tokenizer, training.seq_len,
                              training.global_batch_size, dp_rank, dp_size, every_nth(every, held=True) if every else None)
    return [next(loader) for _ in range(validation.batches)]


def check_data(config) -> None:
    """Fail in one line, before any worker starts, when the training or validation data cannot be read as
    configured (see docs/data.md)."""
    data = config.data
    if data.damaged not in DAMAGED:
        raise ConfigError("data.damaged", f"unknown policy '{data.damaged}'", f"use one of {', '.join(DAMAGED)}")
    if data.source != "tokens":
        # Only token shards are checksummed: on documents, skipping damaged data would do nothing.
        for option, value in (("mixture", data.mixture), ("shuffle", data.shuffle), ("damaged", data.damaged == "skip")):
            if value:
                raise ConfigError(f"data.{option}", f"needs data.source=tokens (data.source is {data.source})",
                                  "prepare the data once with python -m titan_core.data.prepare and train with "
                                  "data.source=tokens")
        check_documents(data)
    else:
        check_tokens(data, "data", config)
    validation = config.validation
    if validation.source not in (None, "local", "hub", "tokens"):
        raise ConfigError("validation.source", f"unknown source '{validation.source}'",
                          "use local, hub or tokens for data of its own, or null to hold some out of the training data")
    if validation.every and validation.source == "tokens":
        check_tokens(validation, "validation", config)
    elif validation.every and validation.source is not None:
        check_documents(validation, "validation")


def check_tokens(section, name: str, config) -> None:
    """The prepared folders of a tokens source: finished, whole, made with the run's tokenizer, each with a
    sample for training (and for validation, where it holds some out), and the mixture's weights."""
    identity = tokenizer_identity(config.tokenizer)
    mixture = OmegaConf.to_container(section.mixture) if section.get("mixture") else []
    if not mixture and not section.path:
        raise ConfigError(f"{name}.path", f"is empty but {name}.source=tokens",
                          f"set {name}.path to a folder python -m titan_core.data.prepare wrote (or list "
                          f"{name}.mixture)")
    if mixture and section.path:
        raise ConfigError(f"{name}.path", f"is set together with {name}.mixture",
                          f"list every source in {name}.mixture and set {name}.path=null")
    for index, entry in enumerate(mixture):
        field = f"{name}.mixture[{index}]"
        if not isinstance(entry, dict) or set(entry) - {"path", "weight", "name"} or "path" not in entry:
            raise ConfigError(field, f"{entry!r} is not {{path: <folder>, weight: <share>}}",
                              "write each source as {path: <prepared folder>, weight: <share>}")
        weight = entry.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise ConfigError(f"{field}.weight", f"{weight!r} is not a positive number",
                              "give each source a weight > 0 (the shares are the weights over their sum)")
    names = [source_name for source_name, _, _ in token_sources(section)]
    if len(set(names)) < len(names):
        raise ConfigError(f"{name}.mixture", f"two sources have the same name ({', '.join(names)})",
                          "name them: {path: ..., weight: ..., name: <unique>}")
    length = config.training.seq_len + 1
    every = config.validation.holdout_every if name == "data" and holds_out(config) else 0
    for index, (_, path, _) in enumerate(token_sources(section)):
        field = f"{name}.mixture[{index}].path" if mixture else f"{name}.path"
        tokens = check_prepared(path, field, identity)
        if tokens // length < (2 if every else 1):
            raise ConfigError(field, f"{path} holds {tokens} tokens, too few for "
                              f"{'a training and a validation sample' if every else 'one sample'} of {length}",
                              "prepare more data, or lower training.seq_len")
