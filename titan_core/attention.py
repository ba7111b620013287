"""The attention seam models call: causal, or causal within each document of a packed sequence.

Training rows are cut from the stream ``BOS doc EOS BOS doc EOS ...``, so a row usually holds the end of
one document and the start of others. With ``training.attention_mask=block_causal`` a token attends only
to earlier tokens of its own document, as if each document were trained alone. The core derives each
token's document from the tokens themselves (a new document starts at every BOS) and hands
``document_ids`` to the model's forward, which passes them to :func:`causal_attention` in every block.

A plugin that splits the sequence (context parallel) installs its own implementation for the duration
of a micro-batch with :func:`document_attention`; without ``document_ids`` the seam is plain causal SDPA,
which context parallel's ring attention intercepts as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

MASKS = ("causal", "block_causal")

# Installed by a plugin around a micro-batch. A module global rather than a ContextVar: torch.compile
# guards on globals and would break its graph on a ContextVar lookup.
_document_attention: Callable | None = None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of (batch, heads, seq, head_dim) tensors; within documents when ``document_ids``
    (batch, seq) is given.

    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention: each serves ``q``'s heads in
    groups of consecutive ones), and are never repeated to ``q``'s count: the kernels read them shared, and
    context parallel moves them at their own size. ``v`` may have narrower heads than ``q`` and ``k`` (multi-head
    latent attention): the kernels then see it padded with zeros to their width and the output is cut back.
    """
    width = v.shape[-1]
    if width < q.shape[-1]:
        # CPU's fused kernel and the context-parallel ring take one head width; zero value features add nothing.
        return causal_attention(q, k, F.pad(v, (0, q.shape[-1] - width)), document_ids)[..., :width]
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped(q, k))
    if _document_attention is not None:
        return _document_attention(q, k, v, document_ids)
    positions = torch.arange(q.shape[2], device=q.device)
    mask = document_causal_mask(document_ids, positions, document_ids, positions)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=grouped(q, k))


def grouped(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``k`` (and ``v``) serve groups of ``q``'s heads (SDPA's ``enable_gqa``)."""
    return q.shape[1] != k.shape[1]


def document_causal_mask(query_documents: torch.Tensor, query_positions: torch.Tensor,
                         key_documents: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """(batch, queries, keys) booleans: the key is at or before the query, in the same document."""
    causal = key_positions[None, :] <= query_positions[:, None]
    return causal[None] & (query_documents[:, :, None] == key_documents[:, None, :])


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Each token's document within its row: 0 for the tail of a document begun in an earlier row, then
    one more at every BOS."""
    return torch.cumsum(tokens == bos_id, dim=1)


@contextlib.contextmanager
def document_attention(implementation: Callable) -> Iterator[None]:
    """Route document-masked attention to ``implementation(q, k, v, document_ids)`` inside the block."""
    global _document_attention
    previous, _document_attention = _document_attention, implementation
    try:
        yield
    finally:
        _document_attention = previous
