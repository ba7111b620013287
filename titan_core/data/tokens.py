"""Prepared token shards: the format ``python -m titan_core.data.prepare`` writes, and the loader that reads
only a rank's own rows of each global batch.

A prepared folder holds::

    manifest.json         format, tokenizer identity, token dtype, each shard's documents and tokens
    tokens-00000.bin      the shard's packed stream BOS doc EOS BOS doc EOS ... (uint16, or uint32 past 65,536 ids)
    documents-00000.npy   where each of its documents starts (int64)
    checksums-00000.npy   the CRC-32 of each 64 KiB block of its token file (uint32)

Every token is checked where it is read, before it is trained on: the blocks of the token file a rank reads
against the checksums ``prepare`` recorded (each block once per run, so a rank reads and checks only what it
trains on, however many ranks there are), and each id against the tokenizer's vocabulary. A damaged block
stops the run in one line naming the file and its bytes, or, with ``data.damaged=skip``, the samples touching
it are replaced by the next intact ones and counted (``damaged_samples_replaced``).

The sample index is arithmetic, not a table. A folder's shards, end to end, form one stream, cut into
slots of ``seq_len + 1`` tokens (a tail shorter than a slot is left out). Sample ``k`` of a source is in
epoch ``k // per_epoch`` at the slot a seeded permutation gives ``k % per_epoch``, computed per index (a
Feistel network). So nothing is built, stored or re-read: a rank computes the slots of its own rows and
reads those tokens, and a loader's position is one number, the global samples consumed.
"""

from __future__ import annotations

import bisect
import json
import logging
import zlib
from pathlib import Path

import numpy as np
import torch

from titan_core.errors import ConfigError

log = logging.getLogger("titan_core")

FORMAT = "titan-core-tokens/1"
MANIFEST = "manifest.json"
PREPARE = "python -m titan_core.data.prepare"
CHECKSUM_BLOCK = 1 << 16  # bytes of a token file each CRC-32 covers: a row of 8k uint16 tokens reads two


def shard_files(index: int) -> tuple[str, str]:
    """The token file and document-offsets file of shard ``index``."""
    return f"tokens-{index:05d}.bin", f"documents-{index:05d}.npy"


def checksum_file(index: int) -> str:
    """The file of shard ``index``'s block checksums."""
    return f"checksums-{index:05d}.npy"


def block_checksums(data: bytes) -> np.ndarray:
    """The CRC-32 of each ``CHECKSUM_BLOCK`` bytes of ``data`` (the last block shorter)."""
    view = memoryview(data)
    return np.array([zlib.crc32(view[start:start + CHECKSUM_BLOCK]) for start in range(0, len(view), CHECKSUM_BLOCK)],
                    dtype=np.uint32)


class DamagedData(ConfigError):
    """Tokens a run was about to train on are not those ``prepare`` wrote: one line naming the file."""


