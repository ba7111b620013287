"""The transformers backend: any causal language model transformers builds, described to titan-core without a line
per architecture.

``model=transformers model.path=<folder>`` reads the folder's config.json into ``model.config`` and trains
transformers' own module (:mod:`titan_transformers.model`). What the description offers comes from the module tree
and transformers' metadata: the decoder layers are the blocks (fsdp, ac, compile units), every linear but the output
is float8's and LoRA's to convert, the output layer is the chunked loss's to take over when no soft-capping follows
it. What the backend does not describe yet (a tensor-parallel layout, pipeline split points, the attention seam
context parallel needs) is None, so those plugins refuse the model before launch, naming its architecture.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from collections.abc import Callable, Mapping
from typing import Any

import torch
import transformers
from omegaconf import OmegaConf
from torch import nn

from titan_core import (SDPA_CAUSAL, ConfigError, GatedMLP, HFAdapter, ModelDescription, ParamInit,
                        TensorParallelLayout, canonical_name, hookimpl, read_options)
from titan_transformers.model import CAUSAL, build, causal_lm_base, stage_modules

FAMILY = "transformers"
DTYPE_FIELDS = ("dtype", "torch_dtype")  # how a folder stores its weights, not what the model computes


def hf_options(hf_config: Mapping[str, Any]) -> dict:
    """``model.*`` options reproducing a config.json: the whole file but its dtype."""
    return {"name": FAMILY, "config": {key: value for key, value in hf_config.items() if key not in DTYPE_FIELDS}}


def transformers_config(model_config) -> transformers.PretrainedConfig:
    """transformers' config of ``model.config``, checked to name a causal language model it builds."""
    read_options(model_config, ("config",), FAMILY, 0)
    if model_config.get("config") is None:
        raise ConfigError("model.path", "model=transformers builds the model of a Hugging Face folder's config.json "
                          "and none is named", "set model.path=<folder>")
    fields = OmegaConf.to_container(model_config.config, resolve=True)
    assert isinstance(fields, dict)
    model_type = fields.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != "model_type"})
    except (ValueError, KeyError) as error:
        raise ConfigError("model.path", f"config.json's model_type {model_type!r} is not a model the installed "
                          f"transformers {transformers.__version__} builds ({error})",
                          "upgrade transformers, or start from another folder") from None
    if type(config) not in transformers.AutoModelForCausalLM._model_mapping:
        raise ConfigError("model.path", f"config.json's model_type {model_type!r} is not a causal language model in "
                          f"transformers {transformers.__version__}", "start from a causal language model's folder")
    # Causal SDPA without a mask where every layer attends so (what context parallel rings), else transformers' SDPA
    # with its masks (sliding windows); never eager, which materializes the scores.
    config._attn_implementation = CAUSAL if causal_sdpa(config.get_text_config()) else "sdpa"
    if config.get_text_config().tie_word_embeddings:
        raise ConfigError("model.path", f"{architecture(config)} ties its output layer to its embeddings "
                          "(tie_word_embeddings=true), which the transformers backend does not train: each rank's "
                          "copy of the two would part", "start from an untied folder, or from the family's own "
                          "model plugin when one is installed")
    return config


def architecture(config: transformers.PretrainedConfig) -> str:
    return causal_lm_base(config).__name__


def param_init(model: nn.Module, std: float) -> Callable[[str], ParamInit]:
    """Each parameter's start, as transformers' ``_init_weights`` draws it: N(0, initializer_range) for linears and
    embeddings (their padding row drawn too), zero biases, and the constant it gives every other module (norms:
    ones, or zeros where the norm scales by 1 + weight), read from it on a copy of that module. A parameter a
    conversion adds (LoRA's factors, which their plugin then sets) is drawn as a linear's weight."""
    rules: dict[str, ParamInit] = {}
    for path, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)):
            rules |= {f"{path}.{name}": ParamInit.normal(std) if name == "weight" else ParamInit.constant(0.0)
                      for name in own}
            continue
        probe = copy.deepcopy(module).to_empty(device="cpu")
        with torch.no_grad():
            for param in probe.parameters():
                param.fill_(float("nan"))
            model._init_weights(probe)
        for name, param in probe.named_parameters(recurse=False):
            values = param.detach().unique()
            if len(values) != 1 or values.isnan().any():
                raise ConfigError("model.path", f"{architecture(model.config)}'s {path}.{name} starts other than as a "
                                  "constant, which the transformers backend cannot draw", "start from another folder")
            rules[f"{path}.{name}"] = ParamInit.constant(values.item())
    return lambda name: rules.get(name, ParamInit.normal(std))


