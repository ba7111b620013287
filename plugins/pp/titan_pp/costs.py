"""Pipeline parallel's pricing: each rank's stages, the micro-batches its schedule keeps in flight, its bubble,
and the residual stream sent between stages."""

from __future__ import annotations

from types import SimpleNamespace

from torch.distributed.pipelining import schedules

from titan_core import PP, hookimpl
from titan_pp.csv_schedule import FileSchedule, bubble, read_schedule
from titan_pp.layout import Layout, schedule_kind
from titan_pp.plugin import _layout


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
    file = read_schedule(plugin_config.schedule_csv) if plugin_config.schedule_csv is not None else None
    ordered = (file is not None or kind.looped and plugin_config.schedule != "LoopedBFS") and microbatches > 1
    estimate.output_kept = lambda e: sum(own_kept(e, layout, s) for s in layout.stages_of(e.rank))
    estimate.ranks = [dict(blocks=[i for s in layout.stages_of(r) for i in layout.blocks[s]],
                           holds_inputs=0 in layout.stages_of(r), holds_outputs=last in layout.stages_of(r))
                      for r in range(degree)]
    estimate.blocks = estimate.ranks[0]["blocks"]
    # What each rank keeps in flight is a function of the rank, so that a plugin after this one can wrap it.
    kept = [in_flight(layout, plugin_config.schedule, ordered, r, file) for r in range(degree)]
    for name in ("first_backward", "microbatches_in_flight", "weight_halves_waiting", "gradients_made",
                 "backward_regathers"):
        setattr(estimate, name, _of_rank(kept, name, getattr(estimate, name)))
    if file is not None:  # the busiest rank's idle share as the file's actions run
        estimate.bubble = bubble(file)
    else:
        rounds = chunks * microbatches * (3 if kind.zero_bubble else 1)
        estimate.bubble = (degree - 1) / (rounds + degree - 1)
    add_stage_traffic(estimate, layout, ordered)


def stream_per_token(e) -> float:
    """Bytes per token of the residual stream between stages on this rank: a stage's input, its gradient."""
    return e.facts.block_input / e.stream_split


def microbatch_stream(e) -> float:
    """Bytes of one micro-batch's residual stream on this rank."""
    return stream_per_token(e) * e.microbatch_tokens


def stage_output(e, layout: Layout, stage: int) -> float:
    """Bytes per token of a stage's output, which torch's stage keeps for each micro-batch as the root of its
    backward: the residual stream, or the last stage's logits, split as loss parallel splits them (the hidden
    states, when the loss makes the logits chunk by chunk)."""
    if stage == layout.num_stages - 1 and e.logits_tokens is None:
        return e.facts.output / e.logits_split
    return stream_per_token(e)


def own_kept(e, layout: Layout, stage: int) -> float:
    """Bytes per token a stage keeps for each micro-batch beyond its blocks' activations: its output (unless
    the stage after it, on this rank, holds it as its input: counted with the buffers; or a fused loss keeps
    those logits: counted with the loss), less its input, which its first block keeps (the residual stream)
    but which the buffers count."""
    last = layout.num_stages - 1
    held_elsewhere = stage + 1 in layout.stages_of(e.rank) or (stage == last and e.loss_keeps_logits)
    return (not held_elsewhere) * stage_output(e, layout, stage) - (stage > 0) * stream_per_token(e)


def in_flight(layout: Layout, schedule: str, ordered: bool, rank: int, file: FileSchedule | None = None) -> dict:
    """The fields saying how many micro-batches rank ``rank`` keeps at its first backward of a step and at
    its worst later one, in units of all its blocks (for several stages a rank, as torch's order of its
    actions has them), and whether a forward runs before that later one (else the weights an earlier
    backward gathered are still gathered: a cool-down). A schedule ``file`` gives the rank's order itself."""
    if layout.microbatches == 1:
        return {}
    if not ordered:
        return in_flight_forwards_first(layout, schedule, rank)
    return in_flight_in_torch_order(layout, schedule, rank, file)


def in_flight_forwards_first(layout: Layout, schedule: str, rank: int) -> dict:
    """:func:`in_flight` for a schedule of one stage a rank, or LoopedBFS, as their warm-up runs forwards first."""
    microbatches = layout.microbatches
    # GPipe and LoopedBFS run every forward first; 1F1B's warm-up keeps one more than its steady state
    # only when the warm-up is all there is.
    everything_first = schedule in ("GPipe", "LoopedBFS")
    first = microbatches if everything_first else min(microbatches, layout.degree - rank)
    # Only a warm-up of one forward (1F1B's last stage) runs a forward before each backward.
    return dict(first_backward=(first, 0), microbatches_in_flight=min(first, microbatches - 1 / layout.stages_per_rank),
                backward_regathers=first == 1)


