"""The hooks a titan-core plugin may implement: the contract.

A plugin is a module, an instance, or a class (or factory) that the core calls with no arguments once per
run, registered under the entry-point group ``titan_core.plugins`` (models: ``titan_core.models``). It
implements any subset of the hooks below with ``@titan_core.hookimpl``, taking any subset of a hook's arguments
by name; a plugin object with ``state_dict()``/``load_state_dict()`` has that state checkpointed (``Stateful``).

Who is called, and how the answers combine:

* Models (``describe_model``, ``build_model``, ``hf_model_options``): the one model plugin that ``model.name``
  selects (``hf_model_options``: every installed one when it is null).
* Planning (``declare``, ``validate``): in the launching process, before any worker starts. What a plan costs
  is the planner's, beside this contract: its own hooks (``titan_core.planner.hookspecs``) are implemented in a
  plugin's pricing module, registered under ``titan_core.costs``, which training never loads.
* Ordered hooks (``convert_modules``, ``apply_parallelism``, ``after_init``, ``wrap_loss``, ``wrap_optimizer``) and
  events: every enabled plugin that implements the hook, one at a time in plan order (stage, then name; plugins
  without a stage last), then the model plugin. pluggy's own order (last registered first) is not used, so that
  "PP, then TP, then CP, then AC, then compile, then FSDP" holds whatever the command-line order; pluggy's
  ``tryfirst``, ``trylast`` and wrappers are therefore refused before launch.
* ``start_tracking``: every enabled plugin implementing it, in plan order, on rank 0 only.
* Builders (``firstresult``): the one enabled plugin implementing the hook, else the core's default
  (:mod:`titan_core.default_hooks`); two enabled plugins implementing one builder are refused before launch.

Every hook that runs once the plan exists may take ``plugin_config``, the plugin's own options
(``config.plugins.<name>``, or ``config.model`` for the model plugin: a plugin never needs the name it was
installed under), and ``plan``, the validated :class:`titan_core.Plan` whose ``plan.model`` describes the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pluggy
import torch
from omegaconf import DictConfig
from torch import nn

from titan_core.description import ModelDescription
from titan_core.mesh import ParallelMesh
from titan_core.plan import Declaration, Plan
from titan_core.protocols import Batches, Schedule, Tokenizer
from titan_core.train_state import TrainState

PROJECT = "titan_core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------
# Planning: the launching process, before any worker starts.


@hookspec
def declare(config: DictConfig, plugin_config: DictConfig) -> Declaration | None:
    """Say what this plugin contributes, before anything is built.

    Runs once per enabled plugin in the launcher and again in every worker (it must be cheap and read
    nothing). Optional: a plugin without it adds nothing to the plan's order or mesh.

    :param config: The whole job config.
    :param plugin_config: This plugin's options.
    :returns: A :class:`titan_core.Declaration`: the stage of its model transform (or None), the mesh
        dimensions and degrees it needs, the capabilities it provides (unique among enabled plugins) and
        those it requires from others.
    """


@hookspec
def validate(config: DictConfig, plugin_config: DictConfig, plan: Plan) -> None:
    """Check this plugin's options against the whole job and the model before any worker starts.

    Runs once per job in the launching process (under torchrun: rank 0's only, so that what it reads is read once),
    for each enabled plugin in plan order, once the plan (mesh, world size, order, ``plan.model``) is known. Raise
    :class:`titan_core.ConfigError` naming the field and the fix, in particular when the model's description lacks
    what this plugin needs (:func:`titan_core.lacks`): a plugin that cannot apply must never train silently wrong.

    :param config: The whole job config.
    :param plugin_config: This plugin's options.
    :param plan: The plan being checked.
    """


# ----------------------------------------------------------------------------------------------------------------
# Models: the model plugin named by ``model.name``.


@hookspec(firstresult=True)
def describe_model(model_config: DictConfig, vocab_size: int, seq_len: int) -> ModelDescription:
    """Check the model's options and describe the model, without building it.

    Runs in the launcher and in every worker, on the model plugin only.

    :param model_config: ``config.model``: the model's own options (unknown fields are this hook's to refuse,
        :func:`titan_core.read_options`).
    :param vocab_size: The tokenizer's vocabulary size.
    :param seq_len: The training sequence length.
    :returns: A :class:`titan_core.ModelDescription`; raise ConfigError for bad options.
    """


@hookspec
def hf_model_options(hf_config: dict[str, Any], selected: bool) -> dict[str, Any] | None:
    """The ``model.*`` options that rebuild the model a Hugging Face ``config.json`` describes.

    Runs in the launcher and in every worker when ``model.path`` names a Hugging Face folder, before
    ``describe_model``: on the model plugin ``model.name`` selects or, when it is null, on every installed model
    plugin (exactly one must answer; a generic backend, which reads any ``model_type``, then answers None).

    :param hf_config: The folder's ``config.json`` (transformers 4 or 5 field names).
    :param selected: Whether ``model.name`` names this plugin (False: every installed one is asked).
    :returns: The options (``name`` included) reproducing every field that changes the model's output, or None
        when the file is not of this plugin's family (its ``model_type``).
    """


@hookspec(firstresult=True)
def build_model(description: ModelDescription) -> nn.Module:
    """Build the model that ``description`` describes.

    Runs once per worker under ``torch.device("meta")``, on the model plugin only: allocate nothing,
    initialize nothing (the core initializes each shard later by ``description.param_init``).

    :param description: What ``describe_model`` returned; ``description.args`` are the model's options.
    :returns: The root module; its ``forward(tokens, **model_kwargs) -> logits`` must skip the
        ``inputs``/``outputs`` modules a pipeline stage set to None.
    """


# ----------------------------------------------------------------------------------------------------------------
# Building: in every worker, in this order.


@hookspec
def convert_modules(model: nn.Module, config: DictConfig, plugin_config: DictConfig, plan: Plan) -> None:
    """Swap modules of the model for other implementations: low precision (float8), adapters (LoRA), fake quantization.

    Runs once per worker on the meta model after ``build_model`` and before any parallelism, in every plugin
    implementing it, in plan order: each sees the modules the previous ones converted, and the parallelism applied later
    sees the result. Where two or more plugins convert, the launcher first runs them all once on a meta model of its
    own, so that one refusing what another made (:class:`ConfigError`) fails before launch. Change only ``model``, in
    place, keeping parameter names where the parameters are the same (``titan_core.replace``). A conversion whose
    linears compute on a narrower format may mark them for tensor parallel's gathers (``titan_core.cast_gathers``);
    one computing beside a linear drops that mark (``titan_core.keep_precision``).

    :param model: The whole model, on the meta device.
    :param config: The whole job config.
    :param plugin_config: This plugin's options.
    :param plan: The validated plan.
    """


@hookspec
def apply_parallelism(model_parts: list[nn.Module], mesh: ParallelMesh, config: DictConfig,
                      plugin_config: DictConfig, plan: Plan) -> list[nn.Module] | None:
    """Apply this plugin's model transform: sharding, splitting, wrapping or compiling.

    Runs once per worker for each enabled plugin that declared a stage, in plan order, on the meta model
    before its weights exist; each sees the previous transforms' result.

    :param model_parts: The modules this rank holds (one, unless a pipeline plugin split the model).
    :param mesh: The job's :class:`titan_core.ParallelMesh`.
    :param config: The whole job config.
    :param plugin_config: This plugin's options.
    :param plan: The validated plan (what the other enabled plugins provide; ``plan.model``).
    :returns: A new list of model parts when the plugin replaced them (pipeline stages), else None.
    """


@hookspec
def after_init(model_parts: list[nn.Module], mesh: ParallelMesh, config: DictConfig, plugin_config: DictConfig,
               plan: Plan) -> list[nn.Module] | None:
    """Work on the model once its weights exist: materialized on the device and initialized.

    Runs once per worker, in plan order then the model plugin, before the schedule, optimizer and
    checkpoint are built: for what cannot be done on meta parameters (wrapping in
    ``DistributedDataParallel``, per-parameter hooks, loading weights from elsewhere).

    :returns: A new list of model parts, or None when it changed them in place.
    """


@hookspec
def wrap_loss(loss_fn: LossFn, model_parts: list[nn.Module], config: DictConfig, plugin_config: DictConfig,
              plan: Plan) -> LossFn | None:
    """Replace the loss function ``loss_fn(output, labels) -> scalar``: the loss **summed** over the tokens whose
    label is not :data:`titan_core.IGNORE_INDEX`.

    Runs once per worker after ``after_init`` and before ``build_schedule``, in plan order, each plugin
    receiving the previous one's result (the core's is fp32 cross entropy of the logits). The schedule calls
    the last one multiplied by the step's scale (:mod:`titan_core.objective`), which makes it the mean loss per
    trained token of the global batch, whatever the plan.

    :param loss_fn: The loss so far.
    :param model_parts: This rank's parallelized parts, for a loss that uses the model's parameters
        (chunked cross entropy applies the logits layer itself).
    :returns: The replacement, or None to keep ``loss_fn``.
    """


@hookspec(firstresult=True)
def build_schedule(model_parts: list[nn.Module], mesh: ParallelMesh, config: DictConfig, loss_fn: LossFn,
                   plugin_config: DictConfig, plan: Plan) -> Schedule:
    """Build what runs forward and backward of one micro-batch, after the weights are initialized.

    Runs once per worker; the one enabled plugin implementing it answers, else the core's forward and backward.

    :returns: A :class:`titan_core.Schedule`: its ``run(inputs, labels, model_kwargs)`` runs the model parts as
        ``part(inputs, **model_kwargs)`` (a pipeline stage after the first takes the previous stage's output
        in place of ``inputs``, and the same keyword arguments split into micro-batches like the inputs), calls
        backward on ``loss * loss_weight`` and returns the detached loss before that weight, or None on ranks
        that compute no loss (pipeline stages other than the last). ``loss_weight`` (an attribute; default
        ``1 / training.grad_accum_steps``) is what each forward's loss is scaled by, which losses the model
        adds inside its forward (:func:`titan_core.add_loss`) share. Validation also calls
        ``evaluate(inputs, labels, model_kwargs) -> loss | None``, the same forward without backward, under
        ``torch.no_grad()``; a schedule without it is refused when validation is on. ``model_kwargs`` holds
        per-token (batch, seq) tensors: ``document_ids`` under ``training.attention_mask=block_causal``.
    """


@hookspec(firstresult=True)
def build_optimizer(model_parts: list[nn.Module], config: DictConfig, plugin_config: DictConfig,
                    plan: Plan) -> torch.optim.Optimizer:
    """Build the optimizer over the trainable parameters of ``model_parts``.

    Runs once per worker; the one enabled plugin implementing it answers, else the core's AdamW over the groups
    :func:`titan_core.param_groups` makes of the parameters' roles. The planner steps it once on one small
    parameter to measure its state and traffic per parameter, so any plugin's optimizer is priced (docs/planner.md).

    :returns: A ``torch.optim.Optimizer`` (its ``state_dict`` is checkpointed).
    """


@hookspec(firstresult=True)
def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: DictConfig, plugin_config: DictConfig,
                       plan: Plan) -> torch.optim.lr_scheduler.LRScheduler:
    """Build the learning-rate scheduler stepped once after every optimizer step.

    Runs once per worker; the one enabled plugin implementing it answers, else the core's (linear warm-up,
    then ``lr_scheduler.decay``). The learning rate logged for a step is the one the optimizer used.

    :returns: A ``torch.optim.lr_scheduler.LRScheduler`` (its ``state_dict`` is checkpointed).
    """


@hookspec(firstresult=True)
def build_dataloader(config: DictConfig, tokenizer: Tokenizer, dp_rank: int, dp_size: int, plugin_config: DictConfig,
                     plan: Plan) -> Batches:
    """Build the training batches for this data-parallel rank.

    Runs once per worker; the one enabled plugin implementing it answers, else the core's loader (prepared
    token shards, or documents packed into one global stream). The core makes batches ahead on a thread
    (``data.prefetch``) and saves its position as of the batches taken.

    :param tokenizer: The run's tokenizer (:class:`titan_core.Tokenizer`).
    :param dp_rank: This rank's index among the ``dp_size`` data-parallel ranks of every replica group
        (``Plan.data_shard``, ``Plan.data_shards``).
    :returns: :class:`titan_core.Batches`: ``(inputs, labels)`` local batches (``global_batch_size / dp_size`` rows
        of ``seq_len`` tokens), ``state_dict()`` a snapshot taken after each batch, and optionally ``metrics()``.
    """


@hookspec(firstresult=True)
def build_validation_batches(config: DictConfig, tokenizer: Tokenizer, dp_rank: int, dp_size: int,
                             plugin_config: DictConfig, plan: Plan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Build the held-out batches every evaluation uses, for this data-parallel rank.

    Runs once per worker when ``validation.every > 0``; the one enabled plugin implementing it answers, else the
    core's. A job whose training batches come from a plugin without it is refused before launch.

    :returns: ``validation.batches`` local batches ``(inputs, labels)``, shaped like the training batches.
    """


