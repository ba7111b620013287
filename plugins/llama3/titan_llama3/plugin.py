"""The Llama 3 model plugin: its options, its description for the parallelism plugins, its HF names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import math

from titan_core import (CORE_ATTENTION, ConfigError, GatedMLP, HFAdapter, ModelDescription, ParamInit,
                        TensorParallelLayout, check_hf_config, check_positive, hf_rope_parameters, hookimpl, read_options)
from titan_llama3.model import LlamaArgs, Transformer, rope_frequencies

FAMILY = "llama3"
BLOCK_NAMES = {  # titan-core name inside a block -> Hugging Face name inside model.layers.<i>
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
OUTER_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}


# Sizes, counts, ranks and factors that must be positive numbers (null ones stay null).
POSITIVE = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier", "norm_eps",
            "rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
            "rope_original_max_positions", "max_position_embeddings")

def llama_args(model_config, vocab_size: int, seq_len: int) -> LlamaArgs:
    """The model arguments of ``config.model``, checked: shapes that divide, a vocabulary that fits."""
    if "max_seq_len" in model_config:
        raise ConfigError("model.max_seq_len", "is derived from training.seq_len", "set training.seq_len instead")
    known = set(LlamaArgs.__dataclass_fields__) - {"max_seq_len"}
    args = LlamaArgs(**read_options(model_config, known, "Llama 3", vocab_size), max_seq_len=seq_len)
    check_positive(args, POSITIVE, "Llama 3")
    if args.dim % args.n_heads:
        raise ConfigError("model.n_heads", f"dim {args.dim} is not divisible by n_heads {args.n_heads}",
                          "choose n_heads dividing model.dim")
    if args.head_dim % 2:
        raise ConfigError("model.n_heads", f"head dim {args.head_dim} is odd and RoPE rotates its two halves",
                          "choose n_heads so that dim / n_heads is even")
    if args.n_heads % args.kv_heads:
        raise ConfigError("model.n_kv_heads", f"n_heads {args.n_heads} is not divisible by n_kv_heads {args.kv_heads}",
                          "choose n_kv_heads dividing model.n_heads")
    return args


def param_init(args: LlamaArgs):
    def rule(name: str) -> ParamInit:
        if name.endswith("norm.weight"):
            return ParamInit.constant(1.0)
        if name == "tok_embeddings.weight":
            return ParamInit.normal(1.0)
        if name == "output.weight":
            return ParamInit.normal(args.dim ** -0.5)
        if name.endswith(("wo.weight", "w2.weight")):
            # Residual-stream writers are scaled down with depth so the stream's variance stays put.
            return ParamInit.normal(0.02 / math.sqrt(2 * args.n_layers))
        return ParamInit.normal(0.02)
    return rule


def flops_per_token(args: LlamaArgs):
    """Training FLOPs per token: 6 per non-embedding weight plus the attention score and value matmuls
    (counted without the causal half, as the MFU figures of other trainers are)."""
    n_dense = args.n_layers * (2 * args.dim * args.dim + 2 * args.dim * args.kv_heads * args.head_dim
                               + 3 * args.dim * args.ffn_hidden_dim) + args.dim * args.vocab_size
    return lambda seq_len: 6 * n_dense + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def hf_config(args: LlamaArgs) -> dict:
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor is not None:
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, "factor": args.rope_scaling_factor,
                "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
                "original_max_position_embeddings": args.rope_original_max_positions}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps, "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_position_embeddings or args.max_seq_len,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        # transformers 5 reads rope_parameters; earlier versions rope_theta and rope_scaling.
        "rope_parameters": rope, "rope_theta": args.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if args.rope_scaling_factor else None,
    }


# What transformers' LlamaConfig takes for a key a config.json leaves out (num_key_value_heads and head_dim, absent or
# null: from the heads; RoPE: hf_rope_parameters).
HF_DEFAULTS = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
               "vocab_size": 32000, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}
LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor")  # transformers requires each of a llama3 RoPE


def hf_values(config: Mapping[str, Any]) -> dict:
    """``config`` with transformers' default for each key of HF_DEFAULTS it leaves out; a null one is refused, as
    transformers refuses it."""
    null = next((key for key in HF_DEFAULTS if key in config and config[key] is None), None)
    if null is not None:
        raise ConfigError("model.path", f"config.json sets {null}=null, which transformers' LlamaConfig refuses too",
                          f"set {null} or leave it out (then {HF_DEFAULTS[null]})")
    return {**HF_DEFAULTS, **config}


def scaling_options(rope: dict, max_position_embeddings: int) -> dict:
    """A llama3 RoPE's options: factor and the two frequency factors required, as transformers requires them; the
    original context transformers' default, the file's max_position_embeddings."""
    missing = [key for key in LLAMA3_SCALING if rope.get(key) is None]
    if missing:
        raise ConfigError("model.path", f"config.json's llama3 RoPE lacks {missing[0]}, which transformers requires "
                          "too", f"set rope_parameters.{missing[0]} as the model was trained")
    return {"rope_scaling_factor": rope["factor"], "rope_low_freq_factor": rope["low_freq_factor"],
            "rope_high_freq_factor": rope["high_freq_factor"],
            "rope_original_max_positions": rope.get("original_max_position_embeddings") or max_position_embeddings}


def options_from_hf(config: Mapping[str, Any]) -> dict:
    """``model.*`` options reproducing a Hugging Face Llama config, each key it leaves out taken as transformers'
    LlamaConfig takes it."""
    if config.get("model_type") != "llama":
        raise ConfigError("model.name", f"config.json is model_type '{config.get('model_type')}', not llama",
                          "import it with the model plugin of its family")
    config, rope = hf_values(config), hf_rope_parameters(config)
    heads = config["num_attention_heads"]
    check_hf_config({**config, "rope_type": rope["rope_type"]}, "Llama 3",
                    hidden_act=("silu",), attention_bias=(False,), mlp_bias=(False,), rope_type=("default", "llama3"),
                    head_dim=(None, config["hidden_size"] // heads))
    intermediate = config["intermediate_size"]
    scaling = scaling_options(rope, config["max_position_embeddings"]) if rope["rope_type"] == "llama3" else {}
    return {
        "name": FAMILY, "dim": config["hidden_size"], "n_layers": config["num_hidden_layers"],
        "n_heads": heads, "n_kv_heads": config.get("num_key_value_heads"), "vocab_size": config["vocab_size"],
        # One multiple equal to the hidden size itself reproduces it exactly whatever rounding made it.
        "multiple_of": intermediate, "ffn_dim_multiplier": intermediate / int(2 * 4 * config["hidden_size"] / 3),
        "norm_eps": config["rms_norm_eps"], "rope_theta": rope["rope_theta"], "rope_scaling_factor": None,
        **scaling, "max_position_embeddings": config["max_position_embeddings"],
    }


def to_hf(name: str) -> str:
    if name in OUTER_NAMES:
        return OUTER_NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{BLOCK_NAMES[rest]}"


def from_hf(name: str) -> str | None:
    outer = {hf: titan for titan, hf in OUTER_NAMES.items()}
    if name in outer:
        return outer[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        titan = {hf: t for t, hf in BLOCK_NAMES.items()}.get(parts[3])
        return f"layers.{parts[2]}.{titan}" if titan else None
    return None


@hookimpl
def describe_model(model_config, vocab_size, seq_len):
    """Llama 3: check the options, and describe blocks, TP layout, RoPE positions and HF names."""
    return describe(llama_args(model_config, vocab_size, seq_len))


def describe(args: LlamaArgs) -> ModelDescription:
    return ModelDescription(
        family=FAMILY, args=args, n_layers=args.n_layers,
        param_init=param_init(args), flops_per_token=flops_per_token(args),
        blocks="layers", inputs=("tok_embeddings",), outputs=("norm", "output"),
        tensor_parallel=TensorParallelLayout(
            block_colwise=("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
            block_rowwise=("attention.wo", "feed_forward.w2"),
            block_norms=("attention_norm", "ffn_norm"), block_regions=("attention", "feed_forward"),
            embeddings=("tok_embeddings",), final_norms=("norm",), output="output",
            divisible={"model.n_heads": args.n_heads, "model.n_kv_heads": args.kv_heads}),
        attention=CORE_ATTENTION, position_buffers=("rope",),
        init_buffers=lambda part: part.rope.copy_(rope_frequencies(args)),
        float8_skip=("output",), logits="output", gated_mlp=GatedMLP("feed_forward", gate="w1", up="w3", down="w2"),
        hf=HFAdapter(config=hf_config(args), to_hf=to_hf, from_hf=from_hf, options_from_hf=options_from_hf,
                     tied={"output.weight": "tok_embeddings.weight"}),
    )


@hookimpl
def hf_model_options(hf_config):
    """Llama 3: the options of a LlamaForCausalLM config.json."""
    return options_from_hf(hf_config) if hf_config.get("model_type") == "llama" else None


@hookimpl
def build_model(description):
    """Llama 3: the Transformer of the described options."""
    return Transformer(description.args)

