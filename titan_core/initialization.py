"""Initial weights, drawn shard by shard and equal under every plan.

A parameter's values are a function of the seed, its canonical name and a row chunk: its rows (first
dimension) are cut into chunks of at most ``CHUNK_ELEMENTS`` values, and chunk c is drawn from a
generator seeded by (seed, name, c). A rank draws only the chunks that overlap the box of the parameter
it holds and keeps their intersection with that box, so the extra memory is one chunk whatever the
model's size (the whole 405B embedding would be 8.4 GB), and a sharded run starts exactly where one
process does.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_core.description import ModelDescription, canonical_name
from titan_core.errors import ConfigError

CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 drawn at a time


def local_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank holds of ``param`` and the global index of its first element.

    Every sharding titan-core's plugins produce (FSDP, HSDP, TP, SimpleFSDP and their combinations) leaves
    each rank a box of the global tensor; anything else is refused rather than initialized wrong.
    """
    if not isinstance(param, DTensor):
        return param.data, (0,) * param.ndim
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local()
    # The box is arithmetic on the mesh; torch computes strided shards' offsets with a small real tensor,
    # which must stay real when the weights are fake tensors (a 405B plan checked in one process).
    with unset_fake_temporarily():
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"placements {param.placements} do not leave this rank a box of the parameter "
                           f"(local shape {tuple(local.shape)}, expected {tuple(shape)})")
    return local, tuple(offset)


@torch.no_grad()
def init_parameter(param: torch.Tensor, name: str, rule, seed: int) -> None:
    """Fill this rank's part of ``param`` (canonical ``name``) by ``rule``, a :class:`ParamInit`."""
    local, offset = local_box(param)
    fill_box(local, offset, tuple(param.shape), name, rule, seed)


def fill_box(local: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...], name: str, rule, seed: int) -> None:
    """Fill ``local``, the box at ``offset`` of a parameter of ``shape``, with its initial values."""
    if rule.std is None:
        local.fill_(rule.fill)
        return
    if local.numel() == 0:
        return
    rows_per_chunk = max(1, CHUNK_ELEMENTS // math.prod(shape[1:]))
    first_row, last_row = offset[0], offset[0] + local.shape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
    for chunk in range(first_row // rows_per_chunk, (last_row - 1) // rows_per_chunk + 1):
        start = chunk * rows_per_chunk
        stop = min(start + rows_per_chunk, shape[0])
        generator = torch.Generator(local.device).manual_seed(
            seed * 1_000_003 + zlib.crc32(f"{name}#{chunk}".encode()))
        drawn = torch.empty((stop - start, *shape[1:]), dtype=local.dtype, device=local.device)
        drawn.normal_(0.0, rule.std, generator=generator)
        lo, hi = max(start, first_row), min(stop, last_row)
        local[lo - first_row:hi - first_row].copy_(drawn[(slice(lo - start, hi - start), *inner)])


def init_weights(part: nn.Module, description: ModelDescription, seed: int) -> None:
    """Give every parameter and buffer of a materialized model part its initial value."""
    for name, param in part.named_parameters():
        name = canonical_name(name)
        init_parameter(param, name, description.param_init(name), seed)
    buffers = [name for name, _ in part.named_buffers()]
    if buffers and description.init_buffers is None:
        # to_empty left them uninitialized memory: training on them would be silently wrong.
        raise ConfigError("model.name", f"model '{description.family}' has buffer {buffers[0]} but describes no "
                          "init_buffers to fill it", "give its ModelDescription an init_buffers function")
    if description.init_buffers is not None:
        with torch.no_grad():
            description.init_buffers(part)