# ----------------------------------------------------------------------------------------------------------------
# The training step: every worker, every step.


@hookspec
def batch_context(inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict[str, torch.Tensor],
                  micro_batch: int, micro_batches: int, model_parts: list[nn.Module], mesh: ParallelMesh,
                  config: DictConfig, plugin_config: DictConfig,
                  plan: Plan) -> contextlib.AbstractContextManager | None:
    """A context to enter around forward and backward of one micro-batch.

    Runs per micro-batch (training and validation), in every plugin implementing it, in plan order; the
    contexts are entered in that order and left in reverse. A context may reshard the batch tensors in place
    (context parallel: the inputs, the labels and the per-token ``model_kwargs`` alike), change how ops
    dispatch (loss parallel, document attention), or decide what backward does on this micro-batch (FSDP
    skips its gradient reduction on all but the last).

    :param micro_batch: This micro-batch's index in the step, from 0.
    :param micro_batches: The step's micro-batches (``training.grad_accum_steps``).
    :returns: A context manager, or None.
    """


@hookspec
def after_backward(model_parts: list[nn.Module], mesh: ParallelMesh, step: int, config: DictConfig,
                   plugin_config: DictConfig, plan: Plan) -> None:
    """Event: the last backward of ``step`` is done; every gradient of this rank is accumulated, none clipped yet.

    Runs once per step on every rank, in plan order, before the gradient norm and clipping: where a plugin
    that defines a data-parallel dimension averages the gradients over it (under a pipeline too: every
    stage's backward has run), or inspects or changes gradients.
    """


