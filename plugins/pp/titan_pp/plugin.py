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
from types import SimpleNamespace

import torch
from torch.distributed.pipelining import PipelineStage, schedules

from titan_core import (COMPILE, PIPELINE, PP, SPLIT_BACKWARD, ConfigError, Declaration, ModelDescription, drop,
                        hookimpl, lacks)
from titan_pp.layout import Layout, schedule_kind, stage_layout

log = logging.getLogger("titan_core")
STAGE = 100  # first: the later transforms then see one stage per model part


@hookimpl
def declare(plugin_config):
    split = {SPLIT_BACKWARD} if schedule_kind(plugin_config).zero_bubble else set()
    return Declaration(stage=STAGE, mesh={PP: plugin_config.degree}, provides=frozenset({PIPELINE, *split}))


@hookimpl
def validate(config, plugin_config, plan):
    for what in ("blocks", "inputs", "outputs"):
        if getattr(plan.model, what) is None:
            raise ConfigError("plugins.pp", lacks(plan.model, what, "pipeline parallel (the split points)"),
                              "remove pp from +plugins=[...], or describe the model's blocks, inputs and outputs")
    layout = _layout(plugin_config, plan)
    if schedule_kind(plugin_config).zero_bubble and plan.provides(COMPILE):
        raise ConfigError("plugins.pp.schedule", f"{plugin_config.schedule} splits backward into input and weight "
                          "halves, which torch refuses for compiled stages",
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
    part = copy.deepcopy(model)
    blocks = description.blocks_of(part)
    keep = {str(i) for i in layout.blocks[stage]}
    for name in [n for n in blocks if n not in keep]:
        del blocks[name]
    dropped = (description.inputs if stage != 0 else ()) + (
        description.outputs if stage != layout.num_stages - 1 else ())
    for name in dropped:
        drop(part, name)
    return part


class PipelineStep:
    """One pipeline step over a local batch: the schedule runs its micro-batches forward and backward.

    The loss handed to torch is scaled by micro-batches x grad-accum steps and torch's own gradient
    scaling is off: torch would divide every gradient the stage holds, including those accumulated by
    the previous grad-accum steps.
    """

    def __init__(self, schedule_name: str, stages: list[PipelineStage], microbatches: int, loss_fn,
                 grad_accum_steps: int):
        self.holds_first = any(s.is_first for s in stages)
        self.holds_last = any(s.is_last for s in stages)
        self.loss_fn = loss_fn
        self.scale = microbatches * grad_accum_steps
        self.loss_weight = 1 / self.scale  # for losses the model adds inside its stages (titan_core.objective)
        schedule_class = schedules.get_schedule_class(schedule_name)
        looped = issubclass(schedule_class, schedules.PipelineScheduleMulti)
        self.schedule = schedule_class(stages if looped else stages[0], n_microbatches=microbatches,
                                       loss_fn=self.scaled_loss, scale_grads=False)
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
                        config.training.grad_accum_steps)


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


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """pp: each rank holds its stages' blocks and keeps the activations of the micro-batches its schedule has
    in flight (1F1B: fewer on later stages; GPipe: all; a zero-bubble schedule's until their weight half, with
    the gradients that half needs), idles for the schedule's bubble, sends the residual stream to the next stage
    (and its gradient back) per micro-batch (a schedule of several stages a rank holds what it sends until the
    step ends), keeps a receive buffer per micro-batch from each neighbouring stage (on a V's middle rank, the
    tensor the other stage passed), and each stage's output (the stream, the last stage's logits) until that
    micro-batch's backward ends."""
    layout = _layout(plugin_config, plan)
    kind = schedule_kind(plugin_config)
    degree, chunks, microbatches = layout.degree, layout.stages_per_rank, layout.microbatches
    estimate.microbatch_rows //= microbatches
    last = layout.num_stages - 1
    # A schedule of several stages a rank (but LoopedBFS, which runs every forward first) is weighed at each
    # backward of torch's own order of the rank's actions; torch's runtime for them waits for its sends only as
    # the step ends, so that every tensor it sends lives until then.
    ordered = kind.looped and plugin_config.schedule != "LoopedBFS" and microbatches > 1

    def stream_per_token(e) -> float:
        """Bytes per token of the residual stream between stages on this rank: a stage's input, its gradient."""
        return e.facts.block_input / e.stream_split

    def held(rank: int) -> dict:
        """The fields saying how many micro-batches rank ``rank`` keeps at its first backward of a step and at
        its worst later one, in units of all its blocks (for several stages a rank, as torch's order of its
        actions has them), and whether a forward runs before that later one (else the weights an earlier
        backward gathered are still gathered: a cool-down)."""
        if microbatches == 1:
            return {}
        if not ordered:
            # GPipe and LoopedBFS run every forward first; 1F1B's warm-up keeps one more than its steady state
            # only when the warm-up is all there is.
            everything_first = plugin_config.schedule in ("GPipe", "LoopedBFS")
            first = microbatches if everything_first else min(microbatches, degree - rank)
            # Only a warm-up of one forward (1F1B's last stage) runs a forward before each backward.
            return dict(first_backward=(first, 0), microbatches_in_flight=min(first, microbatches - 1 / chunks),
                        backward_regathers=first == 1)
        stages = layout.stages_of(rank)
        first, *later = backward_moments(torch_order(plugin_config.schedule, layout, rank), stages)
        later = _undominated(later)

        def per_stage(e) -> tuple[list[float], list[float], list[float]]:
            """Per stage, bytes per token kept and waiting for a weight half, and its parameters (its gradients)."""
            blocks = [layout.blocks[s] for s in stages]
            return ([sum(map(e.kept, ours)) + (s == last) * e.outer_kept() + own_kept(e, s)
                     for s, ours in zip(stages, blocks)],
                    [sum(e.facts.block_param_results[i] for i in ours) / e.activation_split for ours in blocks],
                    [sum(e.facts.block_params[i] for i in ours) + (s == 0) * e.facts.inputs_params
                     + (s == last) * e.facts.outputs_params for s, ours in zip(stages, blocks)])

        def sent(e) -> tuple[list[float], list[float]]:
            """Per stage, bytes per token of each output it sends to another rank, and of each input gradient."""
            return ([(s < last and s + 1 not in stages) * output(e, s) for s in stages],
                    [(s > 0 and s - 1 not in stages) * stream_per_token(e) for s in stages])

        def units(moment, kept, made, params, outputs, gradients) -> tuple[float, float, float]:
            """(kept, waiting) in units of all the rank's blocks, and the share of its gradients that exist. What
            is kept counts what the sends hold: the outputs sent whose micro-batch's backward has run (until then
            the stage keeps them anyway) and every input gradient sent."""
            alive, waiting, backed, forwarded, sent_back = moment
            held_by_sends = _dot([f - a for f, a in zip(forwarded, alive)], outputs) + _dot(sent_back, gradients)
            return ((_dot(alive, kept) + held_by_sends) / (sum(kept) or 1), _dot(waiting, made) / (sum(made) or 1),
                    _dot(backed, params) / (sum(params) or 1))

        def worst(e) -> tuple[float, float, float]:
            kept, made, params = per_stage(e)
            outputs, gradients = sent(e)
            tokens = e.microbatch_tokens
            shards = e.weight_split * e.state_shards
            return max((units(moment, kept, made, params, outputs, gradients) for moment in later),
                       key=lambda u: tokens * (u[0] * sum(kept) + u[1] * sum(made)) + 4 * u[2] * sum(params) / shards)
        # The worst later backward may follow backwards of the same stages: counted as gathered by them.
        return dict(first_backward=lambda e: units(first, *per_stage(e), *sent(e))[:2],
                    microbatches_in_flight=lambda e: worst(e)[0], weight_halves_waiting=lambda e: worst(e)[1],
                    gradients_made=lambda e: worst(e)[2], backward_regathers=False)

    def output(e, stage: int) -> float:
        """Bytes per token of a stage's output, which torch's stage keeps for each micro-batch as the root of its
        backward: the residual stream, or the last stage's logits, split as loss parallel splits them (the hidden
        states, when the loss makes the logits chunk by chunk)."""
        if stage == last and e.logits_tokens is None:
            return e.facts.output / e.logits_split
        return stream_per_token(e)

    def own_kept(e, stage: int) -> float:
        """Bytes per token a stage keeps for each micro-batch beyond its blocks' activations: its output (unless
        the stage after it, on this rank, holds it as its input: counted with the buffers; or a fused loss keeps
        those logits: counted with the loss), less its input, which its first block keeps (the residual stream)
        but which the buffers count."""
        held_elsewhere = stage + 1 in layout.stages_of(e.rank) or (stage == last and e.loss_keeps_logits)
        return (not held_elsewhere) * output(e, stage) - (stage > 0) * stream_per_token(e)

    estimate.output_kept = lambda e: sum(own_kept(e, s) for s in layout.stages_of(e.rank))
    estimate.ranks = [dict(blocks=[i for s in layout.stages_of(r) for i in layout.blocks[s]],
                           holds_inputs=0 in layout.stages_of(r), holds_outputs=last in layout.stages_of(r))
                      for r in range(degree)]
    estimate.blocks = estimate.ranks[0]["blocks"]
    # What each rank keeps in flight is a function of the rank, so that a plugin after this one can wrap it.
    kept = [held(r) for r in range(degree)]
    for name in ("first_backward", "microbatches_in_flight", "weight_halves_waiting", "gradients_made",
                 "backward_regathers"):
        setattr(estimate, name, _of_rank(kept, name, getattr(estimate, name)))
    rounds = chunks * microbatches * (3 if kind.zero_bubble else 1)
    estimate.bubble = (degree - 1) / (rounds + degree - 1)

    def stream(e) -> float:  # bytes of one micro-batch's residual stream on this rank
        return stream_per_token(e) * e.microbatch_tokens

    # Per micro-batch, each stage sends its output to the next stage and its input's gradient to the previous one,
    # and receives into buffers of its own, made once and kept: one per micro-batch from each neighbouring stage
    # on another rank. Two neighbouring stages on one rank (a V's middle rank) pass the tensors themselves, which
    # the receiving stage keeps where a buffer would be until the next step's replace them: buffers too.
    neighbours = [[n for s in layout.stages_of(r) for n in (s - 1, s + 1) if 0 <= n <= last] for r in range(degree)]
    remote = [sum(n not in layout.stages_of(r) for n in neighbours[r]) for r in range(degree)]
    estimate.add_memory("buffers", lambda e: len(neighbours[e.rank]) * microbatches * stream(e),
                        "pipeline receive buffers", "pp", when="held")
    # Each stage but the first sends its inputs' gradient back as its backward ends. torch lets go of it once sent
    # (stage_backward sets the inputs' .grad to None), so under a schedule that waits for each send as the next
    # begins the one sent last lives on, as the next backward runs, until that backward's own send completes:
    # none at the step's first backward. (An ordered schedule's sends are counted with its moments.)
    fed = [(not ordered) * sum(s > 0 for s in layout.stages_of(r)) for r in range(degree)]
    estimate.add_memory("activations", lambda e: fed[e.rank] * stream(e), "input gradient being sent back", "pp",
                        when="accumulated")
    estimate.add_collective("residual stream between stages", (PP,),
                            lambda e: remote[e.rank] * stream(e) * e.microbatches_per_step(), overlapped=False,
                            plugin="pp", calls=lambda e: 2 * remote[e.rank] * e.microbatches_per_step())


