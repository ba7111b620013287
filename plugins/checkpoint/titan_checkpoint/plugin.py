"""Distributed checkpoints: periodic, optionally asynchronous, never half-written, loadable by any plan.

Folder layout (``plugins.checkpoint.folder``, under the run dir unless absolute)::

    step-40/            a complete training state (torch.distributed.checkpoint format)
    step-60.partial/    a save in progress, or one a dead process left behind: never loaded as such
    weights-step-100/   the final model-only save, in the export dtype
    hf-step-100/        the final weights as a Hugging Face folder of the model's family

A save writes into ``<name>.partial``; rank 0 renames it once the checkpoint's metadata exists, which
DCP writes only after every rank has written its shards (the HF export likewise, its config.json
last). So a directory without the suffix is always complete, a process killed mid-save costs at most
that save (``files.recover`` settles every step of the swap at the next start), and a restarted world
resumes from the newest complete ``step-N`` in its own folder before it looks at ``load_path``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import re
import shutil
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from titan_core import (CHECKPOINTING, FLOAT_DTYPES, ConfigError, Declaration, StorageError, build_meta_model,
                        canonical_name, device_kind, float_dtype, hookimpl, lacks)
from titan_checkpoint.convert import write_hf_share
from titan_checkpoint.files import Deletions, damaged_files, partial_of, record_checksums, recover, swap_in
from titan_checkpoint.hf import (check_folder_model, check_weight_files, hf_shapes, load_hf_slices, read_hf_config,
                                 write_hf_index)
from titan_checkpoint.state import (PARTS, SharedMetadataReader, check_loadable, check_model_matches, dcp_shapes,
                                    load_training_state, model_tensors, training_tensors)

log = logging.getLogger("titan_core")
STEP_DIR = re.compile(r"step-(\d+)")


def validate_options(config, plugin_config, plan) -> None:
    """Every option, and the checkpoint or Hugging Face folder ``load_path`` names against the model."""
    for field, least in (("interval", 0), ("keep_latest_k", 0)):
        value = plugin_config[field]
        if value < least:
            raise ConfigError(f"plugins.checkpoint.{field}", f"{value!r} is not an integer >= {least}",
                              f"set an integer >= {least} (0 turns it off)")
    float_dtype(plugin_config.export_dtype, "plugins.checkpoint.export_dtype")
    if plugin_config.async_writer not in ("thread", "process"):
        raise ConfigError("plugins.checkpoint.async_writer", f"unknown writer '{plugin_config.async_writer}'",
                          "use thread or process")
    unknown = sorted(set(plugin_config.load_parts) - set(PARTS))
    if unknown:
        raise ConfigError("plugins.checkpoint.load_parts", f"unknown part '{unknown[0]}'", f"use some of {', '.join(PARTS)}")
    if plugin_config.export_hf and plan.model.hf is None:
        raise ConfigError("plugins.checkpoint.export_hf", lacks(plan.model, "hf", "Hugging Face export"),
                          "set plugins.checkpoint.export_hf=false")
    if plugin_config.load_path is not None and not isinstance(plugin_config.load_path, str):
        raise ConfigError("plugins.checkpoint.load_path", f"{plugin_config.load_path!r} is not a path",
                          "set a folder path (quoted if it looks like a number), or null")
    if (start := start_path(config, plugin_config)) is not None:
        kind, path = checkpoint_to_load(start)
        expected = {f"model.{k}": tuple(v.shape) for k, v in build_meta_model(config, plan.model).state_dict().items()}
        if kind == "hf":
            if plan.model.hf is None:
                raise ConfigError("plugins.checkpoint.load_path", lacks(plan.model, "hf", "Hugging Face import"),
                                  "load a titan-core checkpoint instead")
            field = "plugins.checkpoint.load_path" if plugin_config.load_path else "model.path"  # what the user set
            read_hf_config(path, plan.model.hf, field)
            check_weight_files(path, field)
            check_folder_model(path, plan.model, config, field)
            saved = hf_shapes(path, plan.model.hf, [k[len("model."):] for k in expected])
        else:
            saved = dcp_shapes(path)[1]
        check_model_matches(expected, saved, path, set(expected))


def start_path(config, plugin_config) -> Path | None:
    """What a run with no checkpoint of its own starts from: ``load_path``, else the Hugging Face folder of
    ``model.path``, else nothing."""
    path = plugin_config.load_path or config.model.get("path")
    return None if path is None else Path(path).expanduser()


def check_exportable(tensors: dict[str, torch.Tensor], built: frozenset[str], description) -> None:
    """A Hugging Face folder holds the model its plugin builds (``built``: its tensor names): a tensor a module
    conversion added (LoRA's adapters) has no name there, and leaving it out would export another model."""
    added = sorted(k for k in tensors if k[len("model."):] not in built)
    if added:
        raise ConfigError("plugins.checkpoint.export_hf", f"the model holds {added[0][len('model.'):]} (and "
                          f"{len(added) - 1} more), added by a module conversion, which a Hugging Face folder of "
                          f"'{description.family}' cannot hold", "set plugins.checkpoint.export_hf=false and export "
                          "them as the plugin that added them does (e.g. an adapter format, or a folder merged from it)")


def checkpoint_to_load(path: Path) -> tuple[str, Path]:
    """What ``load_path`` names: ("hf", folder), ("dcp", step dir) or, for a checkpoints folder, its newest."""
    if (path / "config.json").is_file():
        return "hf", path
    if (path / ".metadata").is_file():
        return "dcp", path
    newest = complete_checkpoints(path)
    if newest:
        return "dcp", newest[-1][1]
    raise ConfigError("plugins.checkpoint.load_path", f"{path} is not a checkpoint, a folder of checkpoints or a "
                      "Hugging Face model folder", "point it at a step-N folder, its parent, or an HF folder")


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Full training states in ``folder``, oldest first."""
    found = [(int(m.group(1)), p) for p in folder.glob("step-*")
             if (m := STEP_DIR.fullmatch(p.name)) and (p / ".metadata").is_file()] if folder.is_dir() else []
    return sorted(found)


class Checkpointer:
    def __init__(self, plugin_config, config, run_dir: Path, plan):
        self.options = plugin_config
        self.folder = run_dir / Path(plugin_config.folder).expanduser()
        self.config = config
        self.description = plan.model
        self.rank = dist.get_rank()
        # Asynchronous saves talk on their own gloo group: a background thread must not interleave its
        # collectives with the training step's on the default group (and NCCL cannot stage to CPU).
        self.group = dist.new_group(backend="gloo") if plugin_config.async_save else None
        # One stager for the run: on a GPU it copies the state into pinned host buffers that later saves
        # reuse, rather than a fresh pageable copy at every save.
        on_gpu = device_kind(config.launch.device) == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=on_gpu))
        self.writer = (AsyncCheckpointerType.PROCESS if plugin_config.async_writer == "process" else
                       AsyncCheckpointerType.THREAD)
        self.pending: tuple[Future, Path] | None = None  # the save in flight and the folder it writes
        self.saved_step: int | None = None
        self.base_folder: Path | None = None
        self.unsaved: frozenset[str] = frozenset()
        # The tensors of the model its plugin builds: what a module conversion added (LoRA's adapters) is neither
        # in a Hugging Face folder to load nor exportable to one.
        self.built = frozenset(build_meta_model(config, plan.model).state_dict())
        self.deletions = Deletions()

    def load(self, state) -> int | None:
        if self.options.export_hf:
            check_exportable(model_tensors(state.model_parts), self.built, self.description)
        self.base_folder, self.unsaved = self.frozen_base(state.model_parts)
        candidates: list[list[tuple[str, Path, tuple[str, ...]]] | None] = [None]
        if self.rank == 0:  # rank 0 lists them, so that every rank loads the same checkpoint
            if self.folder.is_dir():
                recover(self.folder, self.deletions)
            own = complete_checkpoints(self.folder)
            if own:  # a restart or rerun of this run continues it whole, from its newest intact save
                candidates = [[("dcp", path, tuple(PARTS)) for _, path in reversed(own)]]
            elif (start := start_path(self.config, self.options)) is not None:
                kind, path = checkpoint_to_load(start)
                candidates = [[(kind, path, tuple(self.options.load_parts))]]
        dist.broadcast_object_list(candidates, src=0)
        if candidates[0] is None:
            return None
        kind, path, parts = self.first_intact(candidates[0])
        if kind == "hf":
            self.load_hf(state.model_parts, path)
            step = 0
        else:
            if self.unsaved:  # the frozen base this run's checkpoints leave to the folder it started from
                assert self.base_folder is not None  # frozen_base leaves weights unsaved only with that folder
                self.load_hf(state.model_parts, self.base_folder)
            step = load_training_state(state, path, parts, self.unsaved)
        log.info("loaded %s: continuing after step %d (%s)", path, step, ", ".join(parts) if kind == "dcp" else "weights")
        self.saved_step = step if path.parent == self.folder else None
        return step

    def frozen_base(self, model_parts) -> tuple[Path | None, frozenset[str]]:
        """The Hugging Face folder the run started from and the checkpoint keys of the frozen weights it holds
        (a LoRA run's base): checkpoints leave those out, and a resume reads them from the folder again."""
        start = start_path(self.config, self.options)
        if start is None or checkpoint_to_load(start)[0] != "hf":
            return None, frozenset()
        return start, frozenset(f"model.{canonical_name(n)}" for part in model_parts for n, p in part.named_parameters()
                                if not p.requires_grad and canonical_name(n) in self.built)

    def training_state(self, state) -> dict[str, torch.Tensor]:
        """What a save writes: the whole training state but the frozen base a start folder holds."""
        return {k: v for k, v in training_tensors(state).items() if k not in self.unsaved}

    def first_intact(self, candidates: list[tuple]) -> tuple:
        """The first checkpoint whose files all match their checksums; each rank checks its share of each."""
        newest_damage = None
        for candidate in candidates:
            kind, path, _ = candidate
            mine = damaged_files(path, self.rank, dist.get_world_size()) if kind == "dcp" else []
            found: list = [None] * dist.get_world_size()
            dist.all_gather_object(found, mine)
            damaged = [line for lines in found for line in lines]
            if not damaged:
                return candidate
            newest_damage = newest_damage or damaged[0]
            if self.rank == 0:
                log.warning("skipping damaged checkpoint %s: %s", path, "; ".join(damaged))
        raise ConfigError("plugins.checkpoint", f"every checkpoint to resume from is damaged (newest: {newest_damage})",
                          "restore the files from a copy, or start afresh in another run dir")

    def save(self, state, step: int, final: bool, preempted: bool, check_finite) -> Path | None:
        if not (final or preempted) and (not self.options.interval or step % self.options.interval):
            return None
        check_finite()  # weights updated by a NaN gradient are never written
        if preempted:  # the whole state, now: the next run of the same command resumes from it
            self.wait()
            if self.saved_step != step:
                return self.write(self.training_state(state), f"step-{step}", asynchronous=False)
            return self.folder / f"step-{step}"
        if final:
            self.wait()
            if self.options.final_model_only:
                dtype = FLOAT_DTYPES[self.options.export_dtype]
                saved = self.write({k: v.to(dtype) for k, v in model_tensors(state.model_parts).items()},
                                   f"weights-step-{step}", asynchronous=False)
            elif self.saved_step != step:
                saved = self.write(self.training_state(state), f"step-{step}", asynchronous=False)
            else:
                saved = self.folder / f"step-{step}"
            if self.options.export_hf:
                self.export_hf(saved, step)
            return saved
        self.wait()
        return self.write(self.training_state(state), f"step-{step}", asynchronous=self.options.async_save)

    def write(self, tensors: dict, name: str, asynchronous: bool) -> Path:
        complete = self.folder / name
        partial = partial_of(complete)
        with self.storage(partial):
            if self.rank == 0:
                if partial.exists():  # the same save of an attempt that died
                    self.deletions.delete(partial)
                partial.mkdir(parents=True)
            dist.barrier()
            if asynchronous:  # returns once the tensors are copied to memory; the writing goes on in a thread
                upload = dcp.async_save(tensors, checkpoint_id=str(partial), process_group=self.group,
                                        async_stager=self.stager, async_checkpointer_type=self.writer)
                self.pending = then(upload, lambda: self.seal(partial, complete)), partial
            else:
                dcp.save(tensors, checkpoint_id=str(partial))
                self.seal(partial, complete)
        numbered = STEP_DIR.search(name)
        assert numbered is not None  # every save's folder is named after its step
        self.saved_step = int(numbered.group(1))
        return complete

    @contextlib.contextmanager
    def storage(self, folder: Path):
        """A write into ``folder`` that fails for the storage's reason (full, read-only, gone) becomes one line
        naming the folder, the cause and the newest checkpoint, which is intact: nothing is published or
        deleted before a save is whole. Rank 0 drops what the failed save wrote, freeing the space it took."""
        try:
            yield
        except BaseException as error:
            cause = storage_cause(error)
            if cause is None:
                raise
            if self.rank == 0 and folder.name.endswith(".partial") and folder.exists():
                shutil.rmtree(folder, ignore_errors=True)
            newest = complete_checkpoints(self.folder)
            kept = (f"the newest checkpoint, {newest[-1][1]}, is intact" if newest else
                    "no checkpoint was written before")
            raise StorageError(folder, cause, kept) from None

    def seal(self, partial: Path, complete: Path) -> None:
        """Every rank records its files' checksums; once all have, rank 0 publishes the save."""
        record_checksums(partial, dist.get_rank(self.group))
        dist.barrier(group=self.group)
        if self.rank == 0:
            self.publish(partial, complete)

    def publish(self, partial: Path, complete: Path) -> None:
        """Make a finished save visible; the one it replaces (a rerun of a step) goes only after."""
        swap_in(partial, complete, self.deletions)
        log.info("checkpoint %s written", complete)
        if self.options.keep_latest_k:
            for _, old in complete_checkpoints(self.folder)[:-self.options.keep_latest_k]:
                self.deletions.delete(old)

    def export_hf(self, checkpoint: Path, step: int) -> None:
        """Every rank writes its share of the weights as one safetensors file (reading only those tensors of
        the checkpoint); rank 0 then completes the folder and publishes it."""
        target = self.folder / f"hf-step-{step}"
        partial = partial_of(target)
        with self.storage(partial):
            self.write_hf(checkpoint, partial, target)

    def write_hf(self, checkpoint: Path, partial: Path, target: Path) -> None:
        if self.rank == 0:
            if partial.exists():
                self.deletions.delete(partial)
            partial.mkdir(parents=True)
        dist.barrier()
        dtype = FLOAT_DTYPES[self.options.export_dtype]
        metadata = SharedMetadataReader(checkpoint).metadata.state_dict_metadata
        weight_map, total, read = write_hf_share(checkpoint, partial, dtype, metadata, self.description.hf,
                                                 self.rank, dist.get_world_size())
        log.info("Hugging Face export: %d bytes read and written on this rank", read)
        dist.barrier()
        if self.rank == 0:
            write_hf_index(partial, weight_map, total, self.description.hf, dtype, self.config.tokenizer)
            swap_in(partial, target, self.deletions)
            log.info("Hugging Face export %s written", target)
        dist.barrier()

    def load_hf(self, model_parts, folder: Path) -> None:
        """Initialize the model from a Hugging Face folder, each rank reading only its slices."""
        adapter = self.description.hf
        read_hf_config(folder, adapter)
        wanted = {k: v for k, v in model_tensors(model_parts).items() if k[len("model."):] in self.built}
        check_loadable(wanted, hf_shapes(folder, adapter, [k[len("model."):] for k in wanted]), folder)
        read = load_hf_slices(model_parts, folder, adapter, self.built)
        log.info("read %d bytes of %s on this rank", read, folder)

    def wait(self) -> None:
        """Finish the save in flight, raising its error if it failed."""
        if self.pending is not None:
            (pending, folder), self.pending = self.pending, None
            with self.storage(folder):
                pending.result()

    def close(self) -> None:
        """Finish the save in flight and the deletions under way: the folder is then as it will stay."""
        try:
            self.wait()
        finally:
            self.stager.close()
            self.deletions.close()


ARCHIVE_CAME_OUT_SHORT = "unexpected pos"  # torch's archive writer (inline_container.cc) on a short write


def storage_cause(error: BaseException) -> OSError | None:
    """The OS error under a failed write: the error itself, the first rank's in DCP's CheckpointException (which
    wraps each rank's failure), or the one that caused it. torch's archive writer, saving to a path through a C++
    stream, drops the OS's error and reports only that its file came out short: that is the storage's fault too."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, RuntimeError) and ARCHIVE_CAME_OUT_SHORT in str(error):
        words = str(error).strip().splitlines()[-1].rpartition("] . ")[2]
        return OSError(errno.EIO, f"a file came out short, as on a full disk or past a file-size limit (torch: {words})")
    if isinstance(error, CheckpointException):
        return next((cause for failure, _ in error.failures.values() if (cause := storage_cause(failure))), None)
    chained = error.__cause__ or error.__context__
    return storage_cause(chained) if chained is not None and chained is not error else None


def then(future: Future, action) -> Future:
    """A future that completes once ``future`` has and ``action`` has run after it."""
    done: Future = Future()

    def finish(finished: Future) -> None:
        try:
            finished.result()
            action()
            done.set_result(None)
        except BaseException as error:
            done.set_exception(error)
    future.add_done_callback(finish)
    return done


class CheckpointPlugin:
    """The checkpoint plugin of one run (the entry point names the class: a sweep's jobs in one process each
    get their own), holding the run's :class:`Checkpointer` once ``load_checkpoint`` has made it."""

    def __init__(self):
        self.checkpointer: Checkpointer | None = None

    @hookimpl
    def declare(self):
        """checkpoint: provides checkpointing; some options act only beside another."""
        return Declaration(provides=frozenset({CHECKPOINTING}), acts_only={
            "async_writer": ("plugins.checkpoint.async_save=true", lambda options, config: options.async_save),
            "load_parts": ("plugins.checkpoint.load_path names a checkpoint",
                           lambda options, config: options.load_path is not None),
            "export_dtype": ("plugins.checkpoint.final_model_only=true or export_hf=true",
                             lambda options, config: options.final_model_only or options.export_hf)})

    @hookimpl
    def validate(self, config, plugin_config, plan):
        """checkpoint: check the options, and what load_path names against the model, before launch."""
        validate_options(config, plugin_config, plan)

    @hookimpl
    def load_checkpoint(self, state, config, run_dir, plugin_config, plan):
        """checkpoint: resume from this run's newest complete save, else from load_path or model.path, else start
        fresh."""
        self.checkpointer = Checkpointer(plugin_config, config, Path(run_dir), plan)
        return self.checkpointer.load(state)

    def started(self) -> Checkpointer:
        assert self.checkpointer is not None  # load_checkpoint made it as training began
        return self.checkpointer

    @hookimpl
    def save_checkpoint(self, state, step, final, preempted, check_finite):
        """checkpoint: save on the interval (asynchronously if asked), on preemption, and at the end, then
        export if asked."""
        return self.started().save(state, step, final, preempted, check_finite)

    @hookimpl
    def on_train_end(self):
        """checkpoint: wait for the save in flight and the deletions under way, so that the job ends with its
        folder as it will stay."""
        self.started().close()
        dist.barrier()

    @hookimpl
    def on_error(self, error):
        """checkpoint: finish the save in flight, so that the state it holds is published rather than left
        as a partial folder (it was complete before the failure)."""
        if self.checkpointer is not None:
            try:
                self.checkpointer.close()
            except Exception as failed:
                log.warning("the save in flight when the run failed did not finish: %s", failed)
