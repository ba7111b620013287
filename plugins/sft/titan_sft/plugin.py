"""Chat fine-tuning data: a ``messages`` dataset rendered with the tokenizer's chat template, trained on the
assistant's replies only.

The rows come from :mod:`titan_sft.rows` (whole conversations packed, or padded), the tokens and the reply
marks from :mod:`titan_sft.chat`. Every other label is ``titan_core.IGNORE_INDEX``; the core normalises the loss
by the trained tokens of the whole step, so every plan trains like one process however unevenly replies fall
on ranks and micro-batches. Conversations that cannot be trained on (no assistant turn, an unknown role,
longer than a row, a template that fails on them) are found before launch: counted and left out, or refused.
"""

from __future__ import annotations

import json

from pathlib import Path

import datasets
from datasets import load_dataset

from titan_core import (ConfigError, Declaration, find_chat_template, hookimpl, load_tokenizer, text_or_null,
                        tokenizer_file)
from titan_sft.chat import ChatRenderer
from titan_sft.rows import ChatRows

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
BAD_ROWS = ("skip", "stop")
datasets.disable_progress_bars()  # a bar per file read, every run and every rank: nothing to act on


class SftPlugin:
    """The ``sft`` plugin: the training and validation batches of a chat dataset."""

    def __init__(self):
        self.source: tuple | None = None  # this run's renderer and dataset, once a worker has read them

    @hookimpl
    def declare(self):
        """sft: name and split choose among a hub dataset's, and mean nothing for local files."""
        hub = ("plugins.sft.path=<a hub dataset>",
               lambda options, config: options.path is not None and not Path(options.path).expanduser().exists())
        return Declaration(acts_only={"name": hub, "split": hub})

    @hookimpl
    def validate(self, config, plugin_config):
        """sft: the dataset, its template and its rows, before any worker starts."""
        if plugin_config.path is None:
            raise ConfigError("plugins.sft.path", "is not set", "name a jsonl/json/parquet file of conversations, a "
                              "folder of them, or a hub dataset")
        for option in ("name", "chat_template", "split", "messages_field"):
            text_or_null(plugin_config[option], f"plugins.sft.{option}")
        if plugin_config.bad_rows not in BAD_ROWS:
            raise ConfigError("plugins.sft.bad_rows", f"unknown policy '{plugin_config.bad_rows}'",
                              f"use one of {', '.join(BAD_ROWS)}")
        if not isinstance(plugin_config.holdout_every, int) or plugin_config.holdout_every < 0 or \
                plugin_config.holdout_every == 1:
            raise ConfigError("plugins.sft.holdout_every", f"{plugin_config.holdout_every!r} is not 0 or an integer "
                              "above 1", "hold out every Nth conversation for validation, e.g. 20, or 0 for none")
        if plugin_config.packing and config.training.attention_mask != "block_causal":
            raise ConfigError("plugins.sft.packing", "packed conversations would attend to each other under "
                              f"training.attention_mask={config.training.attention_mask}",
                              "set training.attention_mask=block_causal, or plugins.sft.packing=false")
        if config.validation.every and not plugin_config.holdout_every:
            raise ConfigError("validation.every", "plugins.sft holds out no conversations to validate on",
                              "set plugins.sft.holdout_every (e.g. 20), or validation.every=0")
        renderer = _renderer(config, plugin_config, load_tokenizer(config.tokenizer).bos_id)
        rows, cut = _rows(plugin_config)
        if plugin_config.messages_field not in rows.column_names:
            raise ConfigError("plugins.sft.messages_field", f"'{plugin_config.messages_field}' is not a column of "
                              f"{plugin_config.path} (its columns: {', '.join(rows.column_names)})",
                              "name the column holding each conversation's messages")
        examples = (renderer.example(rows[index][plugin_config.messages_field]) for index in range(len(rows)))
        problems = [(index, example) for index, example in enumerate(examples) if example.problem]
        if problems and plugin_config.bad_rows == "stop":
            index, example = problems[0]
            raise ConfigError("plugins.sft.path", f"conversation {index} cannot be trained on: {example.problem} "
                              f"({len(problems)} of {len(rows)} cannot)",
                              "fix or drop those rows, or set plugins.sft.bad_rows=skip")
        every, bad = plugin_config.holdout_every, {index for index, _ in problems}
        held = sum(1 for index in range(len(rows)) if held_out(index, every) and index not in bad)
        if config.validation.every and held < config.training.global_batch_size:
            raise ConfigError("plugins.sft.holdout_every", f"holds out {held} usable conversations, fewer than the "
                              f"{config.training.global_batch_size} rows of a batch", "hold out more (a smaller N)")
        if len(rows) - len(problems) < config.training.global_batch_size:
            raise ConfigError("plugins.sft.path", f"{len(rows) - len(problems)} usable conversations, fewer than the "
                              f"{config.training.global_batch_size} rows of a batch", "add conversations, or lower "
                              "training.global_batch_size")
        if problems or cut:
            kinds: dict[str, list[int]] = {}
            for index, example in problems:
                kinds.setdefault(str(example.kind), []).append(index)  # every problem has its kind
            print(f"titan-sft: {len(problems) + len(cut)} of {len(rows) + len(cut)} conversations left out: " + "; ".join(
                [f"{len(indices)} {kind} (e.g. row {indices[0]})" for kind, indices in kinds.items()]
                + ([f"{len(cut)} cut short (e.g. {cut[0]})"] if cut else [])), flush=True)

    @hookimpl
    def build_dataloader(self, config, tokenizer, dp_rank, dp_size, plugin_config):
        """sft: this rank's rows of packed (or padded) conversations, the replies alone trained on."""
        every = plugin_config.holdout_every
        return self._chat_rows(config, plugin_config, tokenizer, dp_rank, dp_size,
                               lambda index: not held_out(index, every))

    @hookimpl
    def build_validation_batches(self, config, tokenizer, dp_rank, dp_size, plugin_config):
        """sft: this rank's rows of ``validation.batches`` global batches of the held-out conversations."""
        every = plugin_config.holdout_every
        rows = self._chat_rows(config, plugin_config, tokenizer, dp_rank, dp_size, lambda index: held_out(index, every))
        return [next(rows) for _ in range(config.validation.batches)]

    def _chat_rows(self, config, plugin_config, tokenizer, dp_rank, dp_size, keep) -> ChatRows:
        if self.source is None:  # read once per run for the training and the validation rows
            self.source = (_renderer(config, plugin_config, tokenizer.bos_id), _rows(plugin_config)[0])
        renderer, dataset = self.source
        field = plugin_config.messages_field
        local = config.training.global_batch_size // dp_size
        return ChatRows(lambda index: renderer.example(dataset[index][field]),
                        [index for index in range(len(dataset)) if keep(index)], config.training.global_batch_size,
                        range(dp_rank * local, (dp_rank + 1) * local), config.training.seq_len, tokenizer.eos_id,
                        plugin_config.packing)


