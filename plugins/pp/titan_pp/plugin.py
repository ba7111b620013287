"""Pipeline parallel: the model split into stages over the ``pp`` mesh dimension, run by a torch schedule.

``apply_parallelism`` (first, at stage 100) replaces the meta model by this rank's stages, each a copy
of the whole model with the other blocks deleted and, as the model's description says, the modules
before the blocks (``inputs``) kept only on the first stage and those after them (``outputs``) only on
the last. Parameter names stay those of the whole model and the later transforms (TP, compile, FSDP)
apply to each stage as to a whole model. ``build_schedule``
wraps the materialized stages in ``torch.distributed.pipelining`` stages and schedule.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from pathlib import Path

import torch
from torch.distributed.pipelining import PipelineStage, schedules

from titan_core import (COMPILE, PIPELINE, PP, SPLIT_BACKWARD, ConfigError, Declaration, ModelDescription,
                        hookimpl, lacks, replace)
from titan_pp.layout import Layout, schedule_kind, schedule_name, stage_layout

log = logging.getLogger("titan_core")
STAGE = 100  # first: the later transforms then see one stage per model part


@hookimpl
def declare(plugin_config):
    """pp: stage 100, the pp mesh dimension; split backward for a zero-bubble schedule; a schedule file replaces
    the named schedule."""
    split = {SPLIT_BACKWARD} if schedule_kind(plugin_config).zero_bubble else set()
    return Declaration(stage=STAGE, mesh={PP: plugin_config.degree}, provides=frozenset({PIPELINE, *split}),
                       acts_only={"schedule": ("plugins.pp.schedule_csv=null",
                                               lambda options, config: options.schedule_csv is None)})


@hookimpl
def validate(config, plugin_config, plan):
    for what in ("blocks", "inputs", "outputs"):
        if getattr(plan.model, what) is None:
            raise ConfigError("plugins.pp", lacks(plan.model, what, "pipeline parallel (the split points)"),
                              "remove pp from +plugins=[...], or describe the model's blocks, inputs and outputs")
    layout = _layout(plugin_config, plan)
    if schedule_kind(plugin_config).zero_bubble and plan.provides(COMPILE):
        raise ConfigError("plugins.pp.schedule", f"{schedule_name(plugin_config)} splits backward into input and "
                          "weight halves, which torch refuses for compiled stages",
                          "use GPipe, 1F1B, Interleaved1F1B or LoopedBFS with compile, or disable compile")
    training = config.training
    split = plan.dp_size * training.grad_accum_steps
    if training.global_batch_size % split == 0 and (training.global_batch_size // split) % layout.microbatches:
        per_step = training.global_batch_size // split
        raise ConfigError("plugins.pp.microbatches", f"{per_step} sequences per pipeline step (global batch / "
                          f"data-parallel ranks / grad_accum_steps) do not split into {layout.microbatches} "
                          "micro-batches", "choose microbatches dividing that number, or change the batch")


@hookimpl
def apply_parallelism(model_parts, mesh, plugin_config, plan):
    """pp: replace the model by the stages this rank runs."""
    (model,) = model_parts
    layout = _layout(plugin_config, plan)
    stages = layout.stages_of(mesh.local_rank(PP))
    log.info("pipeline: %s, %d micro-batches; this rank runs %s", plugin_config.schedule, layout.microbatches,
             ", ".join(f"stage {s}/{layout.num_stages} (blocks {_span(layout.blocks[s])})" for s in stages))
    return [stage_module(model, plan.model, layout, stage) for stage in stages]


def _span(blocks: tuple[int, ...]) -> str:
    return f"{blocks[0]}-{blocks[-1]}" if blocks else "none"


def stage_module(model: torch.nn.Module, description: ModelDescription, layout: Layout,
                 stage: int) -> torch.nn.Module:
    """A copy of the (meta) model keeping only what ``stage`` runs; its forward skips the parts set to None."""
    # validate refused a model that does not describe its split points
    assert description.inputs is not None and description.outputs is not None
    part = copy.deepcopy(model)
    blocks = description.blocks_of(part)
    keep = {str(i) for i in layout.blocks[stage]}
    for name in [n for n in blocks if n not in keep]:
        del blocks[name]
    dropped = (description.inputs if stage != 0 else ()) + (
        description.outputs if stage != layout.num_stages - 1 else ())
    for name in dropped:
        replace(part, name, None)
    return part


class PipelineStep:
    """One pipeline step over a local batch: the schedule runs its micro-batches forward and backward.

    The loss handed to torch is scaled by micro-batches x grad-accum steps and torch's own gradient
    scaling is off: torch would divide every gradient the stage holds, including those accumulated by
    the previous grad-accum steps.
    """

    def __init__(self, schedule_name: str, stages: list[PipelineStage], microbatches: int, loss_fn,
                 grad_accum_steps: int, schedule_csv: str | None = None):
        """``schedule_csv``: a pipeline-order file whose actions torch's runtime runs instead of ``schedule_name``'s."""
        self.holds_first = any(s.is_first for s in stages)
        self.holds_last = any(s.is_last for s in stages)
        self.loss_fn = loss_fn
        self.scale = microbatches * grad_accum_steps
        self.loss_weight = 1 / self.scale  # for losses the model adds inside its stages (titan_core.objective)
        schedule_class = (schedules.get_schedule_class(schedule_name) if schedule_csv is None
                          else schedules._PipelineScheduleRuntime)
        looped = issubclass(schedule_class, schedules.PipelineScheduleMulti)
        self.schedule = schedule_class(stages if looped else stages[0], n_microbatches=microbatches,
                                       loss_fn=self.scaled_loss, scale_grads=False)
        if schedule_csv is not None:  # checked before launch: titan_pp.csv_schedule
            self.schedule._load_csv(str(Path(schedule_csv).expanduser()))
            log.info("pp: torch's pipeline runtime runs the %d actions of %s on this rank", sum(
                action is not None for action in self.schedule.pipeline_order[stages[0].group_rank]), schedule_csv)
        # torch's eval() of a schedule of several stages per rank still runs the order's backward actions, and
        # those of the V-shaped schedules (ZBV, DualPipeV) fail without a backward (torch 2.13): evaluation runs
        # the same schedule (whose eval/train switch re-prepares the stages) with its forward actions only.
        self.forward_order = forward_actions(self.schedule.pipeline_order_with_comms) if looped else None

    def scaled_loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(outputs, labels) / self.scale

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict) -> torch.Tensor | None:
        return self._pass(self.schedule.step, inputs, labels, model_kwargs)

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict) -> torch.Tensor | None:
        if self.forward_order is None:
            return self._pass(self.schedule.eval, inputs, labels, model_kwargs)
        training_order, self.schedule.pipeline_order_with_comms = (self.schedule.pipeline_order_with_comms,
                                                                   self.forward_order)
        try:
            return self._pass(self.schedule.eval, inputs, labels, model_kwargs)
        finally:
            self.schedule.pipeline_order_with_comms = training_order

    def _pass(self, schedule_pass, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict):
        # torch also calls the loss function to infer shapes on the first step: take the
        # micro-batches' losses from the schedule rather than counting calls.
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.holds_first else ()
        # Every stage takes the keyword arguments (document ids), split into micro-batches like the inputs.
        schedule_pass(*args, target=labels if self.holds_last else None, losses=losses, return_outputs=False,
                      **model_kwargs)
        if not self.holds_last:
            return None
        # The core averages the losses of a step's forwards (its scale makes their mean the step's loss).
        return torch.stack(losses).detach().mean() * self.scale


# The actions of a lowered pipeline order that a forward-only pass keeps.
FORWARD_ACTIONS = (schedules.FORWARD, schedules.SEND_F, schedules.RECV_F, schedules.UNSHARD, schedules.RESHARD)


def forward_actions(order: dict[int, list]) -> dict[int, list]:
    """The forwards of a lowered pipeline order, with their sends, receives and FSDP (un)shards."""
    def forwards(action):
        if action.computation_type == schedules.OVERLAP_F_B:  # DualPipeV: a forward run beside a backward
            return [a for a in action.sub_actions if a.computation_type == schedules.FORWARD]
        return [action] if action.computation_type in FORWARD_ACTIONS else []
    return {rank: [kept for action in actions for kept in forwards(action)] for rank, actions in order.items()}


@hookimpl
def build_schedule(model_parts, mesh, config, loss_fn, plugin_config, plan):
    """pp: wrap the materialized stages in torch pipeline stages and the configured schedule."""
    layout = _layout(plugin_config, plan)
    group = mesh.submesh(PP).get_group()
    device = next(model_parts[0].parameters()).device
    stages = [TracelessStage(part, index, layout.num_stages, device, group=group)
              for part, index in zip(model_parts, layout.stages_of(mesh.local_rank(PP)))]
    return PipelineStep(plugin_config.schedule, stages, layout.microbatches, loss_fn,
                        config.training.grad_accum_steps, plugin_config.schedule_csv)


class TracelessStage(PipelineStage):
    """A pipeline stage whose shape inference leaves the model's buffers as it found them.

    torch learns a stage's shapes by running it forward and backward on placeholder inputs at the first step (and
    again when a pass switches between training and evaluation): passes no one trained on, which would otherwise
    count into a router's token counts (and so move its balancing bias) or a norm's running statistics; under
    activation checkpointing the backward replays the forward too.
    """

    def _forward_metadata_inference(self, *args, **kwargs):
        with self._buffers_kept():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args, **kwargs):
        with self._buffers_kept():
            return super()._backward_metadata_inference(*args, **kwargs)

    @contextlib.contextmanager
    def _buffers_kept(self):
        saved = [(buffer, buffer.clone()) for buffer in self.submod.buffers()]
        try:
            yield
        finally:
            # Only the changed ones: an unchanged buffer (a RoPE table) is in the graph torch then differentiates.
            with torch.no_grad():
                for buffer, value in saved:
                    if not torch.equal(buffer, value):
                        buffer.copy_(value)


def _layout(plugin_config, plan) -> Layout:
    return stage_layout(plugin_config, plan.model.n_layers, plan.degree(PP))
