"""The hooks a titan-core plugin may implement.

A plugin is a module (or an instance) registered under the entry-point group ``titan_core.plugins``.
It implements any subset of the hooks below with ``@titan_core.hookimpl``; an implementation may take
any subset of a hook's arguments, by name.

The kinds of hooks, and who decides the order:

* Models (``describe_model``, ``build_model``) are implemented by the one model plugin that
  ``model.name`` chooses (entry-point group ``titan_core.models``); see :mod:`titan_core.description`.
* Planning (``declare``, ``validate``, ``estimate_costs``, ``plan_options``) runs in the launching process before any worker starts.
* Ordered transforms (``apply_parallelism``, ``wrap_loss``) run once per enabled plugin, in the plan's order
  (stage, then name), which the core computes from the declarations. pluggy's own LIFO order is not
  used for these, so that "PP, then TP, then CP, then AC, then compile, then FSDP" holds whatever the
  command-line order.
* Builders (``firstresult``) where one answer is needed: the core ships a default for each and fails
  before launch if two enabled plugins implement the same one.
* Events and contexts are called for every enabled plugin in plan order, then the model plugin.

Every hook may take ``plugin_config``: the calling plugin's own options (``config.plugins.<name>``, or
``config.model`` for the model plugin), so no plugin needs to know the name it was installed under.
"""

from __future__ import annotations

import pluggy

PROJECT = "titan_core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ----------------------------------------------------------------------------------------------------------------
# Planning: launching process, before any worker starts (and again in each worker, cheaply).


@hookspec
def declare(config, plugin_config):
    """Say what this plugin contributes, before anything is built. Optional: a plugin without it adds nothing
    to the plan's order or mesh.

    Called once per enabled plugin, in the launcher and in every worker. Returns a
    :class:`titan_core.plan.Declaration`: the stage of its model transform (or None), the mesh dimensions
    and degrees it needs, the capabilities (:mod:`titan_core.capabilities`) it provides (unique among
    enabled plugins) and those it requires from others.
    """


@hookspec
def validate(config, plugin_config, plan):
    """Check this plugin's options against the whole job and the model before any worker starts.

    Called once per job, in the launching process (under torchrun: in rank 0's only, so that what it reads
    is read once however many ranks there are), for each enabled plugin after the plan (mesh shape, world
    size, order, ``plan.model``: the model's :class:`titan_core.description.ModelDescription`) is known. Raise
    :class:`titan_core.errors.ConfigError` naming the offending field and the fix, in particular when the
    model's description lacks what this plugin needs; return nothing.
    """


@hookspec
def estimate_costs(estimate, config, plugin_config, plan):
    """Change one rank's estimated memory and step time as this plugin's technique changes them.

    Called by ``python -m titan_core.plan`` and the dry run, in the launching process, before anything is
    built, once per enabled plugin in plan order. ``estimate`` is a :class:`titan_core.planning.estimate.Estimate`
    that starts as the model alone on one process: change the fields the technique changes (sharding divides,
    checkpointing trades, pipelining keeps micro-batches in flight) and add its own collectives and buffers
    (``add_collective``, ``add_memory``). Returns nothing. A plugin without this hook is reported as not counted.
    """


@hookspec
def plan_options(config, plugin_config, model, world_size, hardware):
    """The settings of this plugin worth trying on a cluster, for ``python -m titan_core.plan --recommend``.

    Called once per plugin the command line enables, in the launching process, with the model's
    :class:`titan_core.description.ModelDescription`, the cluster's device count and its
    :class:`titan_core.planning.hardware.Hardware`. Returns a list of alternatives, each a dict of this
    plugin's options (``{}``: its defaults), or None in the list when the plan may leave the plugin out. The
    core tries every combination, drops those a ``validate`` refuses or that do not fit, and ranks the rest.
    A plugin without this hook is tried with its options as given.
    """


# ----------------------------------------------------------------------------------------------------------------
# Models: the model plugin named by ``model.name``.