@hookspec
def wrap_optimizer(optimizer: torch.optim.Optimizer, state: TrainState, mesh: ParallelMesh, config: DictConfig,
                   plugin_config: DictConfig, plan: Plan) -> torch.optim.Optimizer | None:
    """Transform: what each training step calls as its optimizer, ``zero_grad()`` as the step starts and
    ``step()`` after the gradients are averaged and clipped.

    Runs once per rank, after the state is built and any checkpoint loaded, before the first step, in plan order,
    each plugin given what the one before returned. A wrapper steps the optimizer it wraps or skips the whole
    update (fault tolerance: only the steps every replica group commits); the learning-rate schedule, checkpoints
    and ``after_optimizer_step`` keep ``state.optimizer``. A plugin may keep ``state`` to restore it in place.

    :returns: The object to call instead, or None to leave it.
    """


@hookspec
def after_optimizer_step(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer, config: DictConfig,
                         step: int, plugin_config: DictConfig, plan: Plan) -> None:
    """Event: ``optimizer`` has just updated the weights of ``step`` (and the learning rate was stepped).

    Runs once per step on every rank, in plan order: for work that must follow every weight update, such as
    precomputing float8 scales.
    """


@hookspec
def step_metrics(model_parts: list[nn.Module], mesh: ParallelMesh, step: int, config: DictConfig,
                 plugin_config: DictConfig, plan: Plan) -> dict[str, float] | None:
    """Query: extra numbers to log with ``step``.

    Runs on every rank at each logged step, after the optimizer step, in plan order: every rank calls it at
    the same steps in the same order, so it may use collectives (over ``mesh``'s groups). The values rank 0
    returns are logged (console line, metrics.jsonl, TensorBoard); the dicts of all plugins are merged.

    :returns: Metric names to numbers, or None.
    """