def held_out(index: int, every: int) -> bool:
    """Whether conversation ``index`` is validation's: every ``every``-th (none when 0)."""
    return bool(every) and index % every == every - 1


def _rows(plugin_config) -> tuple[datasets.Dataset, list[str]]:
    """The dataset's rows (local files read with ``datasets``, else the hub dataset's split), and the lines left out
    of jsonl files cut short (``bad_rows=skip``; ``stop`` refuses them)."""
    path = Path(plugin_config.path).expanduser()
    if not path.exists():
        try:
            return load_dataset(plugin_config.path, name=plugin_config.name, split=plugin_config.split), []
        except Exception as error:  # offline, unknown name or split: datasets' many kinds of error
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConfigError("plugins.sft.path", f"not a local file or folder, nor a readable hub dataset ({reason})",
                              "point it at a jsonl/json/parquet file or folder, or a hub dataset in the cache") from None
    files = sorted(str(f) for f in path.iterdir() if f.suffix in FORMATS) if path.is_dir() else [str(path)]
    formats = {FORMATS.get(Path(f).suffix) for f in files}
    if not files or len(formats) != 1 or None in formats:
        raise ConfigError("plugins.sft.path", f"{path} holds no conversations in one format",
                          f"use {', '.join(FORMATS)} files, all of one format")
    cut = {file: line for file in files if file.endswith(".jsonl") and (line := cut_last_line(Path(file)))}
    if cut and plugin_config.bad_rows == "stop":
        file, line = next(iter(cut.items()))
        raise ConfigError("plugins.sft.path", f"{file} line {line} is not whole JSON (the file was cut short?)",
                          "copy the file again, remove the line, or set plugins.sft.bad_rows=skip to train without it")
    try:
        kind = formats.pop()
        if not cut:
            return load_dataset(kind, data_files=files, split="train"), []
        # Each file on its own, in order, so that the rows keep their indices: the cut ones without their last line.
        parts = [whole_lines(file) if file in cut else load_dataset(kind, data_files=[file], split="train")
                 for file in files]
        return datasets.concatenate_datasets(parts), [f"{file} line {line}" for file, line in cut.items()]
    except Exception as error:  # datasets' parse errors, of many kinds: one line naming the files
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        raise ConfigError("plugins.sft.path", f"{path} cannot be read as conversations ({reason})",
                          "fix or remove the damaged file") from None


def cut_last_line(file: Path) -> int | None:
    """The number of a jsonl file's last line if it is not whole JSON (a copy cut short), else None (read from the end
    only, and through the whole file only to count its lines once it is cut)."""
    with open(file, "rb") as opened:
        size = opened.seek(0, 2)
        opened.seek(max(0, size - (1 << 20)))
        tail = opened.read().rstrip(b"\n").rsplit(b"\n", 1)
    if not tail[-1].strip():
        return None
    try:
        json.loads(tail[-1])
    except ValueError:
        with open(file, "rb") as opened:
            return sum(1 for _ in opened)
    return None


def whole_lines(file: str) -> datasets.Dataset:
    """A jsonl file cut in its last line, as rows of its whole lines."""
    with open(file, encoding="utf-8") as opened:
        lines = opened.read().splitlines()[:-1]
    return datasets.Dataset.from_list([json.loads(line) for line in lines if line.strip()])


def _renderer(config, plugin_config, bos_id: int) -> ChatRenderer:
    tokenizer_json = tokenizer_file(config.tokenizer)
    if tokenizer_json is None:
        raise ConfigError("tokenizer.path", "the byte-level tokenizer has no chat template",
                          "use a Hugging Face tokenizer (model=hf takes the folder's)")
    template, source = find_chat_template(tokenizer_json, plugin_config.chat_template, "plugins.sft.chat_template")
    return ChatRenderer(tokenizer_json, template, config.tokenizer.bos_token, config.tokenizer.eos_token, bos_id,
                        config.training.seq_len + 1, source)
