"""The gpt-oss model plugin: its options (transformers' config names), its description and its HF names."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from titan_core import (CORE_ATTENTION, ConfigError, ExpertRouting, ExpertsLayout, HFAdapter, ModelDescription,
                        ParamInit, StoredLayout, TensorParallelLayout, check_hf_config, check_moe_options,
                        check_positive, hookimpl, init_routing_buffers, read_options)
from titan_gpt_oss.model import LAYER_TYPES, GptOss, GptOssArgs, rope_table

FAMILY = "gpt_oss"
OPTIONS = tuple(f.name for f in dataclasses.fields(GptOssArgs) if f.name != "seq_len")
YARN = ("rope_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
# transformers' names where they differ from ours (the experts' options take the core MoE's).
HF_NAMES = {"num_experts": "num_local_experts", "moe_intermediate_size": "intermediate_size"}
# What transformers' gpt-oss computes of the core's routing options; other values leave the model without HF folders.
HF_ROUTING = {"score_function": "softmax", "norm_topk_prob": True, "num_shared_experts": 0,
              "router_bias_update_rate": 0.0, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
              "router_bias": True, "expert_projection_bias": True, "expert_activation": "clamped_swiglu"}
# The file's arrangement of the experts' stacks: (experts, in, out), the gate and up projections interleaved.
STORED = {"experts.gate_up_proj": StoredLayout((0, 2, 1), interleaved=1),
          "experts.gate_up_proj_bias": StoredLayout((0, 1), interleaved=1),
          "experts.down_proj": StoredLayout((0, 2, 1))}


# Sizes, counts, ranks and factors that must be positive numbers (null ones stay null).
POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "sliding_window", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling_factor",
            "original_max_position_embeddings", "beta_fast", "beta_slow", "max_position_embeddings")

def gpt_oss_args(model_config, vocab_size: int, seq_len: int) -> GptOssArgs:
    options = read_options(model_config, OPTIONS, "gpt-oss", vocab_size)
    if options.get("layer_types") is not None:
        options["layer_types"] = tuple(options["layer_types"])
    args = GptOssArgs(**options, seq_len=seq_len)
    check_positive(args, POSITIVE, "gpt-oss")
    check_moe_options(args)
    if args.num_attention_heads % args.num_key_value_heads:
        raise ConfigError("model.num_key_value_heads", f"{args.num_key_value_heads} key-value heads do not divide "
                          f"{args.num_attention_heads} query heads", "use a divisor of model.num_attention_heads")
    if args.head_dim % 2:
        raise ConfigError("model.head_dim", f"{args.head_dim} is odd and RoPE rotates halves", "use an even head_dim")
    if args.layer_types is not None and (len(args.layer_types) != args.num_hidden_layers
                                         or not set(args.layer_types) <= set(LAYER_TYPES)):
        raise ConfigError("model.layer_types", f"{list(args.layer_types)} is not one of {'/'.join(LAYER_TYPES)} per "
                          f"block for {args.num_hidden_layers} blocks", "list one per block, or null to alternate")
    if args.sliding_window < 1:
        raise ConfigError("model.sliding_window", f"a window of {args.sliding_window} tokens sees nothing",
                          "use 1 or more (gpt-oss: 128)")
    if args.rope_scaling_factor < 1:
        raise ConfigError("model.rope_scaling_factor", f"{args.rope_scaling_factor} would shrink the context YaRN "
                          "stretches", "use 1.0 (plain RoPE) or more (gpt-oss: 32)")
    return args


def param_init(args: GptOssArgs):
    def rule(name: str) -> ParamInit:
        if name.endswith(("norm.weight", "layernorm.weight")):
            return ParamInit.constant(1.0)
        if name.endswith("bias"):
            return ParamInit.constant(0.0)
        if name.endswith(("o_proj.weight", "experts.down_proj")):  # residual writers
            return ParamInit.normal(0.02 / math.sqrt(2 * args.num_hidden_layers))
        return ParamInit.normal(0.02)  # the sinks too, as transformers draws them
    return rule


def flops_per_token(args: GptOssArgs):
    """Training FLOPs per token: 6 per weight a token meets (the router, its experts), plus the attention scores'
    over the keys each block lets it see (a sliding block: at most its window)."""
    hidden, heads, head_dim = args.hidden_size, args.num_attention_heads, args.head_dim
    attention = hidden * head_dim * (2 * heads + 2 * args.num_key_value_heads)
    experts = hidden * args.num_experts + args.num_experts_per_tok * 3 * hidden * args.moe_intermediate_size
    weights = args.num_hidden_layers * (attention + experts) + hidden * args.vocab_size
    windows = [args.window(layer) for layer in range(args.num_hidden_layers)]
    return lambda seq_len: 6 * weights + 12 * heads * head_dim * sum(min(w or seq_len, seq_len) for w in windows)


def hf_config(args: GptOssArgs) -> dict:
    values = {HF_NAMES.get(name, name): getattr(args, name) for name in OPTIONS
              if name not in YARN and name not in HF_ROUTING and name not in ("rope_theta", "layer_types",
                                                                               "router_aux_loss_coef")}
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor > 1:
        rope |= {"rope_type": "yarn", "factor": args.rope_scaling_factor, "truncate": False,
                 **{name: getattr(args, name) for name in YARN[1:]}}
    return {"architectures": ["GptOssForCausalLM"], "model_type": FAMILY, "hidden_act": "silu",
            **values, "max_position_embeddings": args.max_position_embeddings or args.seq_len,
            "layer_types": [args.layer_type(layer) for layer in range(args.num_hidden_layers)],
            "rope_parameters": rope}


def options_from_hf(config: Mapping[str, Any]) -> dict:
    """``model.*`` options reproducing a Hugging Face GptOss config (transformers 5's rope_parameters or 4's
    rope_theta and rope_scaling)."""
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 150000.0),
                                             **(config.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    quantization = (config.get("quantization_config") or {}).get("quant_method")
    if quantization is not None:
        # OpenAI's release stores the experts in MXFP4 blocks and scales; the model trains bf16 or fp32 weights.
        raise ConfigError("model.path", f"config.json's experts are quantized ({quantization}), which gpt-oss reads "
                          "only dequantized", "save a dequantized copy first (transformers: from_pretrained with "
                          "Mxfp4Config(dequantize=True), then save_pretrained)")
    check_hf_config({**config, "rope_type": rope_type, "truncate": rope.get("truncate", True)}, FAMILY,
                    hidden_act=("silu",), rope_type=("default", "yarn"),
                    truncate=(False,) if rope_type == "yarn" else (True, False))
    ours = {HF_NAMES.get(name, name): name for name in OPTIONS}
    options = {ours[key]: value for key, value in config.items()
               if key in ours and key not in YARN and key != "router_aux_loss_coef"}
    options |= {"name": FAMILY, "rope_theta": rope["rope_theta"], **HF_ROUTING}
    if options.get("layer_types") is not None:
        options["layer_types"] = list(options["layer_types"])
    if rope_type == "yarn":
        # transformers' YaRN: the betas at 32 and 1 when absent or 0; the magnitude the plain correction unless
        # mscale and mscale_all_dim (or attention_factor) say otherwise, which this model does not compute.
        uncomputed = [key for key in ("attention_factor", "mscale", "mscale_all_dim") if rope.get(key) is not None]
        if uncomputed:
            raise ConfigError("model.path", f"config.json's YaRN sets {uncomputed[0]}={rope[uncomputed[0]]}, which "
                              "titan-core's gpt-oss does not compute", f"remove {uncomputed[0]} from rope_parameters "
                              "if the model was trained without it")
        options |= {"rope_scaling_factor": rope["factor"],
                    "original_max_position_embeddings": rope["original_max_position_embeddings"],
                    "beta_fast": rope.get("beta_fast") or 32.0, "beta_slow": rope.get("beta_slow") or 1.0}
    return options


def to_hf(name: str) -> str:
    name = name.replace(".mlp.gate.", ".mlp.router.")
    return name if name == "lm_head.weight" else f"model.{name}"


def from_hf(name: str) -> str | None:
    if not (name == "lm_head.weight" or name.startswith("model.")):
        return None
    return name.removeprefix("model.").replace(".mlp.router.", ".mlp.gate.")


def stored(name: str) -> StoredLayout | None:
    return STORED.get(name.rpartition(".mlp.")[2])


def tensor_parallel_layout(args: GptOssArgs) -> TensorParallelLayout:
    """Heads split (queries, keys, values by output, the output projection by input, each head's sink with it); the
    experts' sub-layer splits its tokens instead (the core's MoE)."""
    return TensorParallelLayout(
        block_colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        block_rowwise=("self_attn.o_proj",),
        block_norms=("input_layernorm", "post_attention_layernorm"), block_regions=("self_attn", "mlp"),
        embeddings=("embed_tokens",), final_norms=("norm",), output="lm_head",
        head_parameters=("self_attn.sinks",),
        divisible={"model.num_attention_heads": args.num_attention_heads,
                   "model.num_key_value_heads": args.num_key_value_heads})


def describe(args: GptOssArgs) -> ModelDescription:
    untied = not args.tie_word_embeddings
    hf_routing = all(getattr(args, name) == value for name, value in HF_ROUTING.items())
    return ModelDescription(
        family=FAMILY, args=args, n_layers=args.num_hidden_layers,
        param_init=param_init(args), flops_per_token=flops_per_token(args),
        blocks="layers",
        inputs=("embed_tokens",) if untied else None, outputs=("norm", "lm_head") if untied else None,
        tensor_parallel=tensor_parallel_layout(args) if untied else None,
        attention=CORE_ATTENTION, position_buffers=("rope",),
        init_buffers=lambda part: init_buffers(part, args),
        float8_skip=("lm_head", "mlp.gate"), logits="lm_head" if untied else None,
        experts=ExpertsLayout(module="mlp.experts", count=args.num_experts, linears=("gate_up_proj", "down_proj"),
                              routed=args.num_experts_per_tok),
        hf=HFAdapter(config=hf_config(args), to_hf=to_hf, from_hf=from_hf, options_from_hf=options_from_hf,
                     tied={"lm_head.weight": "embed_tokens.weight"} if untied else {},
                     stored=stored) if hf_routing else None,
    )


def init_buffers(part, args: GptOssArgs) -> None:
    part.rope.copy_(rope_table(args))
    init_routing_buffers(part)


class GptOssPlugin(ExpertRouting):
    """The gpt-oss model plugin of one run (the entry point names the class): the core's routing state and hooks
    (idle-expert counts a checkpoint keeps, the load metrics) plus its model's description."""

    @hookimpl
    def describe_model(self, model_config, vocab_size, seq_len):
        """gpt-oss: check the options; describe blocks, YaRN positions, sinks, experts, the logits layer, HF names."""
        return describe(gpt_oss_args(model_config, vocab_size, seq_len))

    @hookimpl
    def hf_model_options(self, hf_config):
        """gpt-oss: the options of a GptOssForCausalLM config.json."""
        return options_from_hf(hf_config) if hf_config.get("model_type") == FAMILY else None

    @hookimpl
    def build_model(self, description):
        """gpt-oss: the model of the described options."""
        return GptOss(description.args)