def _of_rank(values: list[dict], name: str, otherwise):
    """The field ``name`` of the estimate as a function of its rank: ``values[rank][name]`` (a value or a function of
    the estimate) where given, else ``otherwise``."""
    def field(e):
        value = values[e.rank].get(name, otherwise)
        return value(e) if callable(value) else value
    return field


def torch_order(schedule: str, layout: Layout, rank: int) -> list:
    """The actions torch's schedule runs on pipeline rank ``rank``, in order, as its constructor computes them:
    from the pipeline's sizes alone, so the planner needs no stage."""
    rounds = max(1, layout.microbatches // layout.degree)
    sizes = SimpleNamespace(pp_group_size=layout.degree, n_local_stages=layout.stages_per_rank,
                            num_stages=layout.num_stages, _n_microbatches=layout.microbatches,
                            microbatches_per_round=layout.microbatches // rounds)
    return schedules.get_schedule_class(schedule)._calculate_single_rank_operations(sizes, rank)


def backward_moments(order: list, stages: list[int]) -> list[tuple[tuple[int, ...], ...]]:
    """At the end of each backward of ``order``, in order (a stage micro-batch's whole backward or input half;
    the first stage's weight half, which runs its whole backward), per stage of ``stages``: the micro-batches whose
    activations are kept, that one included, those keeping the gradients their weight half needs (their
    input half ran, that one's included; a stage's but the first's, whose input half does nothing), whether
    its weights' gradients exist as that backward starts (an earlier backward made them), the forwards it has
    run and the input gradients it has made before that backward."""
    kept, waiting, made, forwarded, sent_back = ([0] * len(stages) for _ in range(5))
    moments = []

    def moment() -> tuple[tuple[int, ...], ...]:
        return tuple(kept), tuple(waiting), tuple(made), tuple(forwarded), tuple(sent_back)
    for action in (sub for action in order if action is not None for sub in (action.sub_actions or [action])):
        kind, first, local = action.computation_type, action.stage_index == 0, stages.index(action.stage_index)
        if kind == schedules.FORWARD:
            kept[local] += 1
            forwarded[local] += 1
        elif kind == schedules.FULL_BACKWARD or (kind == schedules.BACKWARD_WEIGHT and first):
            moments.append(moment())
            kept[local] -= 1
            made[local] = 1
            sent_back[local] += 1
        elif kind == schedules.BACKWARD_INPUT and not first:
            waiting[local] += 1
            moments.append(moment())
            sent_back[local] += 1
        elif kind == schedules.BACKWARD_WEIGHT:
            made[local] = 1
            kept[local] -= 1
            waiting[local] -= 1
    return moments


def _undominated(moments: list) -> list:
    """The moments no other moment holds at least as much of everything as: the peak is at one of them."""
    counts = [sum(moment, ()) for moment in set(moments)]
    size, parts = (len(moments[0][0]), len(moments[0])) if moments else (0, 0)
    return [tuple(c[part * size:(part + 1) * size] for part in range(parts)) for c in counts
            if not any(other != c and all(o >= m for o, m in zip(other, c)) for other in counts)]


def _dot(counts: list[int], per_stage: list[float]) -> float:
    return sum(count * each for count, each in zip(counts, per_stage))


@hookimpl
def plan_options(model):
    """pp: off, or 2, 4 or 8 stages with 1F1B or Interleaved 1F1B, as many micro-batches as the schedule
    needs at least (a plan whose blocks or batch do not split is refused and dropped)."""
    return [None, *({"degree": d, "schedule": schedule} for d in (2, 4, 8) if d <= model.n_layers
                    for schedule in ("1F1B", "Interleaved1F1B"))]
