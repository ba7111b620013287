"""Tokenizers, documents and the packed loader of training batches.

Every data-parallel rank reads the same global stream of documents, packs it into the same global
batches and keeps its own rows. The loader's position is therefore a property of the stream, not of
the data-parallel degree: a checkpoint taken at one degree resumes at another without skipping or
repeating a sample, and a sharded run sees exactly the batches of a single process. The price is that
every rank tokenizes every document, which is small next to a training step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from importlib.resources import files
from pathlib import Path

import torch

from titan_core.errors import ConfigError

ASSETS = files("titan_core") / "assets"
FORMATS = {".json": "json", ".jsonl": "json", ".gz": "json", ".parquet": "parquet", ".txt": "text",
           ".csv": "csv"}


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus begin/end of text: needs no file. 264 entries (a multiple of 8)."""

    vocab_size = 264
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    def __init__(self, path: Path, bos_token: str, eos_token: str, text: str | None = None):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path)) if text is None else Tokenizer.from_str(text)
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.bos_id = self._special_id(bos_token, "bos_token")
        self.eos_id = self._special_id(eos_token, "eos_token")

    def _special_id(self, token: str, field: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ConfigError(f"tokenizer.{field}", f"'{token}' is not in the tokenizer's vocabulary",
                              f"set tokenizer.{field} to the tokenizer's own special token")
        return token_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids))


def tokenizer_file(config) -> Path | None:
    """The tokenizer.json that ``tokenizer.path`` names, or None for the byte-level tokenizer."""
    if config.path == "bytes":
        return None
    file = Path(str(ASSETS / "tokenizer.json")) if config.path == "builtin" else Path(config.path).expanduser()
    return file / "tokenizer.json" if file.is_dir() else file


def load_tokenizer(config) -> ByteTokenizer | FileTokenizer:
    """``tokenizer.path``: ``builtin`` (shipped, 2048 entries), ``bytes``, or a tokenizer.json / its folder."""
    file = tokenizer_file(config)
    if file is None:
        return ByteTokenizer()
    try:
        return FileTokenizer(file, config.bos_token, config.eos_token)
    except ConfigError:
        raise
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError("tokenizer.path", f"cannot read a tokenizer from {file} ({reason})",
                          "point it at a Hugging Face tokenizer.json (or its folder), or use builtin or bytes") from None


