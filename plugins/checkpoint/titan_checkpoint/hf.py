"""Hugging Face folders (``config.json`` + safetensors), written from and read into titan-core's names.

Which names and which config.json a model has is the model's own business: its description carries an
:class:`titan_core.description.HFAdapter`, and this module only moves tensors through it. Import reads
each rank's slice of every tensor straight from the files (never a whole tensor it does not hold), and
only safetensors are read: nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from titan_core import (ConfigError, HFAdapter, canonical_name, load_tokenizer, local_box, model_description,
                        special_tokens, tokenizer_file)

FIELD = "plugins.checkpoint.load_path"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def export_hf(weights: dict[str, torch.Tensor], adapter: HFAdapter, folder: Path, dtype: torch.dtype = torch.float32,
              tokenizer=None, shard_bytes: int = 5 * 2**30) -> None:
    """Write ``weights`` (full tensors by canonical name) as a Hugging Face folder of the adapter's model."""
    converted = {adapter.to_hf(name): file_tensor(adapter, name, tensor.detach().to("cpu", dtype))
                 for name, tensor in weights.items()}
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    for name, tensor in converted.items():
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + tensor.nbytes > shard_bytes:
            shards.append({})
        shards[-1][name] = tensor
    weight_map: dict[str, str] = {}
    for file, shard in zip(file_names(len(shards)), shards):
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    write_hf_index(folder, weight_map, sum(t.nbytes for t in converted.values()), adapter, dtype, tokenizer)


def file_tensor(adapter: HFAdapter, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Parameter ``name``'s tensor arranged as the file stores it."""
    layout = adapter.stored(name)
    return (tensor if layout is None else layout.to_file(tensor)).contiguous()


def file_names(count: int) -> list[str]:
    """The standard names of a Hugging Face folder's ``count`` safetensors files."""
    return ["model.safetensors"] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors"
                                                     for i in range(1, count + 1)]


