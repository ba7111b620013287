"""A pipeline schedule written in a file: PyTorch's pipeline-order CSV, the format TorchTitan's custom schedules take
(a row per pipeline rank, a cell per action: ``0F1`` stage 0's forward of micro-batch 1, ``1B0`` stage 1's full
backward of micro-batch 0, ``1I0`` and ``1W0`` its input and weight halves; an empty cell is an idle slot).

Read before launch and checked against the pipeline the options make: a row per pipeline rank, each stage on one
rank, every micro-batch forwarded and backwarded once by every stage, and an order the ranks can run without waiting
on each other for ever. That is found by running the actions as the ranks would, each as soon as its rank is free
and what it needs is done (a forward after the previous stage's, a backward after the next stage's and its own
forward, a weight half after its input half); the same run gives the schedule's bubble, which the planner charges.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.pipelining.schedules import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, FULL_BACKWARD,
                                                     _Action)

from titan_core import ConfigError, text_or_null

FIELD = "plugins.pp.schedule_csv"
# Each action's time in forwards: a full backward makes two matrix products for each of the forward's.
COST = {FORWARD: 1.0, FULL_BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0}
GRADIENT = (FULL_BACKWARD, BACKWARD_INPUT)  # what the previous stage's backward waits for


@dataclass(frozen=True)
class FileSchedule:
    """A schedule file's actions by pipeline rank (None: an idle slot) and what they imply."""

    file: Path
    order: dict[int, list[_Action | None]]
    stages: int
    microbatches: int
    stage_ranks: dict[int, int]  # the rank each stage runs on

    @property
    def splits_backward(self) -> bool:
        """Whether the file runs backward as input and weight halves (a zero-bubble schedule)."""
        return any(action.computation_type == BACKWARD_WEIGHT for action in self.actions())

    def actions(self) -> list[_Action]:
        return [action for row in self.order.values() for action in row if action is not None]

    def stages_of(self, rank: int) -> list[int]:
        return sorted(stage for stage, held_by in self.stage_ranks.items() if held_by == rank)


def read_schedule(path: str) -> FileSchedule:
    """The schedule in the CSV file ``path``, each of its cells a compute action or empty, each stage on one rank
    and every stage running every micro-batch forward and backward exactly once."""
    text = text_or_null(path, FIELD)  # refuses a number or a boolean Hydra read
    assert text is not None  # a schedule file is read only when the option is set
    file = Path(text).expanduser()
    if not file.is_file():
        raise ConfigError(FIELD, f"{file} is not a file", "point it at a pipeline-order CSV (a row per pipeline rank)")
    with open(file, newline="") as opened:
        order = {rank: [_action(file, rank, column, cell) for column, cell in enumerate(row)]
                 for rank, row in enumerate(csv.reader(opened))}
    actions = [action for row in order.values() for action in row if action is not None]
    if not actions:
        raise ConfigError(FIELD, f"{file} holds no action", "write a row of actions per pipeline rank")
    stage_ranks: dict[int, int] = {}
    for rank, row in order.items():
        for action in filter(None, row):
            held_by = stage_ranks.setdefault(action.stage_index, rank)
            if held_by != rank:
                raise ConfigError(FIELD, f"{file}: stage {action.stage_index} runs on rank {held_by} and on rank "
                                  f"{rank}", "give each stage's actions to one rank")
    schedule = FileSchedule(file, order, 1 + max(a.stage_index for a in actions),
                            1 + max(a.microbatch_index for a in actions), stage_ranks)
    _check_each_once(schedule)
    timeline(schedule)  # refuses an order the ranks cannot run
    return schedule


def _action(file: Path, rank: int, column: int, cell: str) -> _Action | None:
    try:
        action = _Action.from_str(cell.strip())
    except RuntimeError:  # torch's words for a cell it cannot parse
        action = _Action(0, FORWARD, None)
    if action is not None and (action.computation_type not in COST or action.microbatch_index is None):
        raise ConfigError(FIELD, f"{file} row {rank + 1}, column {column + 1}: '{cell.strip()}' is not a compute "
                          "action", "write actions such as 0F1 (stage 0's forward of micro-batch 1), 0B1, 0I1 and "
                          "0W1 (its full backward, or its input and weight halves), or leave the cell empty")
    return action