@hookspec
def on_step_end(step: int, metrics: dict[str, float], config: DictConfig, plugin_config: DictConfig,
                plan: Plan) -> None:
    """Event: ``step`` has finished.

    Runs once per step on every rank, in plan order, after the step's metrics and before its checkpoint hook.

    :param metrics: The values logged for the step (empty on steps that were not logged); on rank 0, those of
        its ``metrics.jsonl`` line, which an experiment tracker sends on (see ``start_tracking``).
    """


@hookspec
def start_tracking(run_dir: Path, run: dict[str, Any], first_step: int, config: DictConfig,
                   plugin_config: DictConfig, plan: Plan) -> None:
    """Event: rank 0 is about to train; an experiment tracker starts its run (or continues it, resumed).

    Runs on rank 0 only, in plan order, once per run after the checkpoint is loaded and before the first step.
    A tracker is a metrics sink made of events: it records ``config`` and ``run`` here, rank 0's ``metrics`` in
    ``on_step_end`` (the validation loss, on validated steps), and ends its run in ``on_train_end`` (preempted
    or finished) or ``on_error``, which run on every rank: it acts only where it started.

    :param run: What ``run.json`` holds: the overrides, the versions, the git commit, the host, the world.
    :param first_step: The first step this process trains: above 1 when resumed from a checkpoint.
    """


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints, the end of a run, and failures.