def write_hf_index(folder: Path, weight_map: dict[str, str], total_bytes: int, adapter: HFAdapter,
                   dtype: torch.dtype, tokenizer=None) -> None:
    """What completes a folder whose safetensors files are written: the index of a folder of several files,
    the run's tokenizer (``tokenizer``: its config section) with its special tokens, the generation config, and
    the config.json (last: a folder with it is finished)."""
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    special = special_tokens(tokenizer) if tokenizer is not None else {}
    ids = {key: value for key, value in special.items() if key.endswith("_id")}
    if tokenizer is not None and (source := tokenizer_file(tokenizer)) is not None:
        shutil.copyfile(source, folder / "tokenizer.json")
        # transformers' AutoTokenizer reads the special tokens from here; without them generate never stops.
        texts = {key: value for key, value in special.items() if not key.endswith("_id")}
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                                   **texts}, indent=2))
    if ids:
        (folder / "generation_config.json").write_text(json.dumps(ids, indent=2))
    config = {**adapter.config, **ids, "dtype": DTYPE_NAMES[dtype], "torch_dtype": DTYPE_NAMES[dtype]}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def read_hf_config(folder: Path, adapter: HFAdapter, field: str = FIELD) -> dict:
    """The folder's config.json, checked to be of the adapter's model type (``field``: the option that named it)."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(field, f"{folder} has no config.json", "point it at a Hugging Face model folder")
    config = json.loads(path.read_text())
    expected = adapter.config.get("model_type")
    if config.get("model_type") != expected:
        raise ConfigError(field, f"{path} is model_type '{config.get('model_type')}', not {expected}",
                          "import a model of the family model.name selects")
    return config


# config.json fields that do not change what the model computes: a folder's context length is its own.
CONTEXT_FIELDS = ("max_position_embeddings",)


def check_folder_model(folder: Path, description, config, field: str = FIELD) -> None:
    """The folder's model is the job's: its config.json, read into options as a job starting from the folder reads
    it, describes a model that exports the same config.json (but its context length). A preset that disagrees with
    the folder on a value no tensor shape shows (rope_theta, an epsilon, a routing flag) would load the weights and
    train them in another model without a word."""
    options = description.hf.options_from_hf(read_hf_config(folder, description.hf, field))
    start = OmegaConf.create({"model": options, "training": {"seq_len": config.training.seq_len}})
    folder_hf = model_description(start, load_tokenizer(config.tokenizer).vocab_size).hf
    assert folder_hf is not None  # described by the job's model plugin, which describes its Hugging Face names
    theirs = folder_hf.config
    ours = description.hf.config
    differing = sorted((key for key in theirs.keys() | ours.keys()
                        if key not in CONTEXT_FIELDS and theirs.get(key) != ours.get(key)),
                       key=lambda key: (isinstance(theirs.get(key), dict), key))  # a plain value names it best
    if differing:
        key = differing[0]
        raise ConfigError(field, f"{folder / 'config.json'} has {key}={theirs.get(key)!r} where the job's model has "
                          f"{ours.get(key)!r}", f"start from the folder with model=hf model.path={folder} (every "
                          "option from it), or set the model's options to the folder's")


def check_weight_files(folder: Path, field: str = FIELD) -> None:
    """The folder's weight files are whole and are what its index says, from their headers only (a download cut short,
    a git-lfs pointer left where the weights should be, a shard missing or another one's tensors): each named."""
    index = folder / "model.safetensors.index.json"
    placed: dict[Path, set[str]] = {}
    if index.is_file():
        for name, file in json.loads(index.read_text())["weight_map"].items():
            placed.setdefault(folder / file, set()).add(name)
    elif (folder / "model.safetensors").is_file():
        placed[folder / "model.safetensors"] = set()
    else:
        tensor_files(folder, field)  # names what the folder lacks
    for path, names in placed.items():
        if not path.is_file():
            raise ConfigError(field, f"{index} places tensors in {path.name}, which {folder} lacks",
                              "download the missing shard (or the whole folder) again")
        with open(path, "rb") as file:
            if file.read(40).startswith(b"version https://git-lfs"):
                raise ConfigError(field, f"{path} is a git-lfs pointer, not the weights",
                                  f"fetch them: git lfs pull in {folder}")
        try:
            with safe_open(path, "pt") as opened:
                held = set(opened.keys())
        except SafetensorError as error:
            raise ConfigError(field, f"{path} is not a whole safetensors file ({error})",
                              "download it again: it was cut short or damaged") from None
        if names - held:
            raise ConfigError(field, f"{path.name} lacks {sorted(names - held)[0]}, which {index.name} places there",
                              "download the folder again: its index and shards disagree")


def tensor_files(folder: Path, field: str = FIELD) -> dict[str, Path]:
    """The file holding each tensor of the folder, by Hugging Face name, from headers only."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = folder / "model.safetensors"
    if single.is_file():
        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ConfigError(field, f"{folder} has no model.safetensors or model.safetensors.index.json",
                      "point it at a Hugging Face folder with safetensors weights")


def source_name(name: str, adapter: HFAdapter, files: dict[str, Path]) -> str | None:
    """The file tensor a parameter reads: its own, or the one it is tied to when the file lacks it."""
    for candidate in (name, adapter.tied.get(name)):
        if candidate is not None and adapter.to_hf(candidate) in files:
            return adapter.to_hf(candidate)
    return None


def stored_in_pieces(name: str, adapter: HFAdapter, files: dict[str, Path]) -> list[list[str]] | None:
    """The file tensors making each slice of a stacked parameter, when the folder stores it that way."""
    grid = adapter.pieces(name)
    return grid if grid and all(piece in files for row in grid for piece in row) else None


def hf_shapes(folder: Path, adapter: HFAdapter, names) -> dict[str, tuple]:
    """Shapes by checkpoint key (``model.<name>``) of the file tensors ``names`` would read (headers only),
    plus the file's tensors that no name reads."""
    files = tensor_files(folder)
    shapes, read = {}, set()
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(path, "pt")) for path in set(files.values())}

        def shape(hf_name: str) -> tuple:
            return tuple(handles[files[hf_name]].get_slice(hf_name).get_shape())
        for name in names:
            hf_name = source_name(name, adapter, files)
            if hf_name is not None:
                layout = adapter.stored(name)
                stored = shape(hf_name)
                shapes[f"model.{name}"] = stored if layout is None else tuple(stored[i] for i in layout.model_order())
                read.add(hf_name)
            elif (grid := stored_in_pieces(name, adapter, files)) is not None:
                first = [shape(piece) for piece in grid[0]]
                shapes[f"model.{name}"] = (len(grid), sum(s[0] for s in first), *first[0][1:])
                read.update(piece for row in grid for piece in row)
        for hf_name in files.keys() - read:
            name = adapter.from_hf(hf_name)
            if name is not None and name not in adapter.tied.values():
                shapes[f"model.{name}"] = shape(hf_name)
    return shapes


