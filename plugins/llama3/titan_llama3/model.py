"""Llama 3 / 3.1: RoPE (with the 3.1 frequency scaling), grouped-query attention, SwiGLU, RMSNorm.

Read top to bottom: the options, RoPE, attention, feed-forward, a block, the whole model. The model holds
no parallelism and no initialization code: titan-core's plugins read its description (``plugin.py``).
Blocks live in a ModuleDict keyed by layer index so that a pipeline stage that deletes the others keeps
the same parameter names as the whole model, and ``forward`` skips the outer modules a stage set to None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_core import causal_attention


@dataclass
class LlamaArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouping)
    vocab_size: int = 128256
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 context extension; None for plain RoPE.
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    max_position_embeddings: int | None = None  # an HF folder's stated context, exported as is (None: max_seq_len)
    max_seq_len: int = 2048

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def rope_frequencies(args: LlamaArgs) -> torch.Tensor:
    """Rotation angles' cos and sin per position and frequency: shape (max_seq_len, head_dim // 2, 2)."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if args.rope_scaling_factor is not None:
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        low_wavelen = args.rope_original_max_positions / args.rope_low_freq_factor
        high_wavelen = args.rope_original_max_positions / args.rope_high_freq_factor
        wavelen = 2 * math.pi / freqs
        smooth = (args.rope_original_max_positions / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor)
        blended = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
        freqs = torch.where(wavelen > low_wavelen, freqs / args.rope_scaling_factor,
                            torch.where(wavelen < high_wavelen, freqs, blended))
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, seq, heads, head_dim) by the angles in rope (seq, head_dim//2, 2).

    Feature i is rotated with feature i + head_dim/2 (the layout of Hugging Face checkpoints, so weights
    load without reordering).
    """
    first, second = x.float().chunk(2, dim=-1)
    cos, sin = rope[:, None, :, 0], rope[:, None, :, 1]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its share of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        # Sliced here, where the whole local sequence is present: the residual stream outside may be split
        # along the sequence (sequence parallel), so its length is not the number of positions.
        rope = rope[:seq]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, document_ids)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids in, next-token logits out. A pipeline stage may hold None for the parts it lacks."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: it is derived from args, and checkpoints should hold only learned state.
        self.register_buffer("rope", rope_frequencies(args), persistent=False)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope, document_ids)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
