"""The DeepSeek-V3 model plugin: its options (transformers' config names), its description and its HF names."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from titan_core import (CORE_ATTENTION, ConfigError, ExpertRouting, ExpertsLayout, HFAdapter, ModelDescription,
                        ParamInit, SwiGLU, TensorParallelLayout, check_hf_config, check_moe_options, check_positive,
                        hookimpl, init_routing_buffers, read_options)
from titan_deepseek_v3.model import DeepseekV3, DeepseekV3Args, rope_table

FAMILY = "deepseek_v3"
OPTIONS = tuple(f.name for f in dataclasses.fields(DeepseekV3Args) if f.name != "seq_len")
YARN = ("rope_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# transformers' names where they differ from ours (the experts' options take Qwen3-MoE's, shared by the core's MoE).
HF_NAMES = {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"}
# The core MoE's options for biased, clamped experts, which transformers' DeepSeek-V3 has not.
BIASED_CLAMPED_EXPERTS = ("router_bias", "expert_projection_bias", "expert_activation", "swiglu_alpha", "swiglu_limit")


# Sizes, counts, ranks and factors that must be positive numbers (null ones stay null).
POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size", "vocab_size", "rms_norm_eps",
            "rope_theta", "rope_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
            "max_position_embeddings")

def deepseek_v3_args(model_config, vocab_size: int, seq_len: int) -> DeepseekV3Args:
    args = DeepseekV3Args(**read_options(model_config, OPTIONS, "DeepSeek-V3", vocab_size), seq_len=seq_len)
    check_positive(args, POSITIVE, "DeepSeek-V3")
    check_moe_options(args)
    if args.qk_rope_head_dim % 2:
        raise ConfigError("model.qk_rope_head_dim", f"{args.qk_rope_head_dim} is odd and RoPE rotates pairs",
                          "use an even qk_rope_head_dim")
    if not 0 <= args.first_k_dense_replace <= args.num_hidden_layers:
        raise ConfigError("model.first_k_dense_replace", f"{args.first_k_dense_replace} dense blocks of "
                          f"{args.num_hidden_layers}", f"choose 0 to {args.num_hidden_layers}")
    if args.rope_scaling_factor < 1:
        raise ConfigError("model.rope_scaling_factor", f"{args.rope_scaling_factor} would shrink the context YaRN "
                          "stretches", "use 1.0 (plain RoPE) or more (DeepSeek-V3: 40)")
    return args


def param_init(args: DeepseekV3Args):
    def rule(name: str) -> ParamInit:
        if name.endswith(("norm.weight", "layernorm.weight")):
            return ParamInit.constant(1.0)
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):  # residual writers
            return ParamInit.normal(0.02 / math.sqrt(2 * args.num_hidden_layers))
        return ParamInit.normal(0.02)
    return rule


def flops_per_token(args: DeepseekV3Args):
    """Training FLOPs per token: 6 per weight a token meets (the experts it is routed to and the shared ones),
    plus the attention scores' (queries and keys qk_head_dim wide, values v_head_dim)."""
    hidden, heads = args.hidden_size, args.num_attention_heads
    query = (hidden * args.q_lora_rank + args.q_lora_rank * heads * args.qk_head_dim if args.q_lora_rank
             else hidden * heads * args.qk_head_dim)
    key_value = hidden * (args.kv_lora_rank + args.qk_rope_head_dim) + args.kv_lora_rank * heads * (
        args.qk_nope_head_dim + args.v_head_dim)
    attention = query + key_value + heads * args.v_head_dim * hidden
    met = args.num_experts_per_tok + args.num_shared_experts
    sparse = sum(args.sparse(i) for i in range(args.num_hidden_layers))
    feed_forward = (sparse * (hidden * args.num_experts + met * 3 * hidden * args.moe_intermediate_size)
                    + (args.num_hidden_layers - sparse) * 3 * hidden * args.intermediate_size)
    weights = args.num_hidden_layers * attention + feed_forward + hidden * args.vocab_size
    scores = 6 * args.num_hidden_layers * heads * (args.qk_head_dim + args.v_head_dim)
    return lambda seq_len: 6 * weights + scores * seq_len


