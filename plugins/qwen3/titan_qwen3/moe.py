"""Qwen3-MoE: Qwen3's attention with the core's mixture of experts in place of the feed-forward.

The experts, the router and its options (DeepSeek-V3's routing among them) are titan_core's ``MoE`` and
``MoeOptions``; Qwen3-MoE adds which blocks have experts (every ``decoder_sparse_step``-th, except
``mlp_only_layers``). Names follow transformers' Qwen3-MoE modules, so a checkpoint is exported and read back
by renaming only.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from titan_core import MoE, MoeOptions, SwiGLU
from titan_qwen3.model import Qwen3, Qwen3Args


@dataclass
class Qwen3MoeArgs(Qwen3Args, MoeOptions):
    decoder_sparse_step: int = 1  # every n-th block has experts; the others a dense feed-forward
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def qwen3_routing(self) -> bool:
        """Whether transformers' Qwen3-MoE computes the same (no DeepSeek-V3 option in use)."""
        return ((self.score_function, self.num_shared_experts, self.router_bias_update_rate, self.n_group,
                 self.routed_scaling_factor, self.router_bias, self.expert_projection_bias, self.expert_activation)
                == ("softmax", 0, 0.0, 1, 1.0, False, False, "silu"))

    def sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


class Qwen3Moe(Qwen3):
    """Qwen3 whose feed-forward sub-layers are mixtures of experts (some dense, per the options)."""

    @staticmethod
    def feed_forward(args: Qwen3Args, layer: int) -> nn.Module:
        assert isinstance(args, Qwen3MoeArgs)  # a Qwen3Moe is built from its own options only
        return MoE(args) if args.sparse(layer) else SwiGLU(args.hidden_size, args.intermediate_size)