def flops_per_token(model: nn.Module, config: transformers.PretrainedConfig) -> Callable[[int], float]:
    """6 per weight that multiplies (all but the input embeddings) plus the attention's score and value products
    over the whole sequence (no window, no causal half), as the native models count them."""
    embeddings = model.get_input_embeddings().weight.numel()
    weights = sum(param.numel() for param in model.parameters()) - embeddings
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_position = 12 * text.num_hidden_layers * text.num_attention_heads * head_dim
    return lambda seq_len: 6 * weights + per_position * seq_len


def init_buffers(buffers: dict[str, torch.Tensor]) -> Callable[[nn.Module], None]:
    """Refill a part's buffers with the values its constructor computed."""
    def fill(part: nn.Module) -> None:
        for name, buffer in part.named_buffers():
            buffer.copy_(buffers[canonical_name(name)])
    return fill


@dataclass(frozen=True)
class BackendArgs:
    """What the backend builds: transformers' config, and the training sequence's length (its positions)."""

    config: transformers.PretrainedConfig
    seq_len: int


def causal_sdpa(text: transformers.PretrainedConfig) -> bool:
    """Whether every layer attends through causal SDPA without a mask (no sliding window, no soft-capped scores),
    the attention context parallel rings."""
    layer_types = getattr(text, "layer_types", None)
    windowed = (any(kind != "full_attention" for kind in layer_types) if layer_types is not None
                else getattr(text, "sliding_window", None) is not None)
    return not windowed and getattr(text, "attn_logit_softcapping", None) is None


def describe(model_config, vocab_size: int, seq_len: int) -> ModelDescription:
    config = transformers_config(model_config)
    text = config.get_text_config()
    if vocab_size > text.vocab_size:
        raise ConfigError("model.vocab_size", f"the tokenizer's {vocab_size} ids exceed the model's {text.vocab_size}",
                          "take the folder's tokenizer (drop tokenizer.path), or one of at most "
                          f"{text.vocab_size} ids")
    with torch.device("meta"):
        model, buffers = build(config, seq_len)
    names = {name for name, _ in model.named_parameters()}
    output = "lm_head" if isinstance(model.get_output_embeddings(), nn.Linear) else None
    # A soft-capping after the output layer would squash a pipeline stage's residual stream too.
    capped = getattr(text, "final_logit_softcapping", None) is not None
    inputs, outputs = stage_modules(config) or (None, None)
    return ModelDescription(
        family=f"{FAMILY}:{architecture(config)}", args=BackendArgs(config, seq_len), n_layers=text.num_hidden_layers,
        param_init=param_init(model, text.initializer_range), flops_per_token=flops_per_token(model, config),
        blocks=f"{decoder_path(model)}.layers", inputs=inputs, outputs=None if capped else outputs,
        init_buffers=init_buffers(buffers), attention=SDPA_CAUSAL if config._attn_implementation == CAUSAL else None,
        position_buffers=("positions",),
        tensor_parallel=tensor_parallel(model, config, inputs, outputs) if output else None,
        float8_skip=(output,) if output else (), logits=None if capped else output, gated_mlp=gated_mlp(model, text),
        hf=HFAdapter(config=hf_options(OmegaConf.to_container(model_config.config))["config"], to_hf=lambda n: n,
                     from_hf=lambda n: n if n in names else None, options_from_hf=hf_options),
    )


