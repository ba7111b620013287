"""The Qwen3 model plugin: its options (Hugging Face's config names), its description, its HF names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import math
from dataclasses import fields

from titan_core import (CORE_ATTENTION, ConfigError, HFAdapter, ModelDescription, ParamInit, SwiGLU,
                        TensorParallelLayout, check_hf_config, check_positive, hf_rope_parameters, hookimpl, read_options)
from titan_qwen3.model import Qwen3, Qwen3Args, rope_table

FAMILY = "qwen3"
OPTIONS = tuple(f.name for f in fields(Qwen3Args) if f.name != "seq_len")


# Sizes, counts, ranks and factors that must be positive numbers (null ones stay null).
POSITIVE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings")

def qwen3_args(model_config, vocab_size: int, seq_len: int) -> Qwen3Args:
    args = Qwen3Args(**read_options(model_config, OPTIONS, "Qwen3", vocab_size), seq_len=seq_len)
    check_positive(args, POSITIVE, "Qwen3")
    check_attention_shape(args)
    return args


def check_attention_shape(args: Qwen3Args) -> None:
    if args.num_attention_heads % args.num_key_value_heads:
        raise ConfigError("model.num_key_value_heads", f"{args.num_key_value_heads} does not divide "
                          f"num_attention_heads {args.num_attention_heads}", "choose a divisor of num_attention_heads")
    if args.head_dim % 2:
        raise ConfigError("model.head_dim", f"{args.head_dim} is odd and RoPE rotates its two halves",
                          "use an even head_dim")


def param_init(args: Qwen3Args):
    def rule(name: str) -> ParamInit:
        if name.endswith("norm.weight"):
            return ParamInit.constant(1.0)
        if name.endswith(("o_proj.weight", "down_proj.weight")):  # residual writers, scaled down with depth
            return ParamInit.normal(0.02 / math.sqrt(2 * args.num_hidden_layers))
        return ParamInit.normal(0.02)
    return rule


def flops_per_token(args: Qwen3Args, feed_forward_weights: int | None = None):
    """Training FLOPs per token: 6 per weight a token meets, plus attention's. ``feed_forward_weights`` (all
    blocks) defaults to the dense SwiGLU's; a mixture of experts counts the experts a token meets."""
    if feed_forward_weights is None:
        feed_forward_weights = args.num_hidden_layers * 3 * args.hidden_size * args.intermediate_size
    attention = args.hidden_size * args.head_dim * 2 * (args.num_attention_heads + args.num_key_value_heads)
    weights = args.num_hidden_layers * attention + feed_forward_weights + args.hidden_size * args.vocab_size
    attention_scores = 12 * args.num_hidden_layers * args.num_attention_heads * args.head_dim
    return lambda seq_len: 6 * weights + attention_scores * seq_len


def hf_config(args: Qwen3Args, options=OPTIONS, architecture: str = "Qwen3ForCausalLM",
              model_type: str = "qwen3") -> dict:
    values = {name: getattr(args, name) for name in options}
    return {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
            "attention_bias": False, **values, "max_position_embeddings": args.max_position_embeddings or args.seq_len,
            # transformers 5 reads rope_parameters; earlier versions rope_theta.
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta}}


# What transformers' Qwen3Config takes for a key a config.json leaves out (num_key_value_heads null: the heads; RoPE:
# hf_rope). A file's other keys are not Qwen3's options.
HF_DEFAULTS = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
               "head_dim": 128, "intermediate_size": 22016, "vocab_size": 151936, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": False, "max_position_embeddings": 32768}


def hf_values(config: Mapping[str, Any], defaults: dict, family: str) -> dict:
    """The value of each key of ``defaults`` in ``config``, transformers' default when it is left out; a null one is
    refused, as transformers' config class refuses it."""
    null = next((key for key in defaults if key in config and config[key] is None), None)
    if null is not None:
        raise ConfigError("model.path", f"config.json sets {null}=null, which transformers' {family} config refuses "
                          "too", f"set {null} or leave it out (then {defaults[null]})")
    return {key: config.get(key, default) for key, default in defaults.items()}


def family_options_from_hf(config: Mapping[str, Any], defaults: dict, family: str) -> dict:
    """``model.*`` options reproducing a Hugging Face config of the Qwen3 family, each key of ``defaults`` it leaves
    out taken as transformers' config class takes it (``defaults``: that class's)."""
    rope = hf_rope_parameters(config)
    check_hf_config({**config, "rope_type": rope["rope_type"]}, family, hidden_act=("silu",),
                    attention_bias=(False,), use_sliding_window=(False,), rope_type=("default",))
    return {"name": family, **hf_values(config, defaults, family), "rope_theta": rope["rope_theta"]}


def options_from_hf(config: Mapping[str, Any]) -> dict:
    """``model.*`` options reproducing a Hugging Face Qwen3 config (num_key_value_heads null: as many as the heads,
    as Qwen3Config reads it)."""
    if "num_key_value_heads" in config and config["num_key_value_heads"] is None:
        heads = config.get("num_attention_heads", HF_DEFAULTS["num_attention_heads"])
        config = {**config, "num_key_value_heads": heads}
    return family_options_from_hf(config, HF_DEFAULTS, FAMILY)


def to_hf(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"


def from_hf(name: str) -> str | None:
    return name if name == "lm_head.weight" else name.removeprefix("model.") if name.startswith("model.") else None


@hookimpl
def describe_model(model_config, vocab_size, seq_len):
    """Qwen3: check the options; describe blocks, TP layout (QK-norm per head), RoPE positions, HF names."""
    return describe(qwen3_args(model_config, vocab_size, seq_len))


def tensor_parallel_layout(args: Qwen3Args) -> TensorParallelLayout:
    return TensorParallelLayout(
        block_colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        block_rowwise=("self_attn.o_proj", "mlp.down_proj"), head_norms=("self_attn.q_norm", "self_attn.k_norm"),
        block_norms=("input_layernorm", "post_attention_layernorm"), block_regions=("self_attn", "mlp"),
        embeddings=("embed_tokens",), final_norms=("norm",), output="lm_head",
        divisible={"model.num_attention_heads": args.num_attention_heads,
                   "model.num_key_value_heads": args.num_key_value_heads})


def describe(args: Qwen3Args) -> ModelDescription:
    untied = not args.tie_word_embeddings  # a tied output layer is the embedding: no split point, no TP layout
    return ModelDescription(
        family=FAMILY, args=args, n_layers=args.num_hidden_layers,
        param_init=param_init(args), flops_per_token=flops_per_token(args),
        blocks="layers",
        inputs=("embed_tokens",) if untied else None, outputs=("norm", "lm_head") if untied else None,
        tensor_parallel=tensor_parallel_layout(args) if untied else None,
        attention=CORE_ATTENTION, position_buffers=("rope",),
        init_buffers=lambda part: part.rope.copy_(rope_table(args)),
        float8_skip=("lm_head",), logits="lm_head" if untied else None,
        gated_mlp=SwiGLU.described_at("mlp"),
        hf=HFAdapter(config=hf_config(args), to_hf=to_hf, from_hf=from_hf, options_from_hf=options_from_hf,
                     tied={"lm_head.weight": "embed_tokens.weight"} if untied else {}),
    )


@hookimpl
def hf_model_options(hf_config):
    """Qwen3: the options of a Qwen3ForCausalLM config.json."""
    return options_from_hf(hf_config) if hf_config.get("model_type") == "qwen3" else None


@hookimpl
def build_model(description):
    """Qwen3: the model of the described options."""
    return Qwen3(description.args)
