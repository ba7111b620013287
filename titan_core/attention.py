"""The attention seam models call: causal, or causal within each document of a packed sequence, optionally
within a sliding window and with attention sinks.

Training rows are cut from the stream ``BOS doc EOS BOS doc EOS ...``, so a row usually holds the end of
one document and the start of others. With ``training.attention_mask=block_causal`` a token attends only
to earlier tokens of its own document, as if each document were trained alone. The core derives each
token's document from the tokens themselves (a new document starts at every BOS) and hands
``document_ids`` to the model's forward, which passes them to :func:`causal_attention` in every block.

A model may also ask, block by block, for a sliding ``window`` (each token sees only its ``window`` latest
tokens, itself included) and for attention ``sinks`` (gpt-oss: one learned logit per head joins the softmax's
denominator, so a head may give little weight to every key). Anything beyond plain causal attention is a
mask, computed by :func:`masked_attention`.

A plugin that splits the sequence (context parallel) installs its own implementation of the masked case for
the duration of a micro-batch with :func:`route_masked_attention`; plain causal attention is SDPA, which
context parallel's ring attention intercepts.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

MASKS = ("causal", "block_causal")

# Taken at import: context parallel replaces F.scaled_dot_product_attention by its ring inside a micro-batch, and
# a masked attention has already gathered every key it needs.
_local_sdpa = F.scaled_dot_product_attention

# Installed by a plugin around a micro-batch. A module global rather than a ContextVar: torch.compile
# guards on globals and would break its graph on a ContextVar lookup.
_masked_attention: Callable | None = None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
                     *, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of (batch, heads, seq, head_dim) tensors; within documents when ``document_ids``
    (batch, seq) is given; over each query's ``window`` latest keys (itself included) when given; with one
    ``sinks`` logit per query head (heads,) in the softmax's denominator when given (a DTensor split by heads,
    tensor parallel's, is taken locally).

    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention: each serves ``q``'s heads in
    groups of consecutive ones), and are never repeated to ``q``'s count: the kernels read them shared, and
    context parallel moves them at their own size. ``v`` may have narrower heads than ``q`` and ``k`` (multi-head
    latent attention): the kernels then see it padded with zeros to their width and the output is cut back.
    """
    width = v.shape[-1]
    if width < q.shape[-1]:
        # CPU's fused kernel and the context-parallel ring take one head width; zero value features add nothing.
        padded = F.pad(v, (0, q.shape[-1] - width))
        return causal_attention(q, k, padded, document_ids, window=window, sinks=sinks)[..., :width]
    if document_ids is None and window is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped(q, k))
    if isinstance(sinks, DTensor):
        sinks = sinks.to_local()
    if sinks is not None and sinks.shape[0] != q.shape[1]:
        raise ValueError(f"{sinks.shape[0]} attention sinks for {q.shape[1]} query heads: under tensor parallel, list "
                         "the sinks in TensorParallelLayout.head_parameters")
    if _masked_attention is not None:
        return _masked_attention(q, k, v, document_ids, window, sinks)
    positions = torch.arange(q.shape[2], device=q.device)
    if torch.compiler.is_compiling():  # in a graph the compiler chooses what backward keeps
        mask = attention_mask(positions, positions, document_ids, document_ids, window)
    elif document_ids is None:  # the positions' mask alone: the same for every micro-batch of this length
        mask = _positions_mask(q.shape[2], window, sinks is not None, q.dtype, q.device)
    else:
        mask = shared_mask(document_ids, (window,), lambda: attention_mask(positions, positions, document_ids,
                                                                           document_ids, window),
                           sinks is not None, q.dtype)
    return masked_attention(q, k, v, mask, sinks)


@functools.lru_cache(maxsize=8)
def _positions_mask(seq: int, window: int | None, sinks: bool, dtype: torch.dtype, device: torch.device):
    """A causal mask within ``window``, as :func:`shared_mask` makes it, kept for the process (a few lengths and
    windows: gpt-oss's sliding and full blocks)."""
    positions = torch.arange(seq, device=device)
    return shared_mask(positions, (), lambda: attention_mask(positions, positions, window=window), sinks, dtype)


