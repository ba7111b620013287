"""Documents as text (the shipped corpus, local files, a hub dataset) and the loader that packs them.

Every data-parallel rank reads the same global stream of documents, tokenizes it, packs it into the same
global batches and keeps its own rows: exact at any data-parallel degree, and priced for small data (each
rank tokenizes every row of the global batch). Prepared token shards (``titan_core.data.tokens``) read
only a rank's own rows.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import torch
from huggingface_hub import constants as hf_constants

from titan_core.data.tokenizer import ASSETS
from titan_core.errors import ConfigError

DOCUMENTS_PER_CALL = 16
FORMATS = {".json": "json", ".jsonl": "json", ".gz": "json", ".parquet": "parquet", ".txt": "text",
           ".csv": "csv"}


def document_opener(config, section: str = "data") -> Callable[[], Iterable[str]]:
    """A function that opens the document stream of ``config`` (the ``data`` section, or ``validation``'s own
    documents) from the start, as a :class:`TextStream`.

    ``source``: ``builtin`` (the shipped corpus), ``local`` (``path``: a json/jsonl/parquet/text/csv file or
    a folder of them, read with HF ``datasets``) or ``hub`` (``path`` is a dataset name, streamed; needs
    network or a populated HF cache).
    """
    from datasets import load_dataset

    if config.source == "hub":
        def open_hub():
            return TextStream(load_dataset(config.path, name=config.get("name"), split=config.split, streaming=True),
                              config.text_field)
        return open_hub

    data_files = local_files(config, section)
    fmt = FORMATS[Path(data_files[0]).suffix]

    def open_local():
        return TextStream(load_dataset(fmt, data_files=data_files, split="train", streaming=True), config.text_field)
    return open_local


class TextStream:
    """The texts of a streamed ``datasets`` dataset, with its resumable position: ``load_state_dict`` skips
    whole files and, within a file, Arrow batches without decoding their rows."""

    def __init__(self, dataset, field: str):
        self.dataset, self.field = dataset, field

    def __iter__(self) -> Iterator[str]:
        return (row[self.field] for row in self.dataset)

    def state_dict(self) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached from here, or None (also in offline mode, where the datasets
    library reads its cache and fails fast by itself). Without this probe an unreachable Hub costs the library's
    network retries: 25 s before its error, measured."""
    offline = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    if hf_constants.HF_HUB_OFFLINE or any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
                                          for name in offline):
        return None
    endpoint = urlparse(hf_constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError as error:
        return f"{hf_constants.ENDPOINT} cannot be reached ({error.strerror or error})"
    return None


def check_hub(config, section: str) -> None:
    """One line within seconds when a hub source cannot be reached."""
    reason = hub_unreachable()
    if reason:
        raise ConfigError(f"{section}.path", f"the Hub dataset '{config.path}' cannot be opened: {reason}",
                          "check the network, or set HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 to read it from the local "
                          f"Hugging Face cache, or use {section}.source=local with {section}.path=<its folder>")


def check_documents(config, section: str = "data") -> None:
    """Fail before launch when the configured data has no document with text in its ``text_field``."""
    if config.source == "builtin":
        # Shipped non-empty; opening it here would cost every launch the import of `datasets`.
        return
    if config.source == "hub":
        check_hub(config, section)
    try:
        first = next((text for text in document_opener(config, section)() if text), None)
    except KeyError:
        raise ConfigError(f"{section}.text_field", f"the documents have no field '{config.text_field}'",
                          f"set {section}.text_field to the column that holds the text") from None
    except Exception as error:  # noqa: BLE001 - whatever datasets or the Hub client raises: one line
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if config.source != "hub":
            kind = FORMATS[Path(local_files(config, section)[0]).suffix]
            raise ConfigError(f"{section}.path", f"{config.path} cannot be read as {kind} documents ({reason})",
                              f"point {section}.path at UTF-8 text files (json, jsonl, parquet, txt, csv)") from None
        raise ConfigError(f"{section}.path", f"the Hub dataset '{config.path}' cannot be opened ({reason})",
                          "check its name and the network (HF_DATASETS_OFFLINE unset), or download it and "
                          f"use {section}.source=local with {section}.path=<its folder>") from None
    if first is None:
        raise ConfigError(f"{section}.path", f"{config.path} holds no non-empty document",
                          f"point {section}.path at files with text")


def local_files(config, section: str) -> list[str]:
    if config.source == "builtin":
        return [str(ASSETS / "corpus.jsonl.gz")]
    if config.source != "local":
        raise ConfigError(f"{section}.source", f"unknown source '{config.source}'",
                          "use builtin, local, hub, or tokens for prepared shards")
    field = f"{section}.path"
    if not config.path:
        raise ConfigError(field, f"is empty but {section}.source=local", f"set {field} to a file or folder")
    path = Path(config.path).expanduser()
    if not path.exists():
        raise ConfigError(field, f"{path} does not exist", f"point {field} at an existing file or folder")
    found = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file() and p.suffix in FORMATS)
    if not found:
        raise ConfigError(field, f"{path} holds no {'/'.join(sorted(FORMATS))} file",
                          f"point {field} at json, jsonl, parquet, text or csv files")
    if {FORMATS[p.suffix] for p in found} != {FORMATS[found[0].suffix]}:
        raise ConfigError(field, f"{path} mixes file formats", f"keep one format per {field}")
    if all(p.stat().st_size == 0 for p in found):
        raise ConfigError(field, f"{path} is empty", f"point {field} at files with text")
    return [str(p) for p in found]


