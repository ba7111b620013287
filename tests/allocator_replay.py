"""What a GPU's caching allocator would reserve over a tracked step: the step's allocations and frees, in order,
each on the stream FSDP2 makes it on, replayed through a model of PyTorch's CUDA caching allocator as TorchTitan
runs it (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; c10/cuda/CUDACachingAllocator.cpp):

- requests are rounded up to 512 bytes; those of at most 1 MiB go to a small pool, the rest to a large one;
- each stream has its own pools: a block freed on one stream is never handed to another;
- a request takes the smallest free block it fits (the lowest address among equals), split if anything is left;
  a free block at the end of the mapped range counts as the room it could grow to, so it is taken last;
- when none fits, more of the pool's address range is mapped behind its last block, in pages of 2 MiB (small
  pool) or 20 MiB (large), and mapped pages stay reserved until the cache is emptied, which a training step
  does not do (``torch.cuda.empty_cache``) unless an allocation fails.

What is reserved is every pool's mapped range; the peak of their sum is what TorchTitan's ``memory`` figure
reports (``torch.cuda.max_memory_reserved``).
"""

from __future__ import annotations

import math
from collections import defaultdict

ROUNDING = 512
SMALL_REQUEST = 1 << 20
PAGE = {True: 2 << 20, False: 20 << 20}  # small pool, large pool


class _Pool:
    """One stream's pool of small or of large blocks: its blocks by address, its mapped range."""

    def __init__(self, page: int):
        self.page, self.mapped = page, 0
        self.blocks: list[list] = []  # [address, bytes, free]

    def allocate(self, nbytes: int) -> list:
        fitting = [block for block in self.blocks[:-1] if block[2] and block[1] >= nbytes]
        if fitting:
            block = min(fitting, key=lambda b: (b[1], b[0]))
        else:  # the last block, grown by mapping pages behind it
            last = self.blocks[-1] if self.blocks and self.blocks[-1][2] else None
            start = last[0] if last else self.mapped
            grown = max(self.mapped, math.ceil((start + nbytes) / self.page) * self.page)
            if last:
                last[1] += grown - self.mapped
            elif grown > self.mapped:
                self.blocks.append(last := [self.mapped, grown - self.mapped, True])
            self.mapped, block = grown, last
        index = self.blocks.index(block)
        if block[1] - nbytes >= ROUNDING:
            self.blocks.insert(index + 1, [block[0] + nbytes, block[1] - nbytes, True])
            block[1] = nbytes
        block[2] = False
        return block

    def free(self, block: list) -> None:
        block[2] = True
        index = self.blocks.index(block)
        if index + 1 < len(self.blocks) and self.blocks[index + 1][2]:
            block[1] += self.blocks.pop(index + 1)[1]
        if index > 0 and self.blocks[index - 1][2]:
            self.blocks[index - 1][1] += self.blocks.pop(index)[1]


def replay(before: list[tuple], step: list[tuple]) -> tuple[int, int, dict[str, int]]:
    """The peak bytes allocated and reserved over ``step``'s events, after the allocations ``before`` it (what
    earlier steps left: each freed in the step is laid on the stream where the step makes its successor, the
    first tensor of its size the step keeps), and what each stream's pools reserve at that peak."""
    freed = {event[1] for event in step if event[0] == "free"}
    successors = defaultdict(list)
    for event in step:
        if event[0] == "alloc" and event[1] not in freed:
            successors[event[2]].append(event[3])
    gone = {event[1] for event in before if event[0] == "free"}
    laid = [("alloc", key, nbytes, successors[nbytes].pop(0) if key in freed and successors[nbytes] else stream)
            for _, key, nbytes, stream in (event for event in before if event[0] == "alloc" and event[1] not in gone)]
    pools: dict[tuple[str, bool], _Pool] = {}
    live: dict[int, tuple[_Pool, list, int]] = {}
    allocated = peak_allocated = peak_reserved = 0
    streams: dict[str, int] = {}
    for index, event in enumerate(laid + step):
        if event[0] == "alloc":
            _, key, nbytes, stream = event
            nbytes = max(ROUNDING, math.ceil(nbytes / ROUNDING) * ROUNDING)
            small = nbytes <= SMALL_REQUEST
            pool = pools.setdefault((stream, small), _Pool(PAGE[small]))
            live[key] = (pool, pool.allocate(nbytes), nbytes)
            allocated += nbytes
        elif event[1] in live:
            pool, block, nbytes = live.pop(event[1])
            pool.free(block)
            allocated -= nbytes
        if index >= len(laid):
            peak_allocated = max(peak_allocated, allocated)
            reserved = sum(pool.mapped for pool in pools.values())
            if reserved > peak_reserved:
                peak_reserved, streams = reserved, defaultdict(int)
                for (stream, _), pool in pools.items():
                    streams[stream] += pool.mapped
    return peak_allocated, peak_reserved, dict(streams)
