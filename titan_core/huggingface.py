"""How a model reads and writes a Hugging Face folder (``config.json`` + safetensors): the names and arrangement of its
tensors and the config fields it computes, as its description's ``hf`` field tells the checkpoint plugin."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_core.errors import ConfigError


@dataclass(frozen=True)
class StoredLayout:
    """How a file arranges a parameter other than the model does: the file's dimension ``i`` is the model's
    ``dims[i]`` (``(0, 2, 1)``: the last two transposed), and the model's dimension ``interleaved`` (None: none)
    holds two halves, such as an expert's gate and up projections, that the file stores alternating element by
    element."""

    dims: tuple[int, ...]
    interleaved: int | None = None

    def to_file(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.interleaved is not None:
            halves = tensor.unflatten(self.interleaved, (2, -1))
            tensor = halves.transpose(self.interleaved, self.interleaved + 1).flatten(self.interleaved,
                                                                                     self.interleaved + 1)
        return tensor.permute(self.dims)

    def from_file(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.permute(self.model_order())
        if self.interleaved is not None:
            pairs = tensor.unflatten(self.interleaved, (-1, 2))
            tensor = pairs.transpose(self.interleaved, self.interleaved + 1).flatten(self.interleaved,
                                                                                    self.interleaved + 1)
        return tensor

    def model_order(self) -> tuple[int, ...]:
        """For each model dimension, the file's dimension holding it."""
        return tuple(self.dims.index(d) for d in range(len(self.dims)))

    def file_box(self, box: tuple[slice, ...]) -> tuple[slice, ...]:
        """The file's slices holding the model's ``box``: whole along an interleaved dimension."""
        return tuple(slice(None) if d == self.interleaved else box[d] for d in self.dims)

    def model_box(self, values: torch.Tensor, box: tuple[slice, ...]) -> torch.Tensor:
        """The model's ``box`` of the file's ``values`` read at :meth:`file_box`."""
        values = self.from_file(values)
        if self.interleaved is None:
            return values
        cut = box[self.interleaved]
        return values.narrow(self.interleaved, cut.start, cut.stop - cut.start)


@dataclass(frozen=True)
class HFAdapter:
    """How the model reads and writes a Hugging Face folder (``config.json`` + safetensors).

    ``config`` is the folder's config.json for this model, without the dtype fields. ``to_hf`` maps a canonical
    parameter name to the file's tensor name; ``from_hf`` maps back (None for tensors the model does not hold).
    ``tied`` maps a parameter to the one it is copied from when the file lacks it (tied word embeddings).
    ``options_from_hf`` turns a config.json into this model's options (``model.*`` fields), for converting a
    downloaded model into a titan-core preset. ``pieces`` reads folders that store a stacked parameter as many
    tensors (released mixture-of-experts checkpoints keep each expert's projections apart): for a canonical name,
    the file tensors of each index of its first dimension, concatenated along their own first dimension, or None
    when it is stored whole; ``from_hf`` returns None for those pieces. ``stored`` gives the
    :class:`StoredLayout` of a canonical name the file arranges otherwise (gpt-oss's experts: transposed, gate and
    up interleaved), None for the rest.
    """

    config: Mapping[str, Any]
    to_hf: Callable[[str], str]
    from_hf: Callable[[str], str | None]
    options_from_hf: Callable[[Mapping[str, Any]], dict]
    tied: Mapping[str, str] = field(default_factory=dict)
    pieces: Callable[[str], list[list[str]] | None] = lambda name: None
    stored: Callable[[str], StoredLayout | None] = lambda name: None


def hf_rope_parameters(hf_config: Mapping[str, Any]) -> dict:
    """The RoPE parameters transformers reads from a config.json: transformers 4's ``rope_scaling``, else 5's
    ``rope_parameters`` (``rope_scaling`` wins when both are set); ``rope_theta`` from them, else the file's top-level
    one, else 10000; the type from ``rope_type``, else ``type``, else default."""
    rope = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def check_hf_config(hf_config: Mapping[str, Any], family: str, **computed: tuple) -> None:
    """Refuse a Hugging Face config.json that sets a field to a value the family's model does not compute
    (``computed``: each field's values it does; an absent field is transformers' default and passes), rather
    than import a model whose outputs differ from the file's."""
    for name, values in computed.items():
        if name in hf_config and hf_config[name] not in values:
            raise ConfigError("model.path", f"config.json sets {name}={hf_config[name]!r}, which {family} does not "
                              f"compute (only {' or '.join(map(repr, values))})",
                              "start from a folder of a model this family's plugin builds")