def read_manifest(path: Path, field: str) -> dict:
    file = Path(path).expanduser() / MANIFEST
    if not file.is_file():
        raise ConfigError(field, f"{file.parent} holds no {MANIFEST} (not a prepared folder, or its preparation "
                          "did not finish)", f"run {PREPARE} {file.parent} ... (an interrupted one resumes)")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(field, f"{file} is not whole ({error}): cut short or overwritten",
                          f"prepare {file.parent} again ({PREPARE}; the shards already done are kept)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(field, f"{file} is not in the {FORMAT} format", f"prepare it again with {PREPARE}")
    return manifest


def check_prepared(path: str | None, field: str, identity: dict) -> int:
    """Fail in one line unless ``path`` is a finished preparation made with the tokenizer ``identity``, its
    files whole; returns its token count. Costs a stat per shard, no read of the tokens."""
    if not path:
        raise ConfigError(field, "is empty but the source is tokens", f"set {field} to a folder {PREPARE} wrote")
    folder = Path(path).expanduser()
    manifest = read_manifest(folder, field)
    if manifest["tokenizer"] != identity:
        theirs, ours = manifest["tokenizer"], identity
        raise ConfigError(field, f"{folder} was prepared with another tokenizer ({theirs['vocab_size']} ids, "
                          f"sha256 {theirs['sha256'][:12]}) than the run's ({ours['vocab_size']} ids, sha256 "
                          f"{ours['sha256'][:12]})", "set tokenizer.* to the one it was prepared with, or "
                          f"prepare it again with this one ({PREPARE})")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for index, shard in enumerate(manifest["shards"]):
        file = folder / shard_files(index)[0]
        size = file.stat().st_size if file.is_file() else 0
        if size != shard["tokens"] * itemsize:
            raise ConfigError(field, f"{file} holds {size} bytes where the manifest says "
                              f"{shard['tokens'] * itemsize} (truncated or replaced)",
                              f"prepare {folder} again ({PREPARE})")
        if manifest.get("checksum_block") and not (folder / checksum_file(index)).is_file():
            raise ConfigError(field, f"{folder / checksum_file(index)} is missing",
                              f"prepare {folder} again ({PREPARE})")
    if not manifest.get("checksum_block"):
        log.info("data: %s was prepared without checksums: its tokens are checked against the vocabulary only "
                 "(prepare it again to have them verified)", folder)
    return sum(shard["tokens"] for shard in manifest["shards"])


class TokenShards:
    """A prepared folder's shards as one stream of tokens, memory-mapped shard by shard when first read, every
    token checked as it is read (module docstring)."""

    def __init__(self, path: str, field: str):
        self.folder, self.field = Path(path).expanduser(), field
        manifest = read_manifest(self.folder, field)
        self.dtype = np.dtype(manifest["dtype"])
        self.vocab_size = manifest["tokenizer"]["vocab_size"]
        self.block: int | None = manifest.get("checksum_block")  # None: prepared before checksums were recorded
        self.counts = [shard["tokens"] for shard in manifest["shards"]]
        self.starts = np.cumsum([0, *self.counts]).tolist()
        self.tokens = self.starts[-1]
        self._maps: dict[int, np.ndarray] = {}
        self._checksums: dict[int, np.ndarray] = {}
        self._verified: dict[int, np.ndarray] = {}  # per shard touched, each block: 0 unchecked, 1 intact, -1 damaged
        self.verified_bytes = 0  # what this rank has read to check: the blocks of the rows it trained on

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start + length`` of the stream (across shard ends)."""
        pieces = []
        shard = bisect.bisect_right(self.starts, start) - 1
        while length:
            offset = start - self.starts[shard]
            take = min(length, self.counts[shard] - offset)
            pieces.append(self._checked(shard, offset, take))
            start, length, shard = start + take, length - take, shard + 1
        return np.concatenate(pieces)

    def _checked(self, shard: int, offset: int, count: int) -> np.ndarray:
        """Tokens ``offset .. offset + count`` of ``shard``, their blocks' checksums and their ids checked."""
        raw, size = self._map(shard), self.dtype.itemsize
        if self.block:
            self._verify(shard, raw, self.block, offset * size, (offset + count) * size)
        tokens = raw[offset * size:(offset + count) * size].view(self.dtype)
        outside = np.flatnonzero(tokens >= self.vocab_size)
        if outside.size:
            raise DamagedData(self.field, f"{self._file(shard)}: token {offset + outside[0]} is id "
                              f"{tokens[outside[0]]}, outside the tokenizer's {self.vocab_size} ids (damaged)",
                              f"prepare {self.folder} again ({PREPARE}), or set data.damaged=skip")
        return tokens

    def _verify(self, shard: int, raw: np.ndarray, block_size: int, first: int, end: int) -> None:
        if shard not in self._checksums:
            self._checksums[shard] = np.load(self.folder / checksum_file(shard))
            self._verified[shard] = np.zeros(len(self._checksums[shard]), dtype=np.int8)
        checked = self._verified[shard]
        for block in range(first // block_size, (end - 1) // block_size + 1):
            data = raw[block * block_size:(block + 1) * block_size]
            if not checked[block]:
                crc = zlib.crc32(data)  # type: ignore[arg-type]  # numpy types ndarray a Buffer from Python 3.12 only
                checked[block] = 1 if crc == self._checksums[shard][block] else -1
                self.verified_bytes += len(data)
            if checked[block] < 0:
                raise DamagedData(self.field, f"{self._file(shard)}: bytes {block * block_size}-"
                                  f"{block * block_size + len(data) - 1} differ from what {PREPARE} wrote (checksum)",
                                  f"prepare {self.folder} again, or set data.damaged=skip to train without them")

    def _file(self, shard: int) -> Path:
        return self.folder / shard_files(shard)[0]

    def _map(self, shard: int) -> np.ndarray:
        if shard not in self._maps:
            self._maps[shard] = np.memmap(self._file(shard), dtype=np.uint8, mode="r")
        return self._maps[shard]


def permuted(index: int, size: int, key: int) -> int:
    """``index``'s place in a pseudo-random permutation of ``range(size)`` chosen by ``key``: a four-round
    Feistel network on the smallest even number of bits that holds ``size``, walked until it lands inside."""
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    while True:
        left, right = index >> half, index & mask
        for round_ in range(4):
            left, right = right, left ^ (_mix(key, round_, right) & mask)
        index = (left << half) | right
        if index < size:
            return index


def _mix(key: int, round_: int, value: int) -> int:
    """splitmix64 of the three numbers: a cheap hash whose bits all depend on each input bit."""
    x = (key * 0x9E3779B97F4A7C15 + round_ * 0xBF58476D1CE4E5B9 + value) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class Samples:
    """One prepared folder's samples of ``length`` tokens, in epochs.

    With ``holdout_every`` n, the slots 0, n, 2n, ... of the stored stream are validation's (``held``) and
    never training's, whatever the epoch or shuffle. ``seed`` (None: stored order) shuffles each epoch anew.
    """

    def __init__(self, shards: TokenShards, length: int, holdout_every: int = 0, held: bool = False,
                 seed: int | None = None):
        self.shards, self.length, self.every, self.held, self.seed = shards, length, holdout_every, held, seed
        slots = shards.tokens // length
        held_slots = -(-slots // holdout_every) if holdout_every else 0
        self.per_epoch = (held_slots if held else slots - held_slots) if holdout_every else slots

    def slot(self, index: int) -> int:
        epoch, place = divmod(index, self.per_epoch)
        if self.seed is not None:
            place = permuted(place, self.per_epoch, self.seed * 1_000_003 + epoch)
        if not self.every:
            return place
        return place * self.every if self.held else place + place // (self.every - 1) + 1

    def read(self, index: int) -> np.ndarray:
        return self.shards.read(self.slot(index) * self.length, self.length)


class Mixture:
    """Which source each global sample comes from: a pattern of ``period`` samples giving each source its
    share (largest remainder, at least one), spread evenly through the pattern, repeated."""

    def __init__(self, weights: list[float], period: int = 10_000):
        shares = np.asarray(weights, dtype=np.float64) / sum(weights)
        period = period if len(weights) > 1 else 1
        quotas = np.maximum(1, np.floor(shares * period)).astype(np.int64)
        for j in np.argsort(-(shares * period - quotas))[: max(0, period - quotas.sum())]:
            quotas[j] += 1
        self.period, self.quotas = int(quotas.sum()), quotas
        self.pattern = np.empty(self.period, dtype=np.int64)
        self.before = np.zeros((self.period + 1, len(weights)), dtype=np.int64)  # per source, in pattern[:t]
        for t in range(self.period):
            j = int(np.argmax(quotas * (t + 1) / self.period - self.before[t]))
            self.pattern[t] = j
            self.before[t + 1] = self.before[t]
            self.before[t + 1, j] += 1

    def locate(self, sample: int) -> tuple[int, int]:
        """The source of global ``sample`` and its index among that source's samples."""
        block, t = divmod(sample, self.period)
        j = int(self.pattern[t])
        return j, block * int(self.quotas[j]) + int(self.before[t, j])

    def taken(self, samples: int) -> np.ndarray:
        """How many of the first ``samples`` global samples each source gave."""
        block, t = divmod(samples, self.period)
        return block * self.quotas + self.before[t]


class TokenLoader:
    """This rank's rows of each global batch, read from prepared shards by offset (``sources`` mixed by
    ``weights``). The position is the number of global samples consumed: the same at every data-parallel
    degree, and resuming reads nothing."""

    def __init__(self, sources: list[Samples], names: list[str], weights: list[float], global_batch_size: int,
                 dp_rank: int, dp_size: int, skip_damaged: bool = False):
        self.sources, self.names, self.mixture = sources, names, Mixture(weights)
        self.global_batch_size = global_batch_size
        self.rows = range(dp_rank * global_batch_size // dp_size, (dp_rank + 1) * global_batch_size // dp_size)
        self.sample = 0
        self.epochs = [0] * len(sources)
        self.skip_damaged, self.replaced = skip_damaged, 0
        self.damage_seen: set[str] = set()

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self._row(self.sample + r) for r in self.rows]).astype(np.int64)
        self.sample += self.global_batch_size
        batch = torch.from_numpy(rows)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def _row(self, sample: int) -> np.ndarray:
        j, index = self.mixture.locate(sample)
        source = self.sources[j]
        epoch = index // source.per_epoch
        if epoch > self.epochs[j]:
            self.epochs[j] = epoch
            log.info("data: %s starts its epoch %d: its %d samples repeat%s", self.names[j], epoch + 1,
                     source.per_epoch, ", in a new order" if source.seed is not None else "")
        for replacement in range(index, index + source.per_epoch):  # with skip_damaged: the next intact sample
            try:
                tokens = source.read(replacement)
            except DamagedData as damage:
                if not self.skip_damaged:
                    raise
                if str(damage) not in self.damage_seen:
                    self.damage_seen.add(str(damage))
                    log.warning("data: skipping the samples of damaged data (data.damaged=skip): %s", damage)
                continue
            self.replaced += replacement != index
            return tokens
        raise ConfigError("data.damaged", f"every sample of {self.names[j]} is damaged",
                          f"prepare it again ({PREPARE})")

    def describe(self, steps: int) -> list[str]:
        """A line per source: its samples per epoch, how many ``steps`` steps read, and whether they repeat."""
        lines = []
        for name, source, taken in zip(self.names, self.sources, self.mixture.taken(steps * self.global_batch_size)):
            epochs = taken / source.per_epoch
            lines.append(f"data: {name}: {source.per_epoch:,} samples per epoch; the run reads {int(taken):,}"
                         + (f", so it repeats ({epochs:.2f} epochs)" if epochs > 1 else ""))
        return lines

    def state_dict(self) -> dict:
        return {"sample": self.sample}

    def load_state_dict(self, state: dict) -> None:
        self.sample = int(state["sample"])
        self.epochs = [int(n) // s.per_epoch for n, s in zip(self.mixture.taken(self.sample), self.sources)]

    def metrics(self) -> dict:
        """Tokens trained on from each source so far, when there are several; rows that replaced damaged samples."""
        replaced = {"damaged_samples_replaced": float(self.replaced)} if self.replaced else {}
        if len(self.sources) < 2:
            return replaced
        length = self.sources[0].length - 1
        return {**replaced, **{f"tokens_{name}": float(n * length)
                               for name, n in zip(self.names, self.mixture.taken(self.sample))}}
