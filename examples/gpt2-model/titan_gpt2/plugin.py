"""The GPT-2 model plugin: checks its own options and describes the model to titan-core's plugins."""

from __future__ import annotations

import math

from titan_core import (SDPA_CAUSAL, ConfigError, ModelDescription, ParamInit, TensorParallelLayout, hookimpl,
                        read_options)
from titan_gpt2.model import GPT2, GPT2Args

OPTIONS = ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size", "layer_norm_eps")


def gpt2_args(model_config, vocab_size: int, seq_len: int) -> GPT2Args:
    args = GPT2Args(**read_options(model_config, OPTIONS, "GPT-2", vocab_size), seq_len=seq_len)
    if args.n_embd % args.n_head:
        raise ConfigError("model.n_head", f"n_embd {args.n_embd} is not divisible by n_head {args.n_head}",
                          "choose n_head dividing model.n_embd")
    if seq_len > args.n_positions:
        raise ConfigError("training.seq_len", f"{seq_len} is longer than the {args.n_positions} learned positions",
                          "use a shorter seq_len or a larger model.n_positions")
    return args


def param_init(args: GPT2Args):
    def rule(name: str) -> ParamInit:
        if name.endswith(".bias"):
            return ParamInit.constant(0.0)
        if ".ln_" in name or name.startswith("transformer.ln_f"):
            return ParamInit.constant(1.0)
        if name.endswith("c_proj.weight"):  # GPT-2 scales the residual writers by depth
            return ParamInit.normal(0.02 / math.sqrt(2 * args.n_layer))
        return ParamInit.normal(0.02)
    return rule


def flops_per_token(args: GPT2Args):
    weights = args.n_layer * 12 * args.n_embd**2 + args.n_embd * args.vocab_size
    return lambda seq_len: 6 * weights + 12 * args.n_layer * args.n_embd * seq_len


@hookimpl
def describe_model(model_config, vocab_size, seq_len):
    """GPT-2: its blocks, split points, tensor-parallel layout and learned positions."""
    args = gpt2_args(model_config, vocab_size, seq_len)
    return ModelDescription(
        family="gpt2", args=args, n_layers=args.n_layer,
        param_init=param_init(args), flops_per_token=flops_per_token(args),
        blocks="transformer.h", inputs=("transformer.wte", "transformer.wpe"),
        outputs=("transformer.ln_f", "lm_head"),
        tensor_parallel=TensorParallelLayout(
            block_colwise=("attn.c_q", "attn.c_k", "attn.c_v", "mlp.c_fc"),
            block_rowwise=("attn.c_proj", "mlp.c_proj"),
            block_norms=("ln_1", "ln_2"), block_regions=("attn", "mlp"),
            embeddings=("transformer.wte", "transformer.wpe"), final_norms=("transformer.ln_f",),
            output="lm_head", divisible={"model.n_head": args.n_head}),
        attention=SDPA_CAUSAL, position_buffers=("positions",),
        init_buffers=lambda part: part.positions.copy_(part.positions.new_tensor(range(args.seq_len))),
        float8_skip=("lm_head",), logits="lm_head",
    )


@hookimpl
def build_model(description):
    """GPT-2: the module of the described options."""
    return GPT2(description.args)
