"""Which blocks each pipeline stage holds, which stages each rank holds, and what each schedule needs.

Everything here is pure arithmetic on the config, so the launcher can refuse a bad layout before any
worker starts and every worker derives the same layout again on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_core import ConfigError, count_or_null
from titan_pp.csv_schedule import FIELD as CSV_FIELD
from titan_pp.csv_schedule import FileSchedule, read_schedule


@dataclass(frozen=True)
class ScheduleKind:
    looped: bool = False  # several stages per rank
    v_shape: bool = False  # rank r holds stages r and 2W-1-r, so the first and last stage share a rank
    zero_bubble: bool = False  # splits backward into input and weight halves; torch refuses compiled stages there
    needs_stage_many_microbatches: bool = False  # torch refuses fewer micro-batches than stages
    needs_whole_rounds: bool = False  # micro-batches must be a multiple of max(1, microbatches // degree)


SCHEDULES = {
    "GPipe": ScheduleKind(),
    "1F1B": ScheduleKind(needs_stage_many_microbatches=True),
    "Interleaved1F1B": ScheduleKind(looped=True, needs_whole_rounds=True),
    "LoopedBFS": ScheduleKind(looped=True),
    "InterleavedZeroBubble": ScheduleKind(looped=True, zero_bubble=True, needs_whole_rounds=True),
    "ZBVZeroBubble": ScheduleKind(looped=True, v_shape=True, zero_bubble=True),
    "DualPipeV": ScheduleKind(looped=True, v_shape=True, zero_bubble=True, needs_stage_many_microbatches=True),
}


@dataclass(frozen=True)
class Layout:
    degree: int
    stages_per_rank: int
    v_shape: bool
    blocks: tuple[tuple[int, ...], ...]  # layer indices of each stage, in stage order
    microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.blocks)

    def stages_of(self, rank: int) -> list[int]:
        """Stage indices held by pipeline rank ``rank``, in the order the schedule expects them."""
        if self.v_shape:
            return [rank, 2 * self.degree - 1 - rank]
        return [rank + i * self.degree for i in range(self.stages_per_rank)]


def schedule_kind(plugin_config) -> ScheduleKind:
    if plugin_config.schedule_csv is not None:
        return file_kind(read_schedule(plugin_config.schedule_csv))
    if plugin_config.schedule not in SCHEDULES:
        raise ConfigError("plugins.pp.schedule", f"unknown schedule '{plugin_config.schedule}'",
                          f"use one of {', '.join(SCHEDULES)}")
    return SCHEDULES[plugin_config.schedule]


def schedule_name(plugin_config) -> str:
    """The schedule as errors name it: torch's schedule, or the file that replaces it."""
    csv = plugin_config.schedule_csv
    return plugin_config.schedule if csv is None else f"the schedule in {csv}"


def file_kind(schedule: FileSchedule) -> ScheduleKind:
    """A schedule file's kind: several stages a rank when it has more stages than rows, in a V when the first and
    last stage share rank 0, and splitting backward when it runs weight halves."""
    looped = schedule.stages > len(schedule.order)
    return ScheduleKind(looped=looped, v_shape=looped and schedule.stage_ranks[schedule.stages - 1] == 0,
                        zero_bubble=schedule.splits_backward)


def check_file_fits(schedule: FileSchedule, layout: Layout) -> None:
    """The schedule file runs the pipeline the options make: a row per pipeline rank, its stages, each on the rank
    the placement gives it, and its micro-batches."""
    file = schedule.file
    if len(schedule.order) != layout.degree:
        raise ConfigError(CSV_FIELD, f"{file} has {len(schedule.order)} rows (pipeline ranks) for pp degree "
                          f"{layout.degree}", f"set plugins.pp.degree={len(schedule.order)}, or write a row per rank")
    if schedule.stages != layout.num_stages:
        raise ConfigError(CSV_FIELD, f"{file} runs {schedule.stages} stages and the options make "
                          f"{layout.num_stages}", f"set plugins.pp.stages_per_rank={schedule.stages // layout.degree} "
                          "(or layers_per_stage giving as many stages)")
    for rank in range(layout.degree):
        if schedule.stages_of(rank) != sorted(layout.stages_of(rank)):
            raise ConfigError(CSV_FIELD, f"{file} runs stages {schedule.stages_of(rank)} on rank {rank}, where the "
                              f"{'V' if layout.v_shape else 'loop'} placement puts {sorted(layout.stages_of(rank))}",
                              "place stage s on rank s mod degree (a loop) or, with two stages a rank, s and "
                              "2 x degree - 1 - s (a V)")
    if schedule.microbatches != layout.microbatches:
        raise ConfigError(CSV_FIELD, f"{file} runs {schedule.microbatches} micro-batches and the options make "
                          f"{layout.microbatches}", f"set plugins.pp.microbatches={schedule.microbatches}")