# transformers' tensor-parallel styles that are titan-core's: split by output features, by input features, and a
# per-head norm whose weight every rank keeps whole (its gradient summed over them).
SPLITS = {"colwise": "block_colwise", "rowwise": "block_rowwise", "replicated_with_grad_allreduce": "head_norms"}


def tensor_parallel(model: nn.Module, config: transformers.PretrainedConfig, inputs: tuple[str, ...] | None,
                    outputs: tuple[str, ...] | None) -> TensorParallelLayout | None:
    """The Megatron split transformers' own plan gives the decoder layers (``base_model_tp_plan``), when each of
    its entries is a split titan-core's tp makes (not a fused projection gathered whole again: Phi-3, OLMo 2's
    attention); None otherwise. The regions are the layer's sub-modules holding those linears, in the plan's order
    (attention, then MLP). transformers' decoder computes positions and masks from the stream's length, so the stream
    stays whole between layers: no sequence parallel."""
    text = config.get_text_config()
    plan = text.base_model_tp_plan or {}
    layers = [(key.removeprefix("layers.*."), style) for key, style in plan.items() if key.startswith("layers.*.")]
    if (not layers or len(layers) != len(plan) or any(style not in SPLITS for _, style in layers) or not inputs
            or not outputs):
        return None
    split = {field: tuple(path for path, style in layers if SPLITS[style] == field) for field in SPLITS.values()}
    block = model.get_decoder().layers["0"]
    named = {path for path, _ in layers}
    norms = tuple(path for path, module in block.named_modules() if path and path not in named
                  and not isinstance(module, nn.Linear) and any(True for _ in module.parameters(recurse=False)))
    heads = {"model.config.num_attention_heads": text.num_attention_heads}
    if getattr(text, "num_key_value_heads", None):
        heads["model.config.num_key_value_heads"] = text.num_key_value_heads
    return TensorParallelLayout(
        block_colwise=split["block_colwise"], block_rowwise=split["block_rowwise"], head_norms=split["head_norms"],
        block_norms=norms, block_regions=tuple(dict.fromkeys(path.split(".")[0] for path, _ in layers)),
        embeddings=inputs, final_norms=tuple(path for path in outputs if path != "lm_head"), output="lm_head",
        divisible=heads,
        sequence_parallel=False)


SWIGLU = ("gate_proj", "up_proj", "down_proj")  # transformers' names of a SwiGLU feed-forward's linears


def gated_mlp(model: nn.Module, text: transformers.PretrainedConfig) -> GatedMLP | None:
    """The layers' ``mlp`` where it is transformers' SwiGLU: a SiLU activation (``hidden_act``) and the three
    bias-free linears as its only parameters (None for Gemma's GELU, Phi-3's fused gate and up, biased MLPs)."""
    mlp = getattr(model.get_decoder().layers["0"], "mlp", None)
    if mlp is None:  # a layer whose feed-forward has another name
        return None
    linears = [getattr(mlp, name, None) for name in SWIGLU]
    plain = all(linear is not None and type(linear) is nn.Linear and linear.bias is None for linear in linears)
    if getattr(text, "hidden_act", None) not in ("silu", "swish") or not plain or len(list(mlp.parameters())) != 3:
        return None
    return GatedMLP("mlp", *SWIGLU)


def decoder_path(model: nn.Module) -> str:
    decoder = model.get_decoder()
    return next(path for path, module in model.named_modules() if module is decoder)


@hookimpl
def describe_model(model_config, vocab_size, seq_len):
    """transformers: the folder's architecture, its decoder layers as blocks, transformers' initialization."""
    return describe(model_config, vocab_size, seq_len)


@hookimpl
def hf_model_options(hf_config, selected):
    """transformers: the whole config.json, when model.name selects the backend (any model_type: asked beside the
    native plugins it would claim every folder)."""
    return hf_options(hf_config) if selected else None


@hookimpl
def build_model(description):
    """transformers: its own module of the folder's config."""
    return build(description.args.config, description.args.seq_len)[0]
