"""A GPT-2-style model: learned positions, pre-LayerNorm blocks, GELU MLP, biases everywhere.

The names follow nanoGPT (``transformer.wte``, ``transformer.h.<i>.attn.c_q`` ...), not Llama's: titan-core's
plugins find their way through the description in ``plugin.py``. Two things the contract asks of a model:
the blocks sit in a ModuleDict keyed by index, and ``forward`` skips the embeddings or the head when a
pipeline stage has set them to None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPT2Args:
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_positions: int = 1024
    vocab_size: int = 50304
    layer_norm_eps: float = 1e-5
    seq_len: int = 1024  # the training sequence length (at most n_positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.head_dim = args.n_embd // args.n_head
        # Separate projections rather than GPT-2's fused c_attn: tensor parallel splits each by heads.
        self.c_q = nn.Linear(args.n_embd, args.n_embd)
        self.c_k = nn.Linear(args.n_embd, args.n_embd)
        self.c_v = nn.Linear(args.n_embd, args.n_embd)
        self.c_proj = nn.Linear(args.n_embd, args.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.c_q, self.c_k, self.c_v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.c_fc = nn.Linear(args.n_embd, 4 * args.n_embd)
        self.c_proj = nn.Linear(4 * args.n_embd, args.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_eps)
        self.attn = CausalSelfAttention(args)
        self.ln_2 = nn.LayerNorm(args.n_embd, eps=args.layer_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, args: GPT2Args):
        super().__init__()
        self.args = args
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(args.vocab_size, args.n_embd),
            wpe=nn.Embedding(args.n_positions, args.n_embd),
            h=nn.ModuleDict({str(i): Block(args) for i in range(args.n_layer)}),
            ln_f=nn.LayerNorm(args.n_embd, eps=args.layer_norm_eps),
        ))
        self.lm_head = nn.Linear(args.n_embd, args.vocab_size, bias=False)
        # The position of every token of a sequence, as a buffer: context parallel hands each shard its slice.
        self.register_buffer("positions", torch.arange(args.seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        h = tokens
        if t.wte is not None:
            h = t.wte(tokens) + t.wpe(self.positions[None, :tokens.shape[1]])
        for block in t.h.values():
            h = block(h)
        if t.ln_f is not None:
            h = t.ln_f(h)
        return self.lm_head(h) if self.lm_head is not None else h
