"""What the data costs one rank at the seeds' scale, before (text packed by every rank) and after (prepared
token shards read by offset).

    python bench/data_scale.py [--quick]

1. Loader time per step on one rank at data-parallel degree 1, 8, 128 and 1,024 with the seeds' 8B shapes
   (2 rows of 8,192 tokens per rank, so the global batch grows with the degree): one process computes the last
   rank's rows, no world needed. Printed as ratios to degree 1 (goal: flat).
2. Resume time after 10^4, 10^5 and 10^6 documents: the text stream skipping documents (before), datasets'
   saved position (the text path now), and the token loader (goal: flat).
3. The loader's share of a training step, made in the step (prefetch 0) or ahead on a thread (prefetch 1).
4. Tokens/s of ``python -m titan_core.data.prepare`` with 1 and 2 worker processes.
5. What checking every token costs a rank (checksums of the blocks it reads, ids against the vocabulary): the
   loader's time per step with and without the checksums, and the bytes a rank reads to check them over the
   same steps at degree 1, 8, 128 (goal: flat, not growing with what the other ranks read).
Not a test: the machine is shared and noisy, so compare the ratios of one run.
"""

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from titan_core.data import Prefetcher, document_opener, load_tokenizer
from titan_core.data.text import PackedLoader
from titan_core.data.tokenizer import tokenizer_identity
from titan_core.data.tokens import (CHECKSUM_BLOCK, FORMAT, MANIFEST, Samples, TokenLoader, TokenShards,
                                    block_checksums, checksum_file, shard_files)

SEQ, LOCAL = 8192, 2
TOKENIZER = OmegaConf.create({"path": "builtin", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})