def stage_layout(plugin_config, n_layers: int, degree: int) -> Layout:
    """The layout of ``plugins.pp``; raises ConfigError when the blocks or stages do not fit the schedule."""
    kind = schedule_kind(plugin_config)
    name = schedule_name(plugin_config)
    for field, null in (("microbatches", "one per stage"), ("stages_per_rank", "what the schedule needs"),
                        ("layers_per_stage", "an even split")):
        count_or_null(plugin_config[field], f"plugins.pp.{field}", null)
    first, last = plugin_config.first_stage_fewer_layers, plugin_config.last_stage_fewer_layers
    for field, value in (("first_stage_fewer_layers", first), ("last_stage_fewer_layers", last)):
        if value < 0:
            raise ConfigError(f"plugins.pp.{field}", f"{value} is negative", "use 0 or more blocks")
    # The first and last stages count `first`/`last` phantom blocks for the embedding and the output.
    slots = n_layers + first + last
    stages_per_rank = _stages_per_rank(plugin_config, kind, slots, degree)
    num_stages = degree * stages_per_rank
    if slots % num_stages:
        raise ConfigError("plugins.pp", f"{n_layers} blocks (+{first} first, +{last} last) do not split evenly "
                          f"into {num_stages} stages ({degree} ranks x {stages_per_rank})",
                          "change stages_per_rank, layers_per_stage, first/last_stage_fewer_layers or pp degree")
    per_stage = slots // num_stages
    sizes = [per_stage] * num_stages
    sizes[0] -= first
    sizes[-1] -= last
    if min(sizes) < 0:
        raise ConfigError("plugins.pp", f"first/last_stage_fewer_layers take more blocks than stage sizes {sizes} "
                          "hold", "lower first/last_stage_fewer_layers")
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    blocks = tuple(tuple(range(start, start + size)) for start, size in zip(starts, sizes))
    _check_placement(plugin_config, kind)
    microbatches = num_stages if plugin_config.microbatches is None else plugin_config.microbatches
    _check_microbatches(name, kind, microbatches, num_stages, degree)
    layout = Layout(degree, stages_per_rank, kind.v_shape, blocks, microbatches)
    if plugin_config.schedule_csv is not None:
        check_file_fits(read_schedule(plugin_config.schedule_csv), layout)
    return layout


def _stages_per_rank(plugin_config, kind: ScheduleKind, slots: int, degree: int) -> int:
    name, given = schedule_name(plugin_config), plugin_config.stages_per_rank
    if given is None and plugin_config.schedule_csv is not None:
        given = max(1, read_schedule(plugin_config.schedule_csv).stages // degree)
    if plugin_config.layers_per_stage is not None:
        per = plugin_config.layers_per_stage
        if slots % per or (slots // per) % degree:
            raise ConfigError("plugins.pp.layers_per_stage",
                              f"{slots} block slots in stages of {per} do not give a multiple of pp degree {degree} "
                              "stages", "choose layers_per_stage so that the stage count is a multiple of the degree")
        derived = slots // per // degree
        if given is not None and given != derived:
            raise ConfigError("plugins.pp.stages_per_rank", f"{given} disagrees with layers_per_stage={per}, "
                              f"which gives {derived}", "set only one of stages_per_rank and layers_per_stage")
        given = derived
    if given is None:
        given = 2 if kind.looped else 1
    if kind.v_shape and given != 2:
        raise ConfigError("plugins.pp.stages_per_rank", f"{name} needs exactly 2 stages per rank, got {given}",
                          "set plugins.pp.stages_per_rank=2 (or plugins.pp.layers_per_stage giving 2 stages per rank)")
    if not kind.looped and given != 1:
        raise ConfigError("plugins.pp.stages_per_rank", f"{name} runs one stage per rank, got {given}",
                          "use Interleaved1F1B, LoopedBFS or a zero-bubble schedule for several stages per rank")
    return given


def _check_placement(plugin_config, kind: ScheduleKind) -> None:
    placement = plugin_config.placement
    if placement is None:
        return
    if placement not in ("loop", "v"):
        raise ConfigError("plugins.pp.placement", f"unknown placement '{placement}'", "use loop, v or null")
    needed = "v" if kind.v_shape else "loop"
    if placement != needed:
        raise ConfigError("plugins.pp.placement", f"{schedule_name(plugin_config)} runs stages in a '{needed}' "
                          f"placement, not '{placement}'", f"set plugins.pp.placement={needed} or null")


def _check_microbatches(name: str, kind: ScheduleKind, microbatches: int, num_stages: int, degree: int) -> None:
    if kind.needs_stage_many_microbatches and microbatches < num_stages:
        raise ConfigError("plugins.pp.microbatches", f"{name} needs at least as many micro-batches as stages "
                          f"({num_stages}), got {microbatches}", f"set microbatches to {num_stages} or more")
    rounds = max(1, microbatches // degree)
    if kind.needs_whole_rounds and microbatches % rounds:
        raise ConfigError("plugins.pp.microbatches", f"{name} runs micro-batches in rounds of the pp degree {degree}: "
                          f"{microbatches} is not a multiple of {rounds} rounds",
                          f"use a multiple of {degree} micro-batches")
