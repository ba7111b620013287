"""What a checkpoint holds: the training state as one flat dict of tensors, and back.

    model.<name>             each parameter, by its canonical name (a DTensor shard under sharded plans)
    optimizer.<name>.<slot>  the optimizer's per-parameter state (AdamW: step, exp_avg, exp_avg_sq)
    lr_scheduler.<field>     the scheduler's counters and learning rates
    dataloader.<field>       the loader's position in the data
    rng.<device>             random generator states
    step                     the last step whose update the weights hold
    plugins.<name>.<field>   the state of each plugin object that keeps one (titan_core.Stateful)

Everything is a tensor, so reading never unpickles anything, and torch.distributed.checkpoint
reshards the DTensors to whatever plan loads them. Names are canonical (no compile or activation
checkpointing wrappers) and pipeline stages keep the whole model's names, so every plan writes the
same keys. The loader's position is a place in one global stream (see titan_core.data), the same on
every rank, which is why it carries over to any number of data-parallel ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titan_core import ConfigError, canonical_name

LOAD_FIELD = "plugins.checkpoint.load_path"


def model_tensors(model_parts) -> dict[str, torch.Tensor]:
    return {f"model.{canonical_name(k)}": v for part in model_parts for k, v in part.state_dict().items()}


def optimizer_tensors(optimizer, model_parts) -> dict[str, torch.Tensor]:
    names = {p: canonical_name(n) for part in model_parts for n, p in part.named_parameters()}
    return {f"optimizer.{names[p]}.{slot}": value for p, slots in optimizer.state.items()
            for slot, value in slots.items() if isinstance(value, torch.Tensor)}


def number_tensors(prefix: str, state: dict) -> dict[str, torch.Tensor]:
    """A state_dict of numbers, lists of numbers and tensors as tensors (floats kept in float64)."""
    tensors = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            tensors[f"{prefix}.{key}"] = value
        elif isinstance(value, (bool, int, float)) or (isinstance(value, list) and value
                                                       and all(isinstance(v, (int, float)) for v in value)):
            dtype = torch.float64 if isinstance(value, float) or (isinstance(value, list)
                                                                  and any(isinstance(v, float) for v in value)) else None
            tensors[f"{prefix}.{key}"] = torch.tensor(value, dtype=dtype)
    return tensors


def restore_numbers(prefix: str, template: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """The inverse of :func:`number_tensors`, taking each field's Python type from ``template``."""
    state = dict(template)
    for key, value in template.items():
        saved = tensors.get(f"{prefix}.{key}")
        if saved is None:
            continue
        if isinstance(value, torch.Tensor):
            state[key] = saved
        elif isinstance(value, list):
            state[key] = [type(v)(s) for v, s in zip(value, saved.tolist())]
        else:
            state[key] = type(value)(saved.item())
    return state


def training_tensors(state) -> dict[str, torch.Tensor]:
    """The whole TrainState, ready for ``dcp.save``."""
    tensors = {**model_tensors(state.model_parts), **optimizer_tensors(state.optimizer, state.model_parts),
               **number_tensors("lr_scheduler", state.lr_scheduler.state_dict()),
               **number_tensors("dataloader", state.dataloader.state_dict()),
               **{key: value for name, plugin in state.plugins.items()
                  for key, value in plugin_tensors(name, plugin.state_dict()).items()},
               "rng.cpu": torch.get_rng_state(), "step": torch.tensor(state.step)}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return tensors


def plugin_tensors(name: str, plugin_state: dict) -> dict[str, torch.Tensor]:
    """A plugin's ``state_dict()`` as tensors under ``plugins.<name>.``; a value that is none of a tensor, a
    number or a list of numbers is refused (a checkpoint never pickles)."""
    prefix = f"plugins.{name}"
    tensors = number_tensors(prefix, plugin_state)
    unsaved = sorted(set(plugin_state) - {k[len(prefix) + 1:] for k in tensors})
    if unsaved:
        raise TypeError(f"the state of plugin '{name}' holds {unsaved[0]}={plugin_state[unsaved[0]]!r}, which is not "
                        "a tensor, a number or a list of numbers (titan_core.Stateful)")
    return tensors


def read_metadata(path) -> dict:
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


