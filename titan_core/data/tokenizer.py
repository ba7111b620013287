"""Tokenizers: the byte-level one, and any Hugging Face ``tokenizer.json`` (the shipped one by default)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path

from titan_core.errors import ConfigError

ASSETS = files("titan_core") / "assets"


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus begin/end of text: needs no file. 264 entries (a multiple of 8)."""

    vocab_size = 264
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

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


def special_tokens(config) -> dict:
    """The special tokens of ``config`` (``tokenizer``) as a Hugging Face folder records them: their ids (for
    config.json and generation_config.json) and, for a file tokenizer, their text (for tokenizer_config.json)."""
    tokenizer = load_tokenizer(config)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    if tokenizer_file(config) is None:
        return ids
    return {**ids, "bos_token": config.bos_token, "eos_token": config.eos_token}


def tokenizer_identity(config) -> dict:
    """What makes token ids mean the same text: the tokenizer file's digest and its special ids. Prepared
    shards record it, and a run with another tokenizer is refused."""
    file = tokenizer_file(config)
    tokenizer = load_tokenizer(config)
    return {"sha256": "bytes" if file is None else hashlib.sha256(file.read_bytes()).hexdigest(),
            "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}