def shared_tokenizer(config) -> ByteTokenizer | FileTokenizer:
    """The tokenizer of ``config`` (``tokenizer``) in a running world: rank 0 reads the file and the others
    get its text from it, so a job reads it once however many ranks it has (the launcher checked it)."""
    import torch.distributed as dist

    file = tokenizer_file(config)
    if file is None:
        return ByteTokenizer()
    text = [file.read_text() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(text, src=0)
    return FileTokenizer(file, config.bos_token, config.eos_token, text=text[0])


def document_opener(config, section: str = "data") -> Callable[[], Iterable[str]]:
    """A function that opens the document stream of ``config`` (the ``data`` section, or ``validation``'s own
    documents) from the start, as text strings.

    ``source``: ``builtin`` (the shipped corpus), ``local`` (``path``: a json/jsonl/parquet/text/csv file or
    a folder of them, read with HF ``datasets``) or ``hub`` (``path`` is a dataset name, streamed; needs
    network or a populated HF cache).
    """
    from datasets import load_dataset

    field = config.text_field
    if config.source == "hub":
        def open_hub():
            stream = load_dataset(config.path, name=config.get("name"), split=config.split, streaming=True)
            return (row[field] for row in stream)
        return open_hub

    data_files = _local_files(config, section)
    fmt = FORMATS[Path(data_files[0]).suffix]

    def open_local():
        stream = load_dataset(fmt, data_files=data_files, split="train", streaming=True)
        return (row[field] for row in stream)
    return open_local


def check_documents(config, section: str = "data") -> None:
    """Fail before launch when the configured data has no document with text in its ``text_field``."""
    if config.source == "builtin":
        # Shipped non-empty; opening it here would cost every launch the import of `datasets`.
        return
    try:
        first = next((text for text in document_opener(config, section)() if text), None)
    except KeyError:
        raise ConfigError(f"{section}.text_field", f"the documents have no field '{config.text_field}'",
                          f"set {section}.text_field to the column that holds the text") from None
    except Exception as error:  # noqa: BLE001 - whatever the Hub client raises, the user gets one line
        if config.source != "hub":
            raise
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raise ConfigError(f"{section}.path", f"the Hub dataset '{config.path}' cannot be opened ({reason})",
                          "check its name and the network (HF_DATASETS_OFFLINE unset), or download it and "
                          f"use {section}.source=local with {section}.path=<its folder>") from None
    if first is None:
        raise ConfigError(f"{section}.path", f"{config.path} holds no non-empty document",
                          f"point {section}.path at files with text")


def _local_files(config, section: str) -> list[str]:
    if config.source == "builtin":
        return [str(ASSETS / "corpus.jsonl.gz")]
    if config.source != "local":
        raise ConfigError(f"{section}.source", f"unknown source '{config.source}'", "use builtin, local or hub")
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


def every_nth(open_documents: Callable[[], Iterable[str]], n: int, held: bool) -> Callable[[], Iterable[str]]:
    """The documents of a stream at positions 0, n, 2n, ... (``held``) or all the others: a split of the
    stream into two disjoint parts that any source supports, whatever order it is read in."""
    def open_part():
        return (text for index, text in enumerate(open_documents()) if (index % n == 0) == held)
    return open_part


def training_documents(config) -> Callable[[], Iterable[str]]:
    """The training stream: ``data``'s documents, less those that validation holds out of them."""
    opener = document_opener(config.data)
    return every_nth(opener, config.validation.holdout_every, held=False) if holds_out(config) else opener


def validation_documents(config) -> Callable[[], Iterable[str]]:
    """Validation's documents: its own (``validation.source``), or those it holds out of the training data."""
    if holds_out(config):
        return every_nth(document_opener(config.data), config.validation.holdout_every, held=True)
    return document_opener(config.validation, "validation")


def holds_out(config) -> bool:
    return config.validation.every > 0 and config.validation.source is None


class PackedLoader:
    """Global batches of ``seq_len``-token rows cut from the packed stream ``BOS doc EOS BOS doc EOS ...``.

    Yields this rank's ``(inputs, labels)``: rows ``dp_rank * local : (dp_rank + 1) * local`` of each
    global batch, labels being the inputs shifted by one token. At the end of the documents it starts
    the next epoch. ``state_dict()`` holds the position in the stream; it does not depend on dp_size.
    """

    def __init__(self, open_documents: Callable[[], Iterable[str]], tokenizer, seq_len: int,
                 global_batch_size: int, dp_rank: int, dp_size: int):
        self.open_documents = open_documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.rows = slice(dp_rank * global_batch_size // dp_size, (dp_rank + 1) * global_batch_size // dp_size)
        self.epoch = 0
        self.documents_read = 0
        self.buffer: list[int] = []
        self._documents: Iterator[str] | None = None

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        needed = self.global_batch_size * (self.seq_len + 1)
        while len(self.buffer) < needed:
            self.buffer.extend(self._next_document())
        batch = torch.tensor(self.buffer[:needed], dtype=torch.long).view(self.global_batch_size, self.seq_len + 1)
        del self.buffer[:needed]
        mine = batch[self.rows]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()

    def _next_document(self) -> list[int]:
        for attempt in range(2):
            if self._documents is None:
                self._documents = itertools.islice(iter(self.open_documents()), self.documents_read, None)
            for text in self._documents:
                self.documents_read += 1
                if text:
                    return [self.tokenizer.bos_id, *self.tokenizer.encode(text), self.tokenizer.eos_id]
            if attempt == 0 and self.documents_read > 0:
                self.epoch, self.documents_read, self._documents = self.epoch + 1, 0, None
        raise RuntimeError("the training data holds no non-empty document")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "documents_read": self.documents_read,
                "buffer": torch.tensor(self.buffer, dtype=torch.long)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.documents_read = int(state["documents_read"])
        self.buffer = [int(t) for t in state["buffer"]]
        self._documents = None


def validation_batches(config, tokenizer, dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the ``validation.batches`` global batches every evaluation uses (none when off)."""
    if not config.validation.every:
        return []
    loader = PackedLoader(validation_documents(config), tokenizer, config.training.seq_len,
                          config.training.global_batch_size, dp_rank, dp_size)
    return [next(loader) for _ in range(config.validation.batches)]