class SharedMetadataReader(dcp.FileSystemReader):
    """A reader of the checkpoint at ``path`` whose metadata rank 0 read for every rank: DCP alone would have
    each rank read and unpickle the same ``.metadata`` (tens of MB at 405B, times the world)."""

    def __init__(self, path):
        super().__init__(str(path))
        received: list = [super().read_metadata() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(received, src=0)
        self.metadata: Metadata = received[0]

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def check_model_matches(wanted: dict[str, tuple], saved: dict[str, tuple], source, held: set[str]) -> None:
    """One-line error naming the first model tensor that ``source`` lacks, has extra, or shapes differently.

    ``wanted`` maps this process's model keys to shapes; ``held`` is every key that all ranks together
    hold (pipeline stages each hold part of the model).
    """
    for key, shape in wanted.items():
        if key not in saved:
            raise ConfigError(LOAD_FIELD, f"{source} has no tensor {key[len('model.'):]}",
                              "load a checkpoint of the same model config")
        if tuple(saved[key]) != tuple(shape):
            raise ConfigError(LOAD_FIELD, f"tensor {key[len('model.'):]} is {list(saved[key])} in {source} "
                              f"but {list(shape)} in this model", "load a checkpoint of the same model config")
    extra = sorted({k for k in saved if k.startswith("model.")} - held)
    if extra:
        raise ConfigError(LOAD_FIELD, f"{source} holds tensor {extra[0][len('model.'):]} that this model lacks",
                          "load a checkpoint of the same model config")


def check_loadable(wanted: dict[str, torch.Tensor], saved: dict[str, tuple], source) -> None:
    """:func:`check_model_matches` for this rank's part of the model, inside a running world."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(wanted))
    check_model_matches({k: v.shape for k, v in wanted.items()}, saved, source, {k for keys in everyone for k in keys})


def dcp_shapes(path, reader: dcp.FileSystemReader | None = None) -> tuple[dict, dict[str, tuple]]:
    """The checkpoint's metadata (``reader``'s, else read here) and its tensors' shapes; refuses a checkpoint
    holding pickled objects, which loading would have to unpickle."""
    saved = (reader or dcp.FileSystemReader(str(path))).read_metadata().state_dict_metadata
    pickled = sorted(k for k, m in saved.items() if not isinstance(m, TensorStorageMetadata))
    if pickled:
        raise ConfigError(LOAD_FIELD, f"{path} stores {pickled[0]} as a pickled object, which is never loaded "
                          "(weights_only)", "load a checkpoint written by titan-checkpoint")
    return saved, {k: tuple(m.size) for k, m in saved.items()}


def copy_into_model(model_parts, tensors: dict[str, torch.Tensor]) -> None:
    """Every entry of ``tensors`` into the model (a key it lacks was loaded before, from elsewhere)."""
    for part in model_parts:
        part.load_state_dict({k: tensors[f"model.{canonical_name(k)}"] for k in part.state_dict()
                              if f"model.{canonical_name(k)}" in tensors}, strict=False)


def allocate(saved: dict, prefix: str) -> dict[str, torch.Tensor]:
    """Empty tensors shaped as the checkpoint's entries under ``prefix`` (their sizes vary from run to run)."""
    return {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items() if k.startswith(prefix)}


def materialize_optimizer_state(optimizer) -> None:
    """Create the optimizer's state with a zero-gradient, zero-learning-rate step.

    Adam-style optimizers create their state lazily at the first step, and loading in place needs
    the tensors to exist (in the parameters' own sharding). With lr 0 the weights do not move.
    """
    if optimizer.state:
        return
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, learning_rates):
        group["lr"] = lr


# What a checkpoint's parts hold, by key prefix; ``load_parts`` picks among them.
PARTS = {"model": ("model.",), "optimizer": ("optimizer.",), "lr_scheduler": ("lr_scheduler.",),
         "dataloader": ("dataloader.",), "step": ("step", "rng."), "plugins": ("plugins.",)}


def load_training_state(state, path, parts=tuple(PARTS), loaded_elsewhere: frozenset[str] = frozenset()) -> int:
    """Load ``parts`` of the checkpoint at ``path`` into ``state`` in place (those it holds: a weights-only
    save holds the model alone; ``loaded_elsewhere``: model keys it may lack because they were loaded from the
    folder the run started from); returns the step to continue after (0 unless ``step`` was loaded)."""
    reader = SharedMetadataReader(path)
    saved, shapes = dcp_shapes(path, reader)
    parts = {p for p in parts if any(k.startswith(PARTS[p]) for k in saved)}
    wanted = {}
    if "model" in parts:
        wanted = {k: v for k, v in model_tensors(state.model_parts).items() if k in saved or k not in loaded_elsewhere}
        check_loadable(wanted, shapes, path)
    if "optimizer" in parts:
        materialize_optimizer_state(state.optimizer)
        wanted.update(optimizer_tensors(state.optimizer, state.model_parts))
    for part in parts - {"model", "optimizer", "plugins"}:
        for prefix in PARTS[part]:
            wanted.update(allocate(saved, prefix))
    plugin_states = {}
    if "plugins" in parts:
        for name, plugin in state.plugins.items():
            template, prefix = plugin.state_dict(), f"plugins.{name}."
            tensors = {k[len(prefix):]: v for k, v in plugin_tensors(name, template).items() if k in saved}
            if tensors:  # a checkpoint made without this plugin leaves its state as the plugin made it
                plugin_states[name] = template
                # The plugin's own tensors are loaded in place (DTensors resharded); numbers come as new tensors.
                wanted.update({prefix + key: template[key] if isinstance(template[key], torch.Tensor) else value
                               for key, value in tensors.items()})
    dcp.load(wanted, storage_reader=reader)
    if "model" in parts:
        copy_into_model(state.model_parts, wanted)
    if "lr_scheduler" in parts:
        state.lr_scheduler.load_state_dict(restore_numbers("lr_scheduler", state.lr_scheduler.state_dict(), wanted))
    for group, lr in zip(state.optimizer.param_groups, state.lr_scheduler.get_last_lr()):
        group["lr"] = lr  # the schedule's, whether restored or fresh (materializing the state zeroed nothing)
    if "dataloader" in parts:
        state.dataloader.load_state_dict(restore_numbers("dataloader", state.dataloader.state_dict(), wanted))
    for name, template in plugin_states.items():
        state.plugins[name].load_state_dict(restore_numbers(f"plugins.{name}", template, wanted))
    if "step" not in parts:
        return 0
    torch.set_rng_state(wanted["rng.cpu"])
    if torch.cuda.is_available() and "rng.cuda" in wanted:
        torch.cuda.set_rng_state(wanted["rng.cuda"])
    return int(wanted["step"])
