"""Transformers' own causal language model, built from a config.json as titan-core builds a model.

The module is transformers' class itself (its parameter names are the folder's), with two changes that keep its
arithmetic: its decoder layers sit in a :class:`Blocks` dict keyed "0".."n-1" (what the parallelism plugins wrap
and name), and its forward takes the core's ``(tokens)`` and returns the logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from titan_core import TORCHAO_LOGGERS, attribute, library_logs_at_debug, replace


CAUSAL = "titan_causal"  # the attention implementation, in transformers' registry, of a model without masks


def causal_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Causal SDPA of (batch, heads, seq, head_dim) tensors with no mask: the attention context parallel turns into a
    ring. transformers makes no mask for an implementation of its registry that is not its own, so that positions a
    ring shard holds (not 0..n) are not mistaken for packed sequences."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


with library_logs_at_debug(*TORCHAO_LOGGERS):  # transformers' modeling imports torchao where it is installed
    transformers.AttentionInterface.register(CAUSAL, causal_attention)


class Blocks(nn.ModuleDict):
    """The decoder layers, keyed "0".."n-1", also read as transformers' decoders read their ``nn.ModuleList``
    (``self.layers[: n]``, ``self.layers[i]``)."""

    def __getitem__(self, key):
        if isinstance(key, slice):
            return list(self._modules.values())[key]
        return super().__getitem__(str(key))


class CoreForward:
    """The core's call: token ids (batch, seq) in, logits (batch, seq, vocabulary) out, no cache. On a pipeline
    stage the modules it does not run (None) stand in as identities for the call: a later stage's residual stream
    goes through the embeddings' place, an earlier stage's comes out of the final norm's and output's."""

    stage_modules: tuple[str, ...] = ()
    positions: torch.Tensor  # the training sequence's positions, which context parallel splits like the tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        dropped = [path for path in self.stage_modules if attribute(self, path) is None]
        for path in dropped:
            replace(self, path, nn.Identity())  # type: ignore[arg-type]
        # An input longer than training's (generation) has transformers count its positions from 0.
        positions = self.positions[None, :tokens.shape[1]] if tokens.shape[1] <= len(self.positions) else None
        try:
            return super().forward(input_ids=tokens, position_ids=positions, use_cache=False).logits  # type: ignore[misc]
        finally:
            for path in dropped:
                replace(self, path, None)  # type: ignore[arg-type]


def causal_lm_base(config: transformers.PretrainedConfig) -> type[nn.Module]:
    return transformers.AutoModelForCausalLM._model_mapping[type(config)]


def stage_modules(config: transformers.PretrainedConfig) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The modules run before the decoder layers and after them, in transformers' pipeline plan of the model (None:
    it has none)."""
    base = causal_lm_base(config)
    order = list(config.get_text_config().base_model_pp_plan or {})
    if "layers" not in order:
        return None
    prefix, split = base.base_model_prefix, order.index("layers")
    return (tuple(f"{prefix}.{name}" for name in order[:split]),
            tuple(f"{prefix}.{name}" for name in order[split + 1:]) + tuple(getattr(base, "_pp_plan", None) or {}))


def causal_lm_class(config: transformers.PretrainedConfig) -> type[nn.Module]:
    """Transformers' causal-LM class of ``config``, with the core's forward."""
    base, stages = causal_lm_base(config), stage_modules(config)
    return type(base.__name__, (CoreForward, base), {"__module__": __name__, "stage_modules": sum(stages or (), ())})


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers goes to the meta device, its buffers stay where they are made: a model
    built so allocates no weight and keeps the values of the buffers its constructor computes (RoPE frequencies,
    an embedding's scale), which ``to_empty`` would leave uninitialized and nothing else could recompute."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build(config: transformers.PretrainedConfig, seq_len: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model on the meta device, and the values of its buffers (by name) computed on the CPU."""
    with torch.device("cpu"), parameters_on_meta():
        model = causal_lm_class(config)(config)
        model.register_buffer("positions", torch.arange(seq_len), persistent=False)
    decoder = model.get_decoder()
    decoder.layers = Blocks({str(i): layer for i, layer in enumerate(decoder.layers)})
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to("meta")
    return model, buffers