def hf_config(args: DeepseekV3Args) -> dict:
    values = {HF_NAMES.get(name, name): getattr(args, name) for name in OPTIONS
              if name not in YARN and name not in BIASED_CLAMPED_EXPERTS and name not in (
                  "rope_theta", "score_function", "router_bias_update_rate", "router_aux_loss_coef")}
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor > 1:
        rope |= {"rope_type": "yarn", "factor": args.rope_scaling_factor,
                 **{name: getattr(args, name) for name in YARN[1:]}}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": FAMILY, "hidden_act": "silu",
            "attention_bias": False, "rope_interleave": True, "num_key_value_heads": args.num_attention_heads,
            **values, "max_position_embeddings": args.max_position_embeddings or args.seq_len, "rope_parameters": rope}


def options_from_hf(config: Mapping[str, Any]) -> dict:
    """``model.*`` options reproducing a Hugging Face DeepseekV3 config (transformers 5's rope_parameters or 4's
    rope_theta and rope_scaling)."""
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0),
                                             **(config.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    check_hf_config({**config, "rope_type": rope_type}, FAMILY, hidden_act=("silu",), attention_bias=(False,),
                    rope_interleave=(True,), rope_type=("default", "yarn"), scoring_func=("sigmoid",),
                    topk_method=("noaux_tc",))
    ours = {HF_NAMES.get(name, name): name for name in OPTIONS}
    options = {ours[key]: value for key, value in config.items() if key in ours and key not in YARN}
    options |= {"name": FAMILY, "rope_theta": rope["rope_theta"], "score_function": "sigmoid",
                "norm_topk_prob": config.get("norm_topk_prob", True)}
    if rope_type == "yarn":
        options |= {"rope_scaling_factor": rope["factor"], **yarn_options(rope)}
    return options


def yarn_options(rope: dict) -> dict:
    """YaRN's options as transformers reads a config's: beta_fast and beta_slow at 32 and 1 when absent or 0; the
    rotation's magnitude mscale's correction over mscale_all_dim's when both are set, else the plain one (mscale 1);
    the softmax scale carrying mscale_all_dim's correction only when it is set (0 here: none)."""
    field = "model.path"
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        key = "attention_factor" if rope.get("attention_factor") is not None else "truncate"
        raise ConfigError(field, f"config.json's YaRN sets {key}={rope[key]}, which titan-core's DeepSeek-V3 does not "
                          "compute", f"remove {key} from rope_parameters if the model was trained without it")
    mscale, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
    if all_dims and not mscale:
        raise ConfigError(field, f"config.json's YaRN sets mscale_all_dim={all_dims} without mscale, a magnitude "
                          "titan-core's DeepSeek-V3 does not compute", "set both, as DeepSeek-V3's release does")
    return {"original_max_position_embeddings": rope["original_max_position_embeddings"],
            "beta_fast": rope.get("beta_fast") or 32.0, "beta_slow": rope.get("beta_slow") or 1.0,
            "mscale": mscale if all_dims else 1.0, "mscale_all_dim": all_dims or 0.0}


def to_hf(name: str) -> str:
    name = name.replace(".gate.expert_bias", ".gate.e_score_correction_bias")
    return name if name == "lm_head.weight" else f"model.{name}"


PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")
# Released checkpoints store each expert's projections apart: model.layers.L.mlp.experts.E.gate_proj.weight, ...
EXPERT_PIECES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def from_hf(name: str) -> str | None:
    if PER_EXPERT.search(name) or not (name == "lm_head.weight" or name.startswith("model.")):
        return None
    return name.removeprefix("model.").replace(".gate.e_score_correction_bias", ".gate.expert_bias")


def expert_pieces(args: DeepseekV3Args):
    def pieces(name: str) -> list[list[str]] | None:
        block, _, projection = name.rpartition(".mlp.experts.")
        if not block or projection not in EXPERT_PIECES:
            return None
        return [[f"model.{block}.mlp.experts.{e}.{part}.weight" for part in EXPERT_PIECES[projection]]
                for e in range(args.num_experts)]
    return pieces


def transformers_routing(args: DeepseekV3Args) -> bool:
    """Whether transformers' DeepSeek-V3 computes what these options do (sigmoid scores, plain SwiGLU experts)."""
    return (args.score_function, args.router_bias, args.expert_projection_bias, args.expert_activation) == (
        "sigmoid", False, False, "silu")


def tensor_parallel_layout(args: DeepseekV3Args) -> TensorParallelLayout:
    """Heads split (the query's and the latent's up-projections by output, the output projection by input), the
    down-projections and their norms whole on every rank, the shared rotated key's gradient summed over ranks."""
    low_rank_query = ("self_attn.q_a_proj", "self_attn.q_a_layernorm") if args.q_lora_rank else ()
    return TensorParallelLayout(
        block_colwise=("self_attn.q_b_proj" if args.q_lora_rank else "self_attn.q_proj", "self_attn.kv_b_proj",
                       "mlp.gate_proj", "mlp.up_proj"),
        block_rowwise=("self_attn.o_proj", "mlp.down_proj"),
        block_norms=("input_layernorm", "post_attention_layernorm"), block_regions=("self_attn", "mlp"),
        embeddings=("embed_tokens",), final_norms=("norm",), output="lm_head",
        block_replicated=(*low_rank_query, "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm"),
        head_shared=("self_attn.rope_key",), divisible={"model.num_attention_heads": args.num_attention_heads})


def describe(args: DeepseekV3Args) -> ModelDescription:
    untied = not args.tie_word_embeddings
    return ModelDescription(
        family=FAMILY, args=args, n_layers=args.num_hidden_layers,
        param_init=param_init(args), flops_per_token=flops_per_token(args),
        blocks="layers",
        inputs=("embed_tokens",) if untied else None, outputs=("norm", "lm_head") if untied else None,
        tensor_parallel=tensor_parallel_layout(args) if untied else None,
        attention=CORE_ATTENTION, position_buffers=("rope",),
        init_buffers=lambda part: init_buffers(part, args),
        float8_skip=("lm_head", "mlp.gate"), logits="lm_head" if untied else None,
        gated_mlp=SwiGLU.described_at("mlp"),  # the dense blocks' (the first_k_dense_replace)
        experts=ExpertsLayout(module="mlp.experts", count=args.num_experts, linears=("gate_up_proj", "down_proj"),
                              routed=args.num_experts_per_tok),
        # transformers' DeepSeek-V3 routes by sigmoid scores, with the balancing bias it reads and never moves.
        hf=HFAdapter(config=hf_config(args), to_hf=to_hf, from_hf=from_hf, options_from_hf=options_from_hf,
                     tied={"lm_head.weight": "embed_tokens.weight"} if untied else {},
                     pieces=expert_pieces(args)) if transformers_routing(args) else None,
    )


def init_buffers(part, args: DeepseekV3Args) -> None:
    part.rope.copy_(rope_table(args))
    init_routing_buffers(part)


class DeepseekV3Plugin(ExpertRouting):
    """The DeepSeek-V3 model plugin of one run (the entry point names the class): the core's routing state and hooks
    (idle-expert counts a checkpoint keeps, the balancing bias, the load metrics) plus its model's description."""

    @hookimpl
    def describe_model(self, model_config, vocab_size, seq_len):
        """DeepSeek-V3: check the options; describe blocks, YaRN positions, experts, the logits layer, HF names."""
        return describe(deepseek_v3_args(model_config, vocab_size, seq_len))

    @hookimpl
    def hf_model_options(self, hf_config):
        """DeepSeek-V3: the options of a DeepseekV3ForCausalLM config.json."""
        return options_from_hf(hf_config) if hf_config.get("model_type") == FAMILY else None

    @hookimpl
    def build_model(self, description):
        """DeepSeek-V3: the model of the described options."""
        return DeepseekV3(description.args)
