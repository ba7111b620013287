"""What a model tells the rest of titan-core about itself: the model contract.

A model plugin returns a :class:`ModelDescription` from its ``describe_model`` hook. Every parallelism plugin reads
this description instead of knowing a model's module names: FSDP and activation checkpointing wrap the modules of
``blocks``, pipeline parallel keeps some blocks and drops ``inputs`` or ``outputs`` per stage, tensor parallel
applies ``tensor_parallel``, context parallel splits the ``position_buffers`` and relies on the ``attention`` seam,
float8 skips ``float8_skip``, expert parallel splits ``experts``, the core initializes each shard by ``param_init``
and computes MFU from ``flops_per_token``, the checkpoint plugin maps names through ``hf``. A field left at None
means "this model does not support it": the plugin that needs it refuses before launch in one line naming it.

Paths are dotted (``transformer.h``): the root fields' from the model's root, a layout's ``block_*`` paths and
``gated_mlp``'s from one block (as ``block.named_modules()`` names them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from titan_core.errors import ConfigError
from titan_core.feed_forward import GatedMLP
from titan_core.huggingface import HFAdapter

# The attention seam context parallel understands: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``
# on (batch, heads, seq, head_dim) tensors, with no mask and nothing else mixing positions.
SDPA_CAUSAL = "sdpa_causal"
# The seam that also masks documents: every block attends through ``titan_core.attention.causal_attention(q,
# k, v, document_ids)``, and the model's forward takes ``document_ids=None`` and hands it to every block.
# Without document ids it is causal SDPA, so whatever understands SDPA_CAUSAL understands it too.
CORE_ATTENTION = "titan_core.attention"


@dataclass(frozen=True)
class ParamInit:
    """How one parameter starts: drawn from N(0, std), or filled with ``fill`` when std is None."""

    std: float | None = None
    fill: float = 0.0

    @classmethod
    def normal(cls, std: float) -> ParamInit:
        return cls(std=std)

    @classmethod
    def constant(cls, value: float) -> ParamInit:
        return cls(fill=value)


@dataclass(frozen=True)
class TensorParallelLayout:
    """How the tensor-parallel plugin splits this model (Megatron style), by module path.

    Inside each block: ``block_colwise`` linears are split by output features (whole heads, slices of the hidden
    units), ``block_rowwise`` linears by input features (their outputs are summed back into the residual stream),
    ``block_norms`` are norms on the residual stream (split along the sequence under sequence parallel, replicated
    otherwise), ``head_norms`` are norms applied per head to a (batch, seq, heads, head_dim) tensor (QK-norm: each
    rank normalizes its own heads), and ``block_regions`` are the sub-modules entered from the residual stream,
    whose first argument (positional, else keyword) is the stream: it arrives as a replicated DTensor (gathered under sequence
    parallel), which the region passes only to its linears and ``block_replicated`` modules (compile compiles the
    regions one by one under TP). On the root: ``embeddings`` are lookup tables split by rows (vocabulary or positions; their input
    ids are replicated and their output is the residual stream), ``final_norms`` norms on the stream, ``output`` the
    linear producing the logits (split by vocabulary; loss parallel keeps it split). ``divisible`` maps a config
    field to the count the tp degree must divide (attention heads). Low-rank attention (MLA): ``block_replicated``
    modules run whole on every rank (down-projections, their norms), and ``head_shared`` ones (often an identity)
    output what every head uses, like a key shared by all heads: their gradient is summed over the ranks' heads.
    ``head_parameters`` are a block's parameters holding one row per query head (attention sinks): split by rows
    like the query projection's heads, and taken locally by the attention seam. ``sequence_parallel``: False when
    the blocks cannot take a stream split by sequence (they derive positions or masks from its length).
    """

    block_colwise: tuple[str, ...]
    block_rowwise: tuple[str, ...]
    block_norms: tuple[str, ...]
    block_regions: tuple[str, ...]
    embeddings: tuple[str, ...]
    final_norms: tuple[str, ...]
    output: str
    head_norms: tuple[str, ...] = ()
    divisible: Mapping[str, int] = field(default_factory=dict)
    block_replicated: tuple[str, ...] = ()
    head_shared: tuple[str, ...] = ()
    head_parameters: tuple[str, ...] = ()
    sequence_parallel: bool = True


@dataclass(frozen=True)
class ExpertsLayout:
    """Where a mixture-of-experts model keeps its experts, for expert parallel.

    ``module`` is the path, inside one block, of the module holding every expert of that block (``mlp.experts``);
    blocks without it (dense ones) are left alone. ``count`` is the number of experts of each such module. The
    module's contract: ``forward(tokens, counts)`` takes the token copies sorted by expert, (n, hidden), and how
    many go to each expert, an integer tensor of the module's expert count, and returns their outputs (n, hidden) in
    the same order; each of its parameters has the expert index as its first dimension and no expert's output
    depends on another's tokens. Expert parallel leaves each rank a contiguous slice of the experts (the module then
    sees its parameters' slice and counts of the same length) and moves the tokens to them and back; before each
    call it sets the module's ``routed`` attribute to the copies this rank routed (the even share of what the call
    computes, by which the core's experts module measures its load).

    The module's parent (``layer``, ``mlp``) is the whole mixture-of-experts sub-layer: entered from the residual
    stream (its first argument, (batch, seq, hidden)), it routes, runs the experts and any shared expert, and
    computes each token apart from the others, so tensor parallel gives each rank a share of its tokens, not weights.

    ``linears`` (optional) names the module's parameters that are stacks of per-expert linear weights, (experts, out
    features, in features), expert ``e``'s applied as ``F.linear(x, weight[e])``, each read by the module's forward
    as an attribute on every call: what LoRA adapts when asked for ``experts``. ``routed``: how many experts each
    token goes to (top-k), by which the core takes frozen experts' gradients out of the FLOPs it reports.
    """

    module: str
    count: int
    linears: tuple[str, ...] = ()
    routed: int | None = None

    @property
    def layer(self) -> str:
        """The path, inside one block, of the mixture-of-experts sub-layer holding the experts."""
        return self.module.rpartition(".")[0]


@dataclass(frozen=True)
class ModelDescription:
    """A model as the parallelism plugins and the core see it.

    Required:
      ``family``: the model's name in messages and records (``model.name``, or one more precise).
      ``args``: the model's own resolved options; the core hands them back to ``build_model``.
      ``n_layers``: how many blocks ``blocks`` holds, keyed "0" .. "n_layers - 1" (kept by stages: names never change).
      ``param_init(name) -> ParamInit``: the initial distribution of a parameter, by canonical name.
      ``flops_per_token(seq_len)``: training FLOPs per token, for MFU.

    Optional (None: the plugins that need it refuse the model before launch):
      ``blocks``: the root attribute holding the blocks as an ``nn.ModuleDict`` (FSDP units, checkpointing
      and compile units, pipeline split points).
      ``inputs`` / ``outputs``: the root modules run before / after the blocks (embeddings; final norm, output); a
      pipeline stage sets those it does not run to None, and the model's ``forward`` then takes or returns the stream.
      ``tensor_parallel``: a :class:`TensorParallelLayout`. ``attention``: the attention seam, :data:`SDPA_CAUSAL` when
      the blocks attend through causal SDPA, :data:`CORE_ATTENTION` through the core's (which can also mask documents).
      ``position_buffers``: root buffers indexed by position along their first dimension (RoPE tables, position
      ids), which context parallel splits like the tokens so each shard sees its global positions; () for none.
      ``init_buffers(part)``: fills a model part's non-persistent buffers after ``to_empty``.
      ``float8_skip``: fragments of linears' canonical names, whole dotted parts (``mlp.gate`` matches
      ``layers.3.mlp.gate``, not ``mlp.gate_proj``), that float8 must leave in high precision.
      ``logits``: the root ``nn.Linear`` (no bias, one of ``outputs``) that maps the final hidden state to the
      vocabulary: a loss computing the logits itself (chunked cross entropy) swaps it for a pass-through of its weight.
      ``experts``: an :class:`ExpertsLayout` (mixture-of-experts models). ``hf``: an :class:`HFAdapter`.
      ``gated_mlp``: a :class:`titan_core.feed_forward.GatedMLP`, the blocks' SwiGLU (what module overrides swap).
    """

    family: str
    args: Any
    n_layers: int
    param_init: Callable[[str], ParamInit]
    flops_per_token: Callable[[int], float]
    blocks: str | None = "layers"
    inputs: tuple[str, ...] | None = None
    outputs: tuple[str, ...] | None = None
    tensor_parallel: TensorParallelLayout | None = None
    attention: str | None = None
    position_buffers: tuple[str, ...] | None = None
    init_buffers: Callable[[nn.Module], None] | None = None
    float8_skip: tuple[str, ...] = ()
    logits: str | None = None
    experts: ExpertsLayout | None = None
    gated_mlp: GatedMLP | None = None
    hf: HFAdapter | None = None

    def blocks_of(self, part: nn.Module) -> nn.ModuleDict:
        """The blocks a model part holds (all of them, or a pipeline stage's)."""
        if self.blocks is None:
            raise RuntimeError(f"model {self.family} describes no blocks")
        return attribute(part, self.blocks)

    def experts_of(self, block: nn.Module) -> nn.Module | None:
        """The experts module of one block; None for a dense block or a model without experts."""
        if self.experts is None:
            return None
        try:
            return block.get_submodule(self.experts.module)
        except AttributeError:
            return None


def attribute(root: nn.Module, path: str):
    """The module, parameter or buffer at dotted ``path`` under ``root``; None where a stage dropped it."""
    value = root
    for name in path.split("."):
        value = getattr(value, name)
        if value is None:
            return None
    return value


def replace(root: nn.Module, path: str, module: nn.Module | None) -> None:
    """Put ``module`` at dotted ``path`` (None: a pipeline stage that does not run it): its parameters keep the names
    of the one it replaces."""
    parent, _, name = path.rpartition(".")
    setattr(attribute(root, parent) if parent else root, name, module)


def read_options(model_config, known, family: str, tokenizer_vocab_size: int) -> dict:
    """A model's options from ``config.model``: unknown fields refused (one line naming the field; ``name`` and
    ``path`` are the core's), and ``vocab_size`` null taking the tokenizer's size, never smaller than it."""
    unknown = sorted(set(model_config) - set(known) - {"name", "path"})
    if unknown:
        raise ConfigError(f"model.{unknown[0]}", f"is not a {family} option", f"use one of {', '.join(sorted(known))}")
    options = {k: v for k, v in model_config.items() if k in known}
    options["vocab_size"] = options.get("vocab_size") or tokenizer_vocab_size
    if options["vocab_size"] < tokenizer_vocab_size:  # a folder's model (model.path) fixes its vocabulary
        fix = (f"take the folder's tokenizer (tokenizer.path=builtin) or one of at most {options['vocab_size']} ids"
               if model_config.get("path") else "set model.vocab_size=null to take the tokenizer's size")
        raise ConfigError("model.vocab_size", f"{options['vocab_size']} is smaller than the tokenizer's "
                          f"{tokenizer_vocab_size}", fix)
    return options


def lacks(description: ModelDescription, what: str, plugin: str) -> str:
    """The one-line reason a plugin refuses a model whose description leaves ``what`` unset."""
    return (f"model '{description.family}' does not describe {what}, which {plugin} needs "
            f"(ModelDescription.{what} is None)")


# Wrappers that activation checkpointing, torch.compile and FSDP1 insert into parameter names.
_WRAPPER_PREFIXES = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def canonical_name(name: str) -> str:
    """A parameter's name with the wrappers' segments removed: the same under every plan."""
    return _WRAPPER_PREFIXES.sub("", name)