def _check_each_once(schedule: FileSchedule) -> None:
    counts: dict[tuple, int] = {}
    for action in schedule.actions():
        key = (action.computation_type, action.stage_index, action.microbatch_index)
        counts[key] = counts.get(key, 0) + 1
    for stage in range(schedule.stages):
        if stage not in schedule.stage_ranks:
            raise ConfigError(FIELD, f"{schedule.file} names stages up to {schedule.stages - 1} and none of stage "
                              f"{stage}'s actions", "give every stage its actions, numbered from 0")
        for microbatch in range(schedule.microbatches):
            def times(kind) -> int:
                return counts.get((kind, stage, microbatch), 0)
            whole = (times(FULL_BACKWARD), times(BACKWARD_INPUT), times(BACKWARD_WEIGHT)) in ((1, 0, 0), (0, 1, 1))
            if times(FORWARD) != 1 or not whole:
                raise ConfigError(FIELD, f"{schedule.file}: stage {stage} runs micro-batch {microbatch} forward "
                                  f"{times(FORWARD)} time(s) and backward {times(FULL_BACKWARD)} time(s) whole, "
                                  f"{times(BACKWARD_INPUT)} and {times(BACKWARD_WEIGHT)} in halves", "run every "
                                  "micro-batch once forward and once backward (whole, or as one input and one weight "
                                  "half) on every stage")


def timeline(schedule: FileSchedule) -> tuple[float, dict[int, float]]:
    """The step's length and each rank's busy time, in forwards' time, when every rank runs its actions in its order,
    each as soon as the rank is free and what it needs is done. Ranks that would wait on each other for ever are
    refused, naming where each waits."""
    last = schedule.stages - 1
    done: dict[tuple, float] = {}  # (kind, stage, micro-batch) -> when it finished
    position = {rank: 0 for rank in schedule.order}
    free = {rank: 0.0 for rank in schedule.order}
    busy = {rank: 0.0 for rank in schedule.order}

    def needs(action: _Action) -> list[tuple]:
        kind, stage, microbatch = action.computation_type, action.stage_index, action.microbatch_index
        if kind == FORWARD:
            return [] if stage == 0 else [(FORWARD, stage - 1, microbatch)]
        if kind == BACKWARD_WEIGHT:
            return [(BACKWARD_INPUT, stage, microbatch)]
        later = [] if stage == last else [(GRADIENT, stage + 1, microbatch)]
        return [(FORWARD, stage, microbatch), *later]

    progressed = True
    while progressed:
        progressed = False
        for rank, row in schedule.order.items():
            while position[rank] < len(row):
                action = row[position[rank]]
                if action is not None:
                    wanted = needs(action)
                    if any(key not in done for key in wanted):
                        break
                    kind = GRADIENT if action.computation_type in GRADIENT else action.computation_type
                    free[rank] = max([free[rank], *(done[key] for key in wanted)]) + COST[action.computation_type]
                    busy[rank] += COST[action.computation_type]
                    done[(kind, action.stage_index, action.microbatch_index)] = free[rank]
                    if action.computation_type == BACKWARD_INPUT:
                        done[(BACKWARD_INPUT, action.stage_index, action.microbatch_index)] = free[rank]
                position[rank] += 1
                progressed = True
    waiting = {rank: row[position[rank]] for rank, row in schedule.order.items() if position[rank] < len(row)}
    if waiting:
        raise ConfigError(FIELD, f"{schedule.file}: the ranks would wait on each other for ever: " + ", ".join(
            f"rank {rank} at {action}" for rank, action in waiting.items()), "order each rank's actions so that "
            "each needs only actions its peers run before they wait themselves")
    return max(free.values()), busy


def bubble(schedule: FileSchedule) -> float:
    """The share of the step the busiest rank idles (what the planner charges a pipeline for)."""
    length, busy = timeline(schedule)
    return 1 - max(busy.values()) / length
