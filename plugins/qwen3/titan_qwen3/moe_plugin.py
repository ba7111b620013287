"""The Qwen3-MoE model plugin: Qwen3's options plus the experts', its description and its HF names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import dataclasses
import math
import re

from titan_core import (CORE_ATTENTION, ConfigError, ExpertRouting, ExpertsLayout, HFAdapter, ModelDescription,
                        ParamInit, SwiGLU, check_moe_options, check_positive, hookimpl, init_routing_buffers,
                        read_options)
from titan_qwen3.model import rope_table
from titan_qwen3.moe import Qwen3Moe, Qwen3MoeArgs
from titan_qwen3 import plugin as qwen3

FAMILY = "qwen3_moe"
OPTIONS = tuple(f.name for f in dataclasses.fields(Qwen3MoeArgs) if f.name != "seq_len")
OTHER_ROUTING = ("score_function", "num_shared_experts", "router_bias_update_rate", "n_group", "topk_group",
                 "routed_scaling_factor", "router_bias", "expert_projection_bias", "expert_activation", "swiglu_alpha",
                 "swiglu_limit")  # DeepSeek-V3's and gpt-oss's, not in HF's Qwen3-MoE


def qwen3_moe_args(model_config, vocab_size: int, seq_len: int) -> Qwen3MoeArgs:
    options = read_options(model_config, OPTIONS, "Qwen3-MoE", vocab_size)
    options["mlp_only_layers"] = tuple(options.get("mlp_only_layers") or ())
    args = Qwen3MoeArgs(**options, seq_len=seq_len)
    check_positive(args, qwen3.POSITIVE, "Qwen3-MoE")
    qwen3.check_attention_shape(args)
    check_moe_options(args)
    if args.decoder_sparse_step < 1:
        raise ConfigError("model.decoder_sparse_step", f"{args.decoder_sparse_step} is not a positive integer",
                          "use 1 for experts in every block, n for every n-th")
    return args


def moe_param_init(args: Qwen3MoeArgs):
    dense = qwen3.param_init(args)

    def rule(name: str) -> ParamInit:
        if name.endswith("experts.down_proj"):  # residual writers, like the dense down_proj
            return ParamInit.normal(0.02 / math.sqrt(2 * args.num_hidden_layers))
        return dense(name)
    return rule


def flops_per_token(args: Qwen3MoeArgs):
    """Qwen3's, counting the router and the experts a token meets in sparse blocks (chosen and shared)."""
    hidden = args.hidden_size
    sparse = sum(args.sparse(i) for i in range(args.num_hidden_layers))
    met = args.num_experts_per_tok + args.num_shared_experts
    experts = sparse * (hidden * args.num_experts + met * 3 * hidden * args.moe_intermediate_size)
    dense = (args.num_hidden_layers - sparse) * 3 * hidden * args.intermediate_size
    return qwen3.flops_per_token(args, experts + dense)


def hf_config(args: Qwen3MoeArgs) -> dict:
    options = tuple(name for name in OPTIONS if name not in OTHER_ROUTING)
    return {**qwen3.hf_config(args, options, "Qwen3MoeForCausalLM", "qwen3_moe"),
            "mlp_only_layers": list(args.mlp_only_layers)}


# Released checkpoints (and transformers before 5) store each expert's projections apart:
# model.layers.L.mlp.experts.E.gate_proj.weight (moe_intermediate x hidden), up_proj, down_proj.
EXPERT_PIECES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def expert_pieces(args: Qwen3MoeArgs):
    def pieces(name: str) -> list[list[str]] | None:
        block, _, projection = name.rpartition(".mlp.experts.")
        if not block or projection not in EXPERT_PIECES:
            return None
        return [[f"model.{block}.mlp.experts.{e}.{part}.weight" for part in EXPERT_PIECES[projection]]
                for e in range(args.num_experts)]
    return pieces


def from_hf(name: str) -> str | None:
    return None if PER_EXPERT.search(name) else qwen3.from_hf(name)


