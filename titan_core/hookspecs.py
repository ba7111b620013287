"""The hooks a titan-core plugin may implement.

A plugin is a module (or an instance) registered under the entry-point group ``titan_core.plugins``.
It implements any subset of the hooks below with ``@titan_core.hookimpl``; an implementation may take
any subset of a hook's arguments, by name.

Three kinds of hooks, and who decides the order:

* Planning (``declare``, ``validate``) runs in the launching process before any worker starts.
* Ordered transforms (``apply_parallelism``, ``wrap_loss``) run once per enabled plugin, in the plan's order
  (stage, then name), which the core computes from the declarations. pluggy's own LIFO order is not
  used for these, so that "PP, then TP, then CP, then AC, then compile, then FSDP" holds whatever the
  command-line order.
* Builders (``firstresult``) where one answer is needed: the core ships a default for each and fails
  before launch if two enabled plugins implement the same one. Events are broadcast to every plugin.
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
    """Say what this plugin contributes, before anything is built.

    Called once per enabled plugin with the whole job config and the plugin's own node
    (``config.plugins.<name>``). Returns a :class:`titan_core.plan.Declaration`: the stage of its
    model transform (or None), the mesh dimensions and degrees it needs, the capabilities it provides
    (unique among enabled plugins) and those it requires from others.
    """


@hookspec
def validate(config, plugin_config, plan):
    """Check this plugin's options against the whole job before any worker starts.

    Called once per enabled plugin after the plan (mesh shape, world size, order) is known. Raise
    :class:`titan_core.errors.ConfigError` naming the offending field and the fix; return nothing.
    """


# ----------------------------------------------------------------------------------------------------------------
# Building: in every worker, in this order.


@hookspec(firstresult=True)
def build_model(config, model_args):
    """Build the model on the meta device (the core enters ``torch.device("meta")`` around the call).

    ``model_args`` are the core's resolved :class:`titan_core.model.LlamaArgs`. Returns an ``nn.Module``
    that follows the core's model protocol (``layers`` as a ModuleDict of blocks, ``init_weights(seed)``),
    or None to leave it to the next implementation; the core's Llama is the default.
    """


@hookspec
def convert_float8(model, config):
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
    enabled plugins provide); ``mesh`` is the :class:`titan_core.mesh.ParallelMesh`. Returns a new list
    of model parts when the plugin replaced them (pipeline stages), else None (changed in place).
    """


@hookspec
def wrap_loss(loss_fn, config):
    """Return a replacement for the loss function ``loss_fn(logits, labels) -> scalar``, or None.

    Called once per worker before ``build_schedule``, for each enabled plugin in plan order, each
    receiving the previous one's result (the core's is fp32 cross entropy), e.g. to compile it.
    """


@hookspec(firstresult=True)
def build_schedule(model_parts, mesh, config, loss_fn):
    """Build what runs forward and backward of one micro-batch, after weights are initialized.

    Returns an object with ``run(inputs, labels) -> loss | None``: it must call backward on
    ``loss / config.training.grad_accum_steps`` and return the detached, unscaled mean loss, or None
    on ranks that compute no loss (pipeline stages other than the last). The core's default is a
    plain forward and backward on the single model part.
    """


@hookspec(firstresult=True)
def build_optimizer(model_parts, config):
    """Build the optimizer over all parameters of ``model_parts``; the core's default is AdamW."""


@hookspec(firstresult=True)
def build_dataloader(config, tokenizer, dp_rank, dp_size):
    """Build the training batches for this data-parallel rank.

    Returns an iterator of ``(inputs, labels)`` local batches (``global_batch_size / dp_size`` rows of
    ``seq_len`` tokens) with ``state_dict()``/``load_state_dict()`` for exact resume. The core's
    default packs documents of ``config.data`` into one global stream and gives each rank its rows.
    """


# ----------------------------------------------------------------------------------------------------------------
# The training step: every worker, every step.


@hookspec
def batch_context(inputs, labels, model_parts, mesh, config):
    """Return a context manager to enter around forward and backward of one micro-batch, or None.

    Called per micro-batch in every plugin that implements it. A context may reshard the batch
    tensors in place (context parallel) or change how ops dispatch (loss parallel).
    """


@hookspec
def after_optimizer_step(model_parts, config, step):
    """Event: the optimizer has just updated the weights of ``step``; returns nothing.

    For work that must follow every weight update, such as precomputing float8 scales.
    """


@hookspec
def on_step_end(step, metrics, config):
    """Event: ``step`` has finished; ``metrics`` is a dict of the values logged for it, on every rank.

    ``metrics`` is empty on steps that were not logged. Returns nothing.
    """


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints.


@hookspec(firstresult=True)
def load_checkpoint(state, config, run_dir):
    """Restore ``state`` (a :class:`titan_core.train.TrainState`) in place before the first step.

    Called once per worker after everything is built; ``run_dir`` is the job's run dir, the same on
    every rank and across restarts of the world. Returns the step it restored (0 for weights
    only), or None to start from scratch. No default: without a checkpoint plugin every run starts
    fresh.
    """


@hookspec(firstresult=True)
def save_checkpoint(state, step, config, final):
    """Save ``state`` after ``step``'s optimizer step, if this plugin's policy says so.

    Called on every rank after each step but the last with ``final=False``, then once after the loop
    with ``final=True`` (also when no step ran: ``training.steps=0`` writes the initial weights).
    Returns the path written (or being written in the background), or None when nothing was saved.
    """


@hookspec
def on_train_end(state, config):
    """Event: the last step has run and its checkpoint hook returned; returns nothing."""
