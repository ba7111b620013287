"""gpt-oss: grouped-query attention with biases and attention sinks, sliding-window blocks alternating with full ones,
YaRN-scaled RoPE, and in every block a mixture of experts with biases and a clamped SwiGLU (the core's ``MoE``).

Attention sinks are one learned logit per head added to the softmax's denominator: a head can put little weight on
every key. The ``sliding_attention`` blocks (every other one, the first included, unless ``layer_types`` says
otherwise) see only the ``sliding_window`` latest tokens. The router has a bias and weighs the chosen experts by a
softmax over their logits; each expert's projections have biases, and its gate and up projections are clamped at
``swiglu_limit`` before ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``.

YaRN stretches RoPE ``rope_scaling_factor`` times past the ``original_max_position_embeddings`` the model was
pre-trained at, with its ramp unrounded (transformers' ``truncate: false``) and its temperature correction in the
rotation table.

Names follow transformers' GptOssForCausalLM without the ``model.`` prefix, except the router (``mlp.gate``, the
core's name; ``mlp.router`` in the file) and the experts' stacks, which the file stores transposed with gate and up
interleaved (the model plugin's HF adapter says so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_core import MoE, MoeOptions, causal_attention, yarn_frequencies, yarn_mscale

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GptOssArgs(MoeOptions):
    hidden_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    attention_bias: bool = True
    sliding_window: int = 128
    layer_types: tuple[str, ...] | None = None  # None: sliding_attention in even blocks, full_attention in odd
    vocab_size: int = 201088
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling_factor: float = 32.0  # YaRN's factor; 1.0: plain RoPE
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None  # an HF folder's stated context, exported as is (None: seq_len)
    seq_len: int = 4096  # the training sequence length: the rows of the RoPE table
    num_experts: int = 128
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 2880
    router_bias: bool = True
    expert_projection_bias: bool = True
    expert_activation: str = "clamped_swiglu"

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else LAYER_TYPES[layer % 2]

    def window(self, layer: int) -> int | None:
        """The tokens a query of block ``layer`` sees (itself included), None: all before it."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None


def rope_table(args: GptOssArgs) -> torch.Tensor:
    """cos and sin of every position's rotation angles, YaRN-scaled: shape (seq_len, head_dim // 2, 2)."""
    factor = args.rope_scaling_factor
    freqs = yarn_frequencies(args.head_dim, args.rope_theta, factor, args.original_max_position_embeddings,
                             args.beta_fast, args.beta_slow, truncate=False)
    angles = torch.arange(args.seq_len, dtype=torch.float32)[:, None] * freqs
    return torch.stack([angles.cos(), angles.sin()], dim=-1) * yarn_mscale(factor)


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate the first half of each head's features against the second half, position by position."""
    cos, sin = rope[:, None, :, 0], rope[:, None, :, 1]
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: GptOssArgs, layer: int):
        super().__init__()
        self.head_dim, bias = args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * args.head_dim, bias=bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * args.head_dim, bias=bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * args.head_dim, bias=bias)
        self.o_proj = nn.Linear(args.num_attention_heads * args.head_dim, args.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(args.num_attention_heads))
        self.window = args.window(layer)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (batch, seq, heads, head_dim), -1 heads: tensor parallel leaves each rank a share of them.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        rope = rope[:seq]
        q, k = rotate(q, rope), rotate(k, rope)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids,
                               window=self.window, sinks=self.sinks)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: GptOssArgs, layer: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MoE(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, document_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOss(nn.Module):
    """Token ids in, logits out; a pipeline stage holds None for the outer modules it does not run."""

    def __init__(self, args: GptOssArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, i) for i in range(args.num_hidden_layers)})
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args), persistent=False)

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