@torch.no_grad()
def load_hf_slices(model_parts, folder: Path, adapter: HFAdapter, names: set[str] | None = None) -> int:
    """Copy each parameter's and saved buffer's local slice (of those ``names`` lists by canonical name, or all)
    from the folder's files into the model (a released router's balancing bias is a buffer); returns the bytes read.

    A rank reads only the box of each tensor it holds (a shard under FSDP/TP, the whole tensor otherwise).
    """
    files = tensor_files(folder)
    read = 0
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(path, "pt")) for path in set(files.values())}
        for part in model_parts:
            for name, param in part.state_dict(keep_vars=True).items():
                if names is not None and canonical_name(name) not in names:
                    continue
                hf_name = source_name(canonical_name(name), adapter, files)
                local, offset = local_box(param)
                box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
                if hf_name is None:  # stored in pieces: the file shapes were checked before
                    grid = stored_in_pieces(canonical_name(name), adapter, files)
                    if grid is None:  # nor in pieces: a folder read unchecked (generate)
                        raise ConfigError(FIELD, f"{folder} has no tensor {canonical_name(name)}",
                                          "load a folder of the same model")
                    read += _load_pieces(local, box, grid, lambda piece: handles[files[piece]].get_slice(piece))
                    continue
                layout = adapter.stored(canonical_name(name))
                values = handles[files[hf_name]].get_slice(hf_name)[box if layout is None else layout.file_box(box)]
                local.copy_((values if layout is None else layout.model_box(values, box)).to(local.dtype))
                read += values.nbytes
    return read


def _load_pieces(local: torch.Tensor, box: tuple[slice, ...], grid: list[list[str]], open_slice) -> int:
    """Fill ``local`` (the ``box`` of a stacked parameter) from the pieces of each slice it holds; returns the
    bytes read. A piece is read only where it overlaps the box."""
    read = 0
    for row, index in enumerate(range(box[0].start, box[0].stop)):
        start = 0  # where the current piece begins along the slice's first dimension
        for piece in grid[index]:
            stored = open_slice(piece)
            length = stored.get_shape()[0]
            lo, hi = max(start, box[1].start), min(start + length, box[1].stop)
            if lo < hi:
                values = stored[(slice(lo - start, hi - start), *box[2:])]
                local[row, lo - box[1].start:hi - box[1].start].copy_(values.to(local.dtype))
                read += values.nbytes
            start += length
    return read


def import_hf(folder: Path, adapter: HFAdapter) -> tuple[dict, dict[str, torch.Tensor]]:
    """A folder's model options and full weights by canonical name, in one process (tools and tests)."""
    options = adapter.options_from_hf(read_hf_config(folder, adapter))
    weights = {}
    files = tensor_files(folder)
    with contextlib.ExitStack() as stack:
        handles = {path: stack.enter_context(safe_open(path, "pt")) for path in set(files.values())}
        for hf_name, path in files.items():
            name = adapter.from_hf(hf_name)
            if name is not None:
                layout = adapter.stored(name)
                tensor = handles[path].get_tensor(hf_name)
                weights[name] = tensor if layout is None else layout.from_file(tensor).contiguous()
    for name, source in adapter.tied.items():
        if name not in weights and source in weights:
            weights[name] = weights[source].clone()
    return options, weights
