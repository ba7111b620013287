"""Qwen3 (dense): grouped-query attention with RMSNorm on each head's queries and keys before RoPE, SwiGLU.

Module names are those of Hugging Face's checkpoints (without the ``model.`` prefix), so import and export
only add or strip that prefix. With ``tie_word_embeddings`` the output layer is the embedding itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_core import SwiGLU, causal_attention


@dataclass
class Qwen3Args:
    hidden_size: int = 4096
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128  # its own field: Qwen3-0.6B has 16 heads of 128 over a hidden size of 1024
    intermediate_size: int = 12288
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None  # an HF folder's stated context, exported as is (None: seq_len)
    seq_len: int = 4096  # the training sequence length: the rows of the RoPE table


def rope_table(args: Qwen3Args) -> torch.Tensor:
    """cos and sin of every position's rotation angles: shape (seq_len, head_dim // 2, 2)."""
    freqs = args.rope_theta ** -(torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim)
    angles = torch.arange(args.seq_len, dtype=torch.float64)[:, None] * freqs
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate the first half of each head's features against the second half, position by position."""
    cos, sin = rope[:, None, :, 0], rope[:, None, :, 1]
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.head_dim = args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.num_attention_heads * args.head_dim, args.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (batch, seq, heads, head_dim), -1 heads: tensor parallel leaves each rank a share of them.
        q = self.q_norm(self.q_proj(x).view(batch, seq, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, seq, -1, self.head_dim))
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        rope = rope[:seq]  # the whole local sequence is here; the stream outside may be split (SP)
        q, k = rotate(q, rope), rotate(k, rope)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3Args, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, document_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nn.Module):
    """Token ids in, logits out; a pipeline stage holds None for the outer modules it does not run."""

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, self.feed_forward(args, i))
                                     for i in range(args.num_hidden_layers)})
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args), persistent=False)

    @staticmethod
    def feed_forward(args: Qwen3Args, layer: int) -> nn.Module:
        """The feed-forward sub-layer of block ``layer`` (a mixture of experts in Qwen3-MoE)."""
        return SwiGLU(args.hidden_size, args.intermediate_size)

    def forward(self, tokens: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope, document_ids)
        if self.norm is None:
            return h
        h = self.norm(h)
        if self.args.tie_word_embeddings:
            return F.linear(h, self.embed_tokens.weight)
        assert self.lm_head is not None  # untied it is built, and a pipeline stage keeps it with the norm (outputs)
        return self.lm_head(h)
