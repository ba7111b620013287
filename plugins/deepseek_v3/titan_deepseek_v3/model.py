"""DeepSeek-V3: multi-head latent attention, YaRN-scaled RoPE, the first blocks dense and the rest mixtures of
experts (the core's ``MoE``: sigmoid scores, group-limited routing, a balancing bias, shared experts).

Multi-head latent attention (MLA) compresses each token twice: the query through a rank-``q_lora_rank`` bottleneck
(normalized, then expanded to every head), the keys and values through one rank-``kv_lora_rank`` latent, expanded
to each head's key part (``qk_nope_head_dim``) and value (``v_head_dim``). Position enters only through a separate
``qk_rope_head_dim`` part of each query and of one key shared by every head, rotated by RoPE in interleaved pairs.
A head's query and key are then ``qk_nope_head_dim + qk_rope_head_dim`` wide and its value ``v_head_dim``.

YaRN stretches RoPE to ``rope_scaling_factor`` times the ``original_max_position_embeddings`` the model was
pre-trained at: the slow-turning frequencies are interpolated, the fast ones kept, with a linear ramp between
(``beta_fast``, ``beta_slow`` rotations); the logits' temperature is corrected by ``mscale_all_dim`` (in the
softmax scale) and ``mscale`` (in the rotation table).

Names follow transformers' DeepseekV3ForCausalLM without the ``model.`` prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_core import MoE, MoeOptions, SwiGLU, causal_attention, yarn_frequencies, yarn_mscale


@dataclass
class DeepseekV3Args(MoeOptions):
    hidden_size: int = 7168
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536  # None: one full-rank query projection (q_proj), as DeepSeek-V2-Lite
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 18432  # the dense blocks' feed-forward
    first_k_dense_replace: int = 3  # blocks 0 .. n-1 dense, the rest mixtures of experts
    vocab_size: int = 129280
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 1.0  # YaRN's factor (DeepSeek-V3: 40); 1.0: plain RoPE
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None  # an HF folder's stated context, exported as is (None: seq_len)
    seq_len: int = 4096  # the training sequence length: the rows of the RoPE table
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    score_function: str = "sigmoid"
    num_shared_experts: int = 1
    router_bias_update_rate: float = 1e-3
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


def rope_table(args: DeepseekV3Args) -> torch.Tensor:
    """cos and sin of every position's rotation angles, YaRN-scaled: shape (seq_len, qk_rope_head_dim // 2, 2)."""
    factor = args.rope_scaling_factor
    freqs = yarn_frequencies(args.qk_rope_head_dim, args.rope_theta, factor, args.original_max_position_embeddings,
                             args.beta_fast, args.beta_slow)
    magnitude = yarn_mscale(factor, args.mscale) / yarn_mscale(factor, args.mscale_all_dim)
    angles = torch.arange(args.seq_len, dtype=torch.float32)[:, None] * freqs
    return torch.stack([angles.cos(), angles.sin()], dim=-1) * magnitude


def rotate_pairs(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) feature pair, position by position; the rotated evens come out first, then the odds
    (the order transformers returns: queries and keys alike, so their dot products are unchanged)."""
    cos, sin = rope[:, None, :, 0], rope[:, None, :, 1]
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    """Multi-head latent attention."""

    def __init__(self, args: DeepseekV3Args):
        super().__init__()
        heads, self.args = args.num_attention_heads, args
        if args.q_lora_rank:
            self.q_a_proj = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=args.rms_norm_eps)
            self.q_b_proj = nn.Linear(args.q_lora_rank, heads * args.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(args.hidden_size, heads * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.hidden_size, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(args.kv_lora_rank, eps=args.rms_norm_eps)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * args.v_head_dim, args.hidden_size, bias=False)
        # The rotated key every head shares passes here (an identity): tensor parallel sums its gradient over the
        # ranks, each of which holds some of the heads (TensorParallelLayout.head_shared).
        self.rope_key = nn.Identity()
        # The attention seam scales the logits by 1 / sqrt(qk_head_dim); YaRN's temperature multiplies that by
        # mscale_all_dim's correction squared, which the queries carry instead.
        self.query_scale = yarn_mscale(args.rope_scaling_factor, args.mscale_all_dim) ** 2

    def forward(self, x: torch.Tensor, rope: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        a, (batch, seq, _) = self.args, x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if a.q_lora_rank else self.q_proj(x)
        q_nope, q_rope = q.view(batch, seq, -1, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, -1, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], -1)
        rope = rope[:seq]
        q = torch.cat([q_nope, rotate_pairs(q_rope, rope)], -1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k_rope = self.rope_key(rotate_pairs(k_rope[:, :, None], rope)).expand(-1, -1, k_nope.shape[2], -1)
        k = torch.cat([k_nope, k_rope], -1)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: DeepseekV3Args, layer: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = MoE(args) if args.sparse(layer) else SwiGLU(args.hidden_size, args.intermediate_size)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, document_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3(nn.Module):
    """Token ids in, logits out; a pipeline stage holds None for the outer modules it does not run."""

    def __init__(self, args: DeepseekV3Args):
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