@hookspec(firstresult=True)
def load_checkpoint(state: TrainState, config: DictConfig, run_dir: Path, plugin_config: DictConfig,
                    plan: Plan) -> int | None:
    """Restore ``state`` in place before the first step.

    Runs once per worker after everything is built; no default: without a checkpoint plugin every run starts
    fresh. A checkpointing plugin also restores ``state.plugins``' states (:class:`titan_core.Stateful`).

    :param state: The :class:`titan_core.TrainState` to fill.
    :param run_dir: The job's run dir, the same on every rank and across restarts of the world.
    :returns: The step it restored (0 for weights only), or None to start from scratch.
    """


@hookspec(firstresult=True)
def save_checkpoint(state: TrainState, step: int, config: DictConfig, final: bool, preempted: bool,
                    check_finite: Callable[[], None], plugin_config: DictConfig, plan: Plan) -> Path | None:
    """Save ``state`` after ``step``'s optimizer step, if this plugin's policy says so.

    Runs on every rank after each step but the last with ``final=False``, once after the loop with ``final=True``
    (also when no step ran: ``training.steps=0`` writes the initial weights), and, when the run is stopped by SIGTERM
    or SIGINT, once after the step it finished with ``preempted=True``: then the whole training state must be written
    before returning, whatever the policy, so that running the same command again resumes there.

    :param check_finite: Call it before writing: the core keeps whether every step's loss and gradients were
        finite on the device and asks (a host sync) only on logged steps, so a step that is not logged may
        have updated the weights with NaN; it raises ``FloatingPointError`` then, and nothing must be written.
    :returns: The path written (or being written in the background), or None when nothing was saved.
    """


@hookspec
def on_train_end(state: TrainState, preempted: bool, run_dir: Path, config: DictConfig, plugin_config: DictConfig,
                 plan: Plan) -> None:
    """Event: training ended and its last checkpoint hook returned.

    Runs once per worker, on every rank, in plan order; not after a failure (``on_error`` runs then).

    :param preempted: True when a signal stopped the run before ``training.steps`` (its state was saved if a
        checkpoint plugin is on); False when every step ran.
    :param run_dir: The job's run dir, where a plugin writes what the run leaves (an adapter export).
    """


@hookspec
def on_error(error: BaseException, step: int, config: DictConfig, plugin_config: DictConfig, plan: Plan) -> None:
    """Event: the run failed on this rank; it is about to exit with one line.

    Runs on every rank whose run failed, in plan order, once the plan exists (never for a job refused before
    launch): for what must still happen on the way out (finishing a save in flight, marking a tracked run failed).
    An error raised here is logged and does not replace ``error``; do not wait on other ranks.

    :param error: What failed (a timeout, a NaN loss, a plugin's exception); on a rank another's failure reached,
        a ``RankFailed`` whose message is that rank's line and whose ``__cause__`` is what this rank saw.
    :param step: The step the run was in when it failed (0 before the first began).
    """