def shared_mask(owner: torch.Tensor, key: tuple, make: Callable[[], torch.Tensor], sinks: bool,
                dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask ``make()`` returns, as the fused kernels take it (additive, in the queries' ``dtype``,
    (batch or 1, 1, queries, keys), with the sinks' key column when ``sinks``), made once for ``owner``, a tensor
    the micro-batch's blocks share (its document ids, its token positions), and ``key``, whatever else the mask
    depends on (the block's window), while any block still keeps it: :func:`masked_attention` takes it as it takes
    a boolean mask.

    The kernels turn a boolean mask into one of the queries' dtype and keep that for backward, a new one in every
    block; one already in that dtype they keep as it is, so the blocks of a micro-batch keep one between them
    (Llama 3 8B, 2 x 8,192 tokens with documents, bf16: 128 MiB a row in each of 32 blocks, 8 GiB, against 256
    MiB). The owner (or the tensor it views, where a hook handed a block an alias of it) refers to the mask
    weakly: it goes once the micro-batch's backward has run (a pipeline's micro-batches, views of one batch, each
    their own), and blocks that recompute in backward keep none."""
    base = owner if owner._base is None else owner._base
    masks = base.__dict__.setdefault("_titan_core_masks", {})
    # Where the owner lies in its base, and its version: a plugin changing it in place makes the masks anew.
    key = (owner.storage_offset(), tuple(owner.shape), owner.stride(), base._version, *key, sinks, dtype)
    mask = masks[key]() if key in masks else None
    if mask is None:
        allowed = make()
        if sinks:
            allowed = F.pad(allowed, (0, 1), value=True)  # every query sees its sink
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        mask = mask[:, None]
        masks[key] = weakref.ref(mask)
    return mask


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of (batch, heads, queries, head_dim) queries to (batch, kv_heads, keys, head_dim) keys and values
    where ``mask`` (batch or 1, queries, keys) is true, with ``sinks`` (heads,) in each softmax's denominator;
    ``mask`` may also be a mask :func:`shared_mask` made (made with ``sinks`` if they are given).

    A sink is exactly one more key every query sees, with a zero value and the head's sink as its logit. The fused
    kernels take it as such: the sink key lives in ``group`` extra features (query heads per key head) where the
    real keys are zero and each query head reads only its own one, so a head's grouped key serves each of its query
    heads its own sink. Cost: ``group`` more features per head and one more key; the gradient reaches the sinks
    through the kernels' key gradient.
    """
    if mask.dtype == torch.bool:
        mask = (F.pad(mask, (0, 1), value=True) if sinks is not None else mask)[:, None]
    if sinks is None:
        return _local_sdpa(q, k, v, attn_mask=mask, enable_gqa=grouped(q, k))
    batch, heads, queries, width = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = width ** -0.5
    select = torch.eye(group, dtype=q.dtype, device=q.device).repeat(kv_heads, 1)  # (heads, group)
    q = torch.cat([q, select[None, :, None].expand(batch, heads, queries, group)], dim=-1)
    sink_keys = torch.cat([k.new_zeros(kv_heads, width), (sinks / scale).view(kv_heads, group).to(k.dtype)], dim=-1)
    k = torch.cat([F.pad(k, (0, group)), sink_keys[None, :, None].expand(batch, kv_heads, 1, width + group)], dim=2)
    v = F.pad(v, (0, group, 0, 1))  # the sink's zero value; as wide as the keys for the kernels
    return _local_sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=group > 1)[..., :width]


def grouped(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``k`` (and ``v``) serve groups of ``q``'s heads (SDPA's ``enable_gqa``)."""
    return q.shape[1] != k.shape[1]


def attention_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                   query_documents: torch.Tensor | None = None, key_documents: torch.Tensor | None = None,
                   window: int | None = None) -> torch.Tensor:
    """(batch or 1, queries, keys) booleans: the key is at or before the query, less than ``window`` positions
    before it when given, and in the same document when the (batch, seq) document ids are given."""
    mask = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        mask = mask & (key_positions[None, :] > query_positions[:, None] - window)
    if query_documents is None:
        return mask[None]
    assert key_documents is not None, "document ids come for both queries and keys, or for neither"
    return mask[None] & (query_documents[:, :, None] == key_documents[:, None, :])


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Each token's document within its row: 0 for the tail of a document begun in an earlier row, then
    one more at every BOS."""
    return torch.cumsum(tokens == bos_id, dim=1)


@contextlib.contextmanager
def route_masked_attention(implementation: Callable) -> Iterator[None]:
    """Inside the block, route every attention beyond plain causal to ``implementation(q, k, v, document_ids,
    window, sinks)`` (each of the last three may be None)."""
    global _masked_attention
    previous, _masked_attention = _masked_attention, implementation
    try:
        yield
    finally:
        _masked_attention = previous