# What transformers' Qwen3MoeConfig takes for a key a config.json leaves out (head_dim: hidden_size over the heads,
# its attention's rule; RoPE: hf_rope_parameters). A file's other keys are not read: router_aux_loss_coef (transformers
# adds the balancing loss only with output_router_logits: training's choice, not the file's), DeepSeek-V3's routing.
HF_DEFAULTS = {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
               "intermediate_size": 6144, "vocab_size": 151936, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
               "max_position_embeddings": 32768, "num_experts": 128, "num_experts_per_tok": 8,
               "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}


def options_from_hf(config: Mapping[str, Any]) -> dict:
    """``model.*`` options reproducing a Hugging Face Qwen3-MoE config, each key it leaves out taken as transformers'
    Qwen3MoeConfig takes it (transformers 5 writes num_local_experts, which wins over 4's num_experts)."""
    config = {**config, "mlp_only_layers": config.get("mlp_only_layers") or []}  # null: none, as transformers reads it
    if "num_local_experts" in config:
        config["num_experts"] = config["num_local_experts"]
    options = qwen3.family_options_from_hf(config, HF_DEFAULTS, FAMILY)
    head_dim = options["hidden_size"] // options["num_attention_heads"]
    return options | qwen3.hf_values(config, {"head_dim": head_dim}, FAMILY)


def describe(args: Qwen3MoeArgs) -> ModelDescription:
    untied = not args.tie_word_embeddings
    return ModelDescription(
        family=FAMILY, args=args, n_layers=args.num_hidden_layers,
        param_init=moe_param_init(args), flops_per_token=flops_per_token(args),
        blocks="layers",
        inputs=("embed_tokens",) if untied else None, outputs=("norm", "lm_head") if untied else None,
        # Qwen3's (dense blocks); tensor parallel splits the tokens of the sparse blocks' mlp.
        tensor_parallel=qwen3.tensor_parallel_layout(args) if untied else None,
        attention=CORE_ATTENTION, position_buffers=("rope",),
        init_buffers=lambda part: init_buffers(part, args),
        float8_skip=("lm_head", "mlp.gate"), logits="lm_head" if untied else None,
        gated_mlp=SwiGLU.described_at("mlp"),  # the dense blocks' (mlp_only_layers)
        experts=ExpertsLayout(module="mlp.experts", count=args.num_experts, linears=("gate_up_proj", "down_proj"),
                              routed=args.num_experts_per_tok),
        # DeepSeek-V3's routing options compute what transformers' Qwen3-MoE does not: no HF folder claims it.
        hf=HFAdapter(config=hf_config(args), to_hf=qwen3.to_hf, from_hf=from_hf, options_from_hf=options_from_hf,
                     tied={"lm_head.weight": "embed_tokens.weight"} if untied else {},
                     pieces=expert_pieces(args)) if args.qwen3_routing else None,
    )


def init_buffers(part, args: Qwen3MoeArgs) -> None:
    part.rope.copy_(rope_table(args))
    init_routing_buffers(part)


class Qwen3MoePlugin(ExpertRouting):
    """The Qwen3-MoE model plugin of one run (the entry point names the class): the core's routing state and hooks
    (idle-expert counts a checkpoint keeps, the balancing bias, the load metrics) plus its model's description."""

    @hookimpl
    def describe_model(self, model_config, vocab_size, seq_len):
        """Qwen3-MoE: check the options; describe blocks, RoPE positions, the logits layer and HF names."""
        return describe(qwen3_moe_args(model_config, vocab_size, seq_len))

    @hookimpl
    def hf_model_options(self, hf_config):
        """Qwen3-MoE: the options of a Qwen3MoeForCausalLM config.json."""
        return options_from_hf(hf_config) if hf_config.get("model_type") == "qwen3_moe" else None

    @hookimpl
    def build_model(self, description):
        """Qwen3-MoE: the model of the described options."""
        return Qwen3Moe(description.args)