def synthetic_tokens(folder: Path, shards: int, per_shard: int, checksums: bool = True) -> Path:
    """A prepared folder of random tokens (the loader's cost does not depend on what the ids are)."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for index in range(shards):
        tokens = rng.integers(0, 2048, per_shard, dtype=np.uint16)
        tokens.tofile(folder / shard_files(index)[0])
        np.save(folder / checksum_file(index), block_checksums(tokens.tobytes()))
    manifest = {"format": FORMAT, "tokenizer": tokenizer_identity(TOKENIZER), "dtype": "uint16",
                "documents": 0, "tokens": shards * per_shard,
                "shards": [{"documents": 0, "tokens": per_shard}] * shards}
    if checksums:
        manifest["checksum_block"] = CHECKSUM_BLOCK
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return folder


def documents_file(folder: Path, count: int, words: int) -> Path:
    path = folder / f"docs-{count}.jsonl"
    vocabulary = "the of and model data rank step token shard batch loader epoch".split()
    with open(path, "w") as file:
        for i in range(count):
            text = " ".join(vocabulary[(i * 7 + j) % len(vocabulary)] for j in range(words))
            file.write(json.dumps({"text": f"document {i}: {text}"}) + "\n")
    return path


def per_step(loader, steps: int) -> float:
    next(loader)  # the first batch opens files and maps shards
    start = time.perf_counter()
    for _ in range(steps):
        next(loader)
    return (time.perf_counter() - start) / steps


def degrees(tokens: Path, quick: bool) -> None:
    tokenizer = load_tokenizer(TOKENIZER)
    builtin = OmegaConf.create({"source": "builtin", "path": None, "name": None, "split": "train", "text_field": "text"})
    print("\n1. loader time per step on one rank, 2 x 8192 tokens per rank (s, and ratio to degree 1)")
    print(f"{'dp':>6} {'text (before)':>16} {'ratio':>8} {'tokens (now)':>14} {'ratio':>8}")
    base = {}
    for dp in (1, 8, 128) if quick else (1, 8, 128, 1024):
        batch = LOCAL * dp
        text_steps = 1 if dp >= 128 else 3
        text = per_step(PackedLoader(document_opener(builtin), tokenizer, SEQ, batch, dp - 1, dp), text_steps)
        samples = Samples(TokenShards(str(tokens), "data.path"), SEQ + 1, seed=0)
        shards = per_step(TokenLoader([samples], ["synthetic"], [1.0], batch, dp - 1, dp), 500)
        base = base or {"text": text, "tokens": shards}
        print(f"{dp:>6} {text:>16.4f} {text / base['text']:>8.2f} {shards:>14.6f} {shards / base['tokens']:>8.2f}")


def resumes(folder: Path, tokens: Path, quick: bool) -> None:
    tokenizer = load_tokenizer(TOKENIZER)
    print("\n2. resume after N documents, then the first batch (s)")
    print(f"{'documents':>10} {'text, skipping (before)':>24} {'text, saved position':>21} {'tokens':>9}")
    biggest = 10 ** 5 if quick else 10 ** 6
    path = documents_file(folder, biggest + 20_000, 12)
    data = OmegaConf.create({"source": "local", "path": str(path), "name": None, "split": "train", "text_field": "text"})
    for count in (10 ** 4, 10 ** 5, 10 ** 6):
        if count > biggest:
            break
        timings = []
        for saved_position in (False, True):
            loader = PackedLoader(document_opener(data), tokenizer, 256, 8, 0, 1)
            loader.load_state_dict({"epoch": 0, "documents_read": count, "buffer": torch.tensor([], dtype=torch.long),
                                    "stream": stream_state(data, count) if saved_position else encoded(None)})
            start = time.perf_counter()
            next(loader)
            timings.append(time.perf_counter() - start)
        loader = TokenLoader([Samples(TokenShards(str(tokens), "data.path"), SEQ + 1, seed=0)], ["synthetic"], [1.0],
                             LOCAL, 0, 1)
        start = time.perf_counter()
        loader.load_state_dict({"sample": count})  # any position costs the same: one number
        next(loader)
        print(f"{count:>10} {timings[0]:>24.3f} {timings[1]:>21.3f} {time.perf_counter() - start:>9.4f}")


def stream_state(data, count: int) -> torch.Tensor:
    """The position datasets records after ``count`` documents (read here, outside the timing)."""
    stream = document_opener(data)()
    for _ in itertools.islice(iter(stream), count):
        pass
    return encoded(stream.state_dict())


def encoded(state) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(state).encode()), dtype=torch.uint8)


def prefetch_share(tokens: Path, quick: bool) -> None:
    """A step of matrix products (which release Python's lock, as a GPU step's waits do) with each loader at
    the dp 8 shapes, its batches made in the step or on the prefetch thread."""
    tokenizer = load_tokenizer(TOKENIZER)
    builtin = OmegaConf.create({"source": "builtin", "path": None, "name": None, "split": "train", "text_field": "text"})
    weights = torch.randn(768, 768)
    steps = 4 if quick else 10

    def step():
        x = torch.randn(2048, 768)
        for _ in range(25):
            x = torch.tanh(x @ weights)

    def seconds_per_step(loader=None) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            if loader is not None:
                next(loader)
            step()
        return (time.perf_counter() - start) / steps

    seconds_per_step()
    print("\n3. the loader's share of a step at the dp 8 shapes (the step alone timed just before each row)")
    loaders = {"text": lambda: PackedLoader(document_opener(builtin), tokenizer, SEQ, LOCAL * 8, 7, 8),
               "tokens": lambda: TokenLoader([Samples(TokenShards(str(tokens), "data.path"), SEQ + 1, seed=0)],
                                             ["synthetic"], [1.0], LOCAL * 8, 7, 8)}
    for name, make in loaders.items():
        for depth in (0, 1):
            loader = Prefetcher(make(), depth)
            next(loader)
            alone, total = seconds_per_step(), seconds_per_step(loader)
            loader.close()
            print(f"   {name:>6}, prefetch {depth}: {total:.3f} s per step against {alone:.3f} s alone, "
                  f"loader share {(total - alone) / total:6.1%}")


def prepare_speed(folder: Path, quick: bool) -> None:
    path = documents_file(folder, 4_000 if quick else 20_000, 150)
    print("\n4. python -m titan_core.data.prepare, builtin tokenizer")
    for workers in (1, 2):
        out = folder / f"prepared-{workers}"
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "titan_core.data.prepare", str(out), "data.source=local",
                        f"data.path={path}", "--workers", str(workers), "--documents-per-shard", "5000"],
                       check=True, capture_output=True)
        seconds = time.perf_counter() - start
        tokens = json.loads((out / MANIFEST).read_text())["tokens"]
        print(f"   {workers} worker(s): {tokens:,} tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tokens/s "
              "(with the start of the process)")


def checking_cost(folder: Path, tokens: Path, quick: bool) -> None:
    unchecked = synthetic_tokens(folder / "unchecked", 8, 2_000_000 if quick else 5_000_000, checksums=False)
    steps = 200 if quick else 500
    print(f"\n5. checking every token: loader time per step at dp 8 shapes, and bytes read to check over {steps} steps")
    for name, prepared in (("ids only (no checksums)", unchecked), ("checksums and ids", tokens)):
        samples = Samples(TokenShards(str(prepared), "data.path"), SEQ + 1, seed=0)
        print(f"   {name:>24}: {per_step(TokenLoader([samples], ['synthetic'], [1.0], LOCAL * 8, 7, 8), steps):.6f} s")
    print(f"{'dp':>6} {'checked bytes on the last rank':>32} {'ratio':>8}")
    base = None
    for dp in (1, 8, 128):
        shards = TokenShards(str(tokens), "data.path")
        loader = TokenLoader([Samples(shards, SEQ + 1, seed=0)], ["synthetic"], [1.0], LOCAL * dp, dp - 1, dp)
        for _ in range(steps):
            next(loader)
        base = base or shards.verified_bytes
        print(f"{dp:>6} {shards.verified_bytes:>32,} {shards.verified_bytes / base:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes: a minute instead of several")
    quick = parser.parse_args().quick
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        tokens = synthetic_tokens(folder / "tokens", 8, 2_000_000 if quick else 5_000_000)
        degrees(tokens, quick)
        resumes(folder, tokens, quick)
        prefetch_share(tokens, quick)
        prepare_speed(folder, quick)
        checking_cost(folder, tokens, quick)


if __name__ == "__main__":
    main()