def in_flight_in_torch_order(layout: Layout, schedule: str, rank: int, file: FileSchedule | None = None) -> dict:
    """:func:`in_flight` for a schedule of several stages a rank (or a file's), weighed at each backward of torch's
    order (or the file's)."""
    stages = layout.stages_of(rank)
    order = torch_order(schedule, layout, rank) if file is None else file.order[rank]
    first, *later = backward_moments(order, stages)
    later = _undominated(later)

    def worst(e) -> tuple[float, float, float]:
        kept, made, params = per_stage(e, layout, stages)
        outputs, gradients = sent_per_stage(e, layout, stages)
        tokens = e.microbatch_tokens
        shards = e.weight_split * e.state_shards
        return max((moment_units(moment, kept, made, params, outputs, gradients) for moment in later),
                   key=lambda u: tokens * (u[0] * sum(kept) + u[1] * sum(made)) + 4 * u[2] * sum(params) / shards)
    # The worst later backward may follow backwards of the same stages: counted as gathered by them.
    return dict(first_backward=lambda e: moment_units(first, *per_stage(e, layout, stages),
                                                      *sent_per_stage(e, layout, stages))[:2],
                microbatches_in_flight=lambda e: worst(e)[0], weight_halves_waiting=lambda e: worst(e)[1],
                gradients_made=lambda e: worst(e)[2], backward_regathers=False)


def per_stage(e, layout: Layout, stages: list[int]) -> tuple[list[float], list[float], list[float]]:
    """Per stage of ``stages``, bytes per token kept and waiting for a weight half, and its parameters (its
    gradients)."""
    last = layout.num_stages - 1
    blocks = [layout.blocks[s] for s in stages]
    return ([sum(map(e.kept, ours)) + (s == last) * e.outer_kept() + own_kept(e, layout, s)
             for s, ours in zip(stages, blocks)],
            [sum(e.facts.block_param_results[i] for i in ours) / e.activation_split for ours in blocks],
            [sum(e.facts.block_params[i] for i in ours) + (s == 0) * e.facts.inputs_params
             + (s == last) * e.facts.outputs_params for s, ours in zip(stages, blocks)])


def sent_per_stage(e, layout: Layout, stages: list[int]) -> tuple[list[float], list[float]]:
    """Per stage of ``stages``, bytes per token of each output it sends to another rank, and of each input
    gradient."""
    last = layout.num_stages - 1
    return ([(s < last and s + 1 not in stages) * stage_output(e, layout, s) for s in stages],
            [(s > 0 and s - 1 not in stages) * stream_per_token(e) for s in stages])


def moment_units(moment, kept, made, params, outputs, gradients) -> tuple[float, float, float]:
    """(kept, waiting) in units of all the rank's blocks, and the share of its gradients that exist. What
    is kept counts what the sends hold: the outputs sent whose micro-batch's backward has run (until then
    the stage keeps them anyway) and every input gradient sent."""
    alive, waiting, backed, forwarded, sent_back = moment
    held_by_sends = _dot([f - a for f, a in zip(forwarded, alive)], outputs) + _dot(sent_back, gradients)
    return ((_dot(alive, kept) + held_by_sends) / (sum(kept) or 1), _dot(waiting, made) / (sum(made) or 1),
            _dot(backed, params) / (sum(params) or 1))


def add_stage_traffic(estimate, layout: Layout, ordered: bool) -> None:
    """The receive buffers, the input gradients being sent back, and the residual stream between stages."""
    degree, microbatches, last = layout.degree, layout.microbatches, layout.num_stages - 1
    # Per micro-batch, each stage sends its output to the next stage and its input's gradient to the previous one,
    # and receives into buffers of its own, made once and kept: one per micro-batch from each neighbouring stage
    # on another rank. Two neighbouring stages on one rank (a V's middle rank) pass the tensors themselves, which
    # the receiving stage keeps where a buffer would be until the next step's replace them: buffers too.
    neighbours = [[n for s in layout.stages_of(r) for n in (s - 1, s + 1) if 0 <= n <= last] for r in range(degree)]
    remote = [sum(n not in layout.stages_of(r) for n in neighbours[r]) for r in range(degree)]
    estimate.add_memory("buffers", lambda e: len(neighbours[e.rank]) * microbatches * microbatch_stream(e),
                        "pipeline receive buffers", "pp", when="held")
    # Each stage but the first sends its inputs' gradient back as its backward ends. torch lets go of it once sent
    # (stage_backward sets the inputs' .grad to None), so under a schedule that waits for each send as the next
    # begins the one sent last lives on, as the next backward runs, until that backward's own send completes:
    # none at the step's first backward. (An ordered schedule's sends are counted with its moments.)
    fed = [(not ordered) * sum(s > 0 for s in layout.stages_of(r)) for r in range(degree)]
    estimate.add_memory("activations", lambda e: fed[e.rank] * microbatch_stream(e), "input gradient being sent back",
                        "pp", when="accumulated")
    estimate.add_collective("residual stream between stages", (PP,),
                            lambda e: remote[e.rank] * microbatch_stream(e) * e.microbatches_per_step(),
                            overlapped=False, plugin="pp",
                            calls=lambda e: 2 * remote[e.rank] * e.microbatches_per_step())


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