def every_nth(n: int, held: bool) -> Callable[[int], bool]:
    """Whether the document at a stream position is among those at 0, n, 2n, ... (``held``) or the others: a
    split of the stream into two disjoint parts that any source supports, whatever order it is read in."""
    return lambda index: (index % n == 0) == held


class PackedLoader:
    """Global batches of ``seq_len``-token rows cut from the packed stream ``BOS doc EOS BOS doc EOS ...``.

    Yields this rank's ``(inputs, labels)``: rows ``dp_rank * local : (dp_rank + 1) * local`` of each
    global batch, labels being the inputs shifted by one token. ``keep`` picks documents by their position
    in the stream (validation's split). At the end of the documents it starts the next epoch.
    ``state_dict()`` holds the position in the stream; it does not depend on dp_size. A :class:`TextStream`
    resumes from its own saved position; any other iterable skips the documents already read.
    """

    def __init__(self, open_documents: Callable[[], Iterable[str]], tokenizer, seq_len: int,
                 global_batch_size: int, dp_rank: int, dp_size: int, keep: Callable[[int], bool] | None = None):
        self.open_documents = open_documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.rows = slice(dp_rank * global_batch_size // dp_size, (dp_rank + 1) * global_batch_size // dp_size)
        self.keep = keep
        self.epoch = 0
        self.documents_read = 0
        self.buffer: list[int] = []
        self._stream: Iterable[str] | None = None
        self._stream_state: dict | None = None
        self._documents: Iterator[str] | None = None

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        needed = self.global_batch_size * (self.seq_len + 1)
        while len(self.buffer) < needed:
            self.buffer.extend(self._next_documents())
        batch = torch.tensor(self.buffer[:needed], dtype=torch.long).view(self.global_batch_size, self.seq_len + 1)
        del self.buffer[:needed]
        mine = batch[self.rows]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def _next_documents(self) -> list[int]:
        """The packed tokens of the next few documents, tokenized in one call into the tokenizer."""
        texts = []
        for attempt in range(2):
            if self._documents is None:
                self._documents = self._open()
            for text in self._documents:
                index = self.documents_read
                self.documents_read += 1
                if text and (self.keep is None or self.keep(index)):
                    texts.append(text)
                    if len(texts) == DOCUMENTS_PER_CALL:
                        break
            if texts:
                break
            if attempt == 0 and self.documents_read > 0:
                self.epoch, self.documents_read, self._stream_state, self._documents = self.epoch + 1, 0, None, None
        if not texts:
            raise RuntimeError("the training data holds no non-empty document")
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        return [token for ids in self.tokenizer.encode_batch(texts) for token in (bos, *ids, eos)]

    def _open(self) -> Iterator[str]:
        self._stream = self.open_documents()
        if self._stream_state is not None and isinstance(self._stream, TextStream):
            self._stream.load_state_dict(self._stream_state)
            return iter(self._stream)
        return itertools.islice(iter(self._stream), self.documents_read, None)

    def state_dict(self) -> dict:
        stream = self._stream.state_dict() if isinstance(self._stream, TextStream) else self._stream_state
        return {"epoch": self.epoch, "documents_read": self.documents_read,
                "buffer": torch.tensor(self.buffer, dtype=torch.long),
                "stream": torch.frombuffer(bytearray(json.dumps(stream).encode()), dtype=torch.uint8)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.documents_read = int(state["documents_read"])
        self.buffer = [int(t) for t in state["buffer"]]
        self._stream_state = json.loads(bytes(state["stream"].tolist()).decode()) if "stream" in state else None
        self._stream, self._documents = None, None  # the old stream's position is not this one