@hookspec(firstresult=True)
def describe_model(model_config, vocab_size, seq_len):
    """Check the model's options and describe the model, without building it.

    Called in the launcher and in every worker with ``config.model`` (the model's own schema: unknown
    fields are this hook's to refuse), the tokenizer's vocabulary size and the training sequence length.
    Returns a :class:`titan_core.description.ModelDescription`; raises ConfigError for bad options.
    """


@hookspec(firstresult=True)
def build_model(description):
    """Build the model that ``description`` describes (``description.args`` are its options).

    Called once per worker under ``torch.device("meta")``: allocate nothing, initialize nothing (the core
    initializes each shard later by ``description.param_init``). Returns the root ``nn.Module``; its
    ``forward(tokens) -> logits`` must skip the ``inputs``/``outputs`` modules a pipeline stage set to None.
    """


# ----------------------------------------------------------------------------------------------------------------
# Building: in every worker, in this order.


@hookspec
def convert_float8(model, config, plugin_config, plan):
    """Swap modules for low-precision training versions, on the meta model, before any parallelism.

    Runs once after ``build_model`` in every enabled plugin that implements it; changes ``model`` in
    place and returns nothing. Parallelism applied later sees the converted modules.
    """


@hookspec
def apply_parallelism(model_parts, mesh, config, plugin_config, plan):
    """Apply this plugin's model transform: sharding, splitting, wrapping or compiling.

    Called once per enabled plugin that declared a stage, in plan order, on the meta model before
    its weights exist. ``model_parts`` is the list of modules this rank holds (one, unless a pipeline
    plugin split the model); ``plan`` is the validated :class:`titan_core.plan.Plan` (what the other
    enabled plugins provide; ``plan.model`` describes the model); ``mesh`` is the
    :class:`titan_core.mesh.ParallelMesh`. Returns a new list of model parts when the plugin replaced
    them (pipeline stages), else None (changed in place).
    """


@hookspec
def after_init(model_parts, mesh, config, plugin_config, plan):
    """Work on the model once its weights exist: materialized on the device and initialized.

    Called once per worker, in plan order, before the schedule, optimizer and checkpoint are built, for
    what cannot be done on meta parameters (e.g. wrapping in ``DistributedDataParallel``, or loading
    weights from elsewhere). Returns a new list of model parts, or None when it changed them in place.
    """


@hookspec
def wrap_loss(loss_fn, model_parts, config, plugin_config, plan):
    """Return a replacement for the loss function ``loss_fn(output, labels) -> scalar``, or None.

    Called once per worker after ``after_init`` and before ``build_schedule``, for each enabled plugin in
    plan order, each receiving the previous one's result (the core's is fp32 cross entropy of the
    model's output, the logits), e.g. to compile it. ``model_parts`` are this rank's parallelized parts,
    for a loss that uses the model's parameters (chunked cross entropy applies the logits layer itself).
    """


@hookspec(firstresult=True)
def build_schedule(model_parts, mesh, config, loss_fn, plugin_config, plan):
    """Build what runs forward and backward of one micro-batch, after weights are initialized.

    Returns an object with ``run(inputs, labels, model_kwargs) -> loss | None``: it must run the model
    parts as ``part(inputs, **model_kwargs)`` (a pipeline stage after the first takes the previous stage's
    output in place of ``inputs``, and the same keyword arguments, split into micro-batches like the
    inputs), call backward on ``loss / config.training.grad_accum_steps`` and return the detached,
    unscaled mean loss, or None on ranks that compute no loss (pipeline stages other than the last).
    Validation (``validation.every``) also calls ``evaluate(inputs, labels, model_kwargs) -> loss | None``,
    the same forward and loss without backward, under ``torch.no_grad()``; a schedule without it is
    refused when validation is on.
    ``model_kwargs`` holds per-token (batch, seq) tensors: ``document_ids`` under
    ``training.attention_mask=block_causal``, nothing otherwise. The core's default is a plain forward and
    backward on the single model part. A schedule that scales each forward's loss otherwise (a pipeline
    divides by its micro-batches too) says by what in a ``loss_weight`` attribute, which losses added
    inside the model (``titan_core.objective.add_loss``) then share.
    """


