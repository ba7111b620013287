"""Tokenize once: ``python -m titan_core.data.prepare OUTPUT [data.* and tokenizer.* overrides] [--workers N]``.

Reads the documents the same ``data.*`` options name for training (``builtin``, ``local`` files, a ``hub``
dataset), tokenizes them with ``tokenizer.*`` on several processes (``datasets``' map), and writes OUTPUT
in the format of ``titan_core.data.tokens``; then train with ``data.source=tokens data.path=OUTPUT``.

Each shard is written whole (a temporary name, then a rename) and is done once its ``shard-NNNNN.json``
exists, so an interrupted run resumes with the first shard not done and keeps what was written. OUTPUT's
``prepare.json`` records the input and the tokenizer: preparing other input into the same folder is
refused rather than mixed in, and ``manifest.json``, written last, is what a run reads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from titan_core.data.text import FORMATS, local_files, check_documents
from titan_core.data.tokenizer import load_tokenizer, tokenizer_identity
from titan_core.data.tokens import (CHECKSUM_BLOCK, FORMAT, MANIFEST, block_checksums, checksum_file,
                                    shard_files)
from titan_core.errors import EXIT_BAD_INPUT, EXIT_STORAGE, ConfigError, StorageError
from titan_core.job.schema import check_key, core_defaults, default_preset

PLAN = "prepare.json"


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, object]:
    parser = argparse.ArgumentParser(prog="python -m titan_core.data.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("output", type=Path, help="the folder to write (created; an unfinished one resumes)")
    parser.add_argument("overrides", nargs="*", help="data.* and tokenizer.* options, as for a run")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    parser.add_argument("--documents-per-shard", type=int, default=100_000, help="documents in each shard file")
    args = parser.parse_args(argv)
    defaults = core_defaults()
    config = OmegaConf.create({"data": defaults["data"], "tokenizer": defaults["tokenizer"]})
    for override in args.overrides:
        key, equals, _ = override.partition("=")
        if not equals or key.split(".")[0] not in ("data", "tokenizer"):
            raise ConfigError(key or override, "is not a data.* or tokenizer.* option",
                              "give the options that name the documents and the tokenizer, e.g. "
                              "data.source=local data.path=docs.jsonl")
        check_key(key, default_preset())
    config.merge_with(OmegaConf.from_dotlist(args.overrides))
    for option, value in (("--workers", args.workers), ("--documents-per-shard", args.documents_per_shard)):
        if value < 1:
            raise ConfigError(option, f"{value} is not a positive integer", f"set {option} to 1 or more")
    if config.data.source == "tokens":
        raise ConfigError("data.source", "tokens are prepared already", "name text documents: builtin, local or hub")
    check_documents(config.data)
    return args, config


def open_dataset(data, cache: Path):
    """The documents as a ``datasets`` Dataset (an Arrow file on disk, so the worker processes share it)."""
    from datasets import load_dataset

    if data.source == "hub":
        return load_dataset(data.path, name=data.get("name"), split=data.split)
    files = local_files(data, "data")
    return load_dataset(FORMATS[Path(files[0]).suffix], data_files=files, split="train", cache_dir=str(cache))


def write_whole(path: Path, write) -> None:
    """``write(file)`` into a temporary name, then renamed: a reader sees the whole file or none. A storage fault
    (a full disk, a read-only or vanished folder) is one line; what was written before is kept and resumed from."""
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as file:
            write(file)
        os.replace(partial, path)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise StorageError(path.parent, error, "the shards written before are kept: run the same command again "
                           "once there is room, and it resumes") from None


def prepare(args: argparse.Namespace, config) -> dict:
    """Write the shards not yet done and the manifest; returns the manifest."""
    import datasets
    from tqdm import tqdm

    datasets.disable_progress_bars()  # one bar, ours
    output: Path = args.output.expanduser()
    identity = tokenizer_identity(config.tokenizer)
    plan = {"format": FORMAT, "tokenizer": identity, "documents_per_shard": args.documents_per_shard,
            "input": {key: config.data[key] for key in ("source", "path", "name", "split", "text_field")}}
    if (output / PLAN).is_file() and json.loads((output / PLAN).read_text()) != plan:
        raise ConfigError("output", f"{output} holds a preparation of other documents, tokenizer or shard size",
                          "choose another folder (the one there is kept), or delete it to prepare anew")
    if output.is_dir() and not (output / PLAN).is_file() and any(output.iterdir()):
        raise ConfigError("output", f"{output} holds files and is not a preparation (no {PLAN}): the shards would "
                          "be written beside them", "choose a new or empty folder")
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise StorageError(output, error, "nothing was written") from None
    if not (output / PLAN).is_file():
        write_whole(output / PLAN, lambda file: file.write(json.dumps(plan, indent=1).encode()))

    tokenizer = load_tokenizer(config.tokenizer)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    field = config.data.text_field
    documents = open_dataset(config.data, output / ".cache")
    per_shard = args.documents_per_shard
    count = -(-len(documents) // per_shard)

    def encode(rows: dict) -> dict:
        ids = tokenizer.encode_batch([text for text in rows[field] if text])
        return {"ids": [[tokenizer.bos_id, *doc, tokenizer.eos_id] for doc in ids]}

    bar = tqdm(total=len(documents), unit="doc", desc=f"preparing {output.name}", disable=None)
    shards = []
    for index in range(count):
        done = output / f"shard-{index:05d}.json"
        first = index * per_shard
        part = documents.select(range(first, min(first + per_shard, len(documents))))
        if not done.is_file():
            tokens_file, offsets_file = shard_files(index)
            encoded = part.map(encode, batched=True, remove_columns=part.column_names, keep_in_memory=True,
                               num_proc=min(args.workers, len(part)) if args.workers > 1 else None,
                               new_fingerprint=f"{identity['sha256'][:32]}-{index}")
            ids = encoded.data.column("ids").combine_chunks()
            tokens = ids.flatten().to_numpy().astype(dtype)
            offsets = ids.offsets.to_numpy().astype(np.int64)
            write_whole(output / tokens_file, lambda file: file.write(tokens.tobytes()))
            write_whole(output / offsets_file, lambda file: np.save(file, offsets[:-1]))
            write_whole(output / checksum_file(index), lambda file: np.save(file, block_checksums(tokens.tobytes())))
            record = {"documents": len(encoded), "tokens": int(len(tokens))}
            write_whole(done, lambda file: file.write(json.dumps(record).encode()))
        elif not (output / checksum_file(index)).is_file():  # done by a version that recorded no checksums
            written = (output / shard_files(index)[0]).read_bytes()
            write_whole(output / checksum_file(index), lambda file: np.save(file, block_checksums(written)))
        shards.append(json.loads(done.read_text()))
        bar.update(len(part))
        bar.set_postfix_str(f"{sum(s['tokens'] for s in shards):,} tokens")
    bar.close()
    manifest = {"format": FORMAT, "tokenizer": identity, "dtype": np.dtype(dtype).name,
                "checksum_block": CHECKSUM_BLOCK,
                "documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                "shards": shards}
    write_whole(output / MANIFEST, lambda file: file.write(json.dumps(manifest, indent=1).encode()))
    shutil.rmtree(output / ".cache", ignore_errors=True)
    return manifest


def main(argv: list[str] | None = None) -> None:
    """Tokenize a corpus once into shards that data.source=tokens reads per rank."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the worker processes are the parallelism
    logging.getLogger("datasets").setLevel(logging.ERROR)
    try:
        args, config = parse(argv)
        manifest = prepare(args, config)
    except ConfigError as error:
        print(f"titan-core: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except StorageError as error:
        print(f"titan-core: storage: {error}", file=sys.stderr)
        sys.exit(EXIT_STORAGE)
    print(f"{args.output}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in "
          f"{len(manifest['shards'])} shard(s); train with data.source=tokens data.path={args.output}")


if __name__ == "__main__":
    main()