@hookspec(firstresult=True)
def build_optimizer(model_parts, config, plugin_config, plan):
    """Build the optimizer over all parameters of ``model_parts``; the core's default is AdamW."""


@hookspec(firstresult=True)
def build_lr_scheduler(optimizer, config, plugin_config, plan):
    """Build the learning-rate scheduler stepped once after every optimizer step.

    Returns a ``torch.optim.lr_scheduler.LRScheduler`` (its ``state_dict`` is checkpointed). The core's
    default warms up linearly, then decays by ``config.lr_scheduler``. The learning rate logged for a
    step is the one the optimizer used, whoever set it.
    """


@hookspec(firstresult=True)
def build_dataloader(config, tokenizer, dp_rank, dp_size, plugin_config, plan):
    """Build the training batches for this data-parallel rank.

    Returns an iterator of ``(inputs, labels)`` local batches (``global_batch_size / dp_size`` rows of
    ``seq_len`` tokens) with ``state_dict()``/``load_state_dict()`` for exact resume, and optionally
    ``metrics()``, a dict of numbers for the log. The core makes its batches ahead on a thread
    (``data.prefetch``) and saves its position as of the batches taken, so ``state_dict()`` is called after
    each batch and must return a snapshot, not a live view. The core's default reads prepared token shards
    (``data.source=tokens``: this rank's rows only) or packs documents into one global stream.
    """


# ----------------------------------------------------------------------------------------------------------------
# The training step: every worker, every step.


@hookspec
def batch_context(inputs, labels, model_kwargs, model_parts, mesh, config, plugin_config, plan):
    """Return a context manager to enter around forward and backward of one micro-batch, or None.

    Called per micro-batch in every plugin that implements it. A context may reshard the batch
    tensors in place (context parallel: the inputs, the labels and the per-token ``model_kwargs``
    alike) or change how ops dispatch (loss parallel, document attention).
    """


@hookspec
def after_optimizer_step(model_parts, optimizer, config, step, plugin_config, plan):
    """Event: ``optimizer`` has just updated the weights of ``step``; returns nothing.

    For work that must follow every weight update, such as precomputing float8 scales.
    """


@hookspec
def step_metrics(model_parts, step, config, plugin_config, plan):
    """Query: called on every rank at each step that is logged, after the optimizer step; returns a dict of
    extra metric names to numbers logged with that step (console line, metrics.jsonl, TensorBoard), or None.

    Every rank calls it at the same steps in the same plugin order, so it may use collectives; the values
    rank 0 returns are the ones logged. For what the model or a plugin measured since the last logged
    step (the routers' load over the experts).
    """


@hookspec
def on_step_end(step, metrics, config, plugin_config, plan):
    """Event: ``step`` has finished; ``metrics`` is a dict of the values logged for it, on every rank.

    ``metrics`` is empty on steps that were not logged. Returns nothing.
    """


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints.


@hookspec(firstresult=True)
def load_checkpoint(state, config, run_dir, plugin_config, plan):
    """Restore ``state`` (a :class:`titan_core.train.TrainState`) in place before the first step.

    Called once per worker after everything is built; ``run_dir`` is the job's run dir, the same on
    every rank and across restarts of the world. Returns the step it restored (0 for weights
    only), or None to start from scratch. No default: without a checkpoint plugin every run starts
    fresh.
    """


@hookspec(firstresult=True)
def save_checkpoint(state, step, config, final, check_finite, plugin_config, plan):
    """Save ``state`` after ``step``'s optimizer step, if this plugin's policy says so.

    Called on every rank after each step but the last with ``final=False``, then once after the loop
    with ``final=True`` (also when no step ran: ``training.steps=0`` writes the initial weights).
    Before writing, call ``check_finite()``: the core keeps whether every step's loss and gradients were
    finite on the device and asks (a host sync) only on logged steps, so a step that is not logged may have
    updated the weights with NaN; it raises ``FloatingPointError`` then, and nothing must be written.
    Returns the path written (or being written in the background), or None when nothing was saved.
    """


@hookspec
def on_train_end(state, config, plugin_config, plan):
    """Event: the last step has run and its checkpoint hook returned; returns nothing."""
