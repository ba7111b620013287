"""The planner on published runs it was never fitted on: leave one source out.

Every constant of the step-time model that was set from published runs is refitted on every source but one, and the
rows of the source left out are predicted with what that fit gives; then the next source. The constants (docs/planner.md,
"Fitted constants", names each and the rows it was set from):

- each card's share of its peaks (``achievable``, ``fp8_achievable``: one factor moves both, as ``--calibrate`` moves
  them), fitted so that the card's rows in the fit have a mean log error of zero; the H100 profiles share theirs.
  A card with no row in the fit takes the H100's, as the planner does for a card it has no run of;
- ``ASYNC_TP_HIDDEN`` (tp's share of its collective time that AsyncTP hides), the grid value with the least mean
  error on the fit's AsyncTP rows, the shares refitted at each;
- ``TENSORWISE_OVER_ROWWISE`` (float8 tensorwise's speed-up over rowwise's measured table on GH100), the same on the
  fit's tensorwise rows on GH100 cards.

Memory has no constant set from published runs: its held-out error is its error. Printed: each row's error as
shipped (the constants in the code, fitted on every source) beside its held-out error, then the means per card;
``titan_core/planner/accuracy.py`` copies the held-out means and worsts, which the planner prints beside every
estimate. Run: python bench/planner_held_out.py (about ten minutes on two cores).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import sys
import time

import titan_float8.measured as float8_measured
import titan_tp.costs as tp_costs

from planner_vs_seeds import CARDS, HARDWARE, ROWS
from titan_core.planner.cli import job_estimate
from titan_core.planner.estimate import GIB

# Who published each row: the unit left out.
SOURCES = {
    "seeds": "TorchTitan's Llama 3.1 tables (Dec 2024)",
    "tt-a100": "TorchTitan docs/performance.md (Apr 2024, A100)",
    "tt-405b": "TorchTitan docs/performance.md (Aug 2024, 405B)",
    "tt-asynctp": "TorchTitan's AsyncTP report (Jun 2025)",
    "torchao-h100": "torchao's float8 README (H100)",
    "torchao-mi300x": "torchao's float8 README (AMD, MI300X)",
    "tt-h200": "TorchTitan's H200 report (Jun 2025)",
    "torchao-b200": "torchao's training docs (B200 at 750 W, Aug 2025)",
    "tt-deepep": "TorchTitan PR 2237's DeepEP README (B200, Jan 2026): its baseline",
}
H100_FAMILY = "h100"  # the H100 profiles share their shares
ASYNC_GRID = (0.0, 0.25, 0.5, 0.75)
TENSORWISE_GRID = (1.3, 1.45, 1.57, 1.7, 1.85)


@dataclasses.dataclass(frozen=True)
class Row:
    source: str
    card: str
    name: str
    overrides: tuple[str, ...]
    tps: float
    memory: float | None

    @property
    def family(self) -> str:
        return H100_FAMILY if self.card.startswith("h100") else self.card

    @property
    def async_tp(self) -> bool:
        return "plugins.tp.async_tp=true" in self.overrides

    @property
    def tensorwise_gh100(self) -> bool:
        return ("float8" in self.plugins and not any(o.startswith("plugins.float8.recipe=") for o in self.overrides)
                and self.family in (H100_FAMILY, "h200"))

    @property
    def plugins(self) -> str:
        return next(o for o in self.overrides if o.startswith("+plugins="))


def source_of(name: str) -> str:
    for prefix, source in (("torchtitan A100", "tt-a100"), ("torchtitan H100: 405B, 128", "tt-405b"),
                           ("torchtitan H100", "tt-asynctp"), ("torchao H100", "torchao-h100"),
                           ("torchao MI300X", "torchao-mi300x"), ("torchtitan H200", "tt-h200"),
                           ("torchao B200", "torchao-b200"),
                           ("torchtitan B200", "tt-deepep")):
        if name.startswith(prefix):
            return source
    raise ValueError(name)


def rows() -> list[Row]:
    seeds = [Row("seeds", HARDWARE, f"{number}: {name}", tuple(o), tps, memory)
             for number, name, o, tps, memory in ROWS]
    return seeds + [Row(source_of(name), card, name, tuple(o), tps, memory) for card, name, o, tps, memory in CARDS]


@functools.lru_cache(maxsize=None)
def estimate(row: Row, hidden: float, tensorwise: float):
    """The row's most loaded rank as planned with those two constants (only the rows they touch are planned again)."""
    hidden = hidden if row.async_tp else tp_costs.ASYNC_TP_HIDDEN
    tensorwise = tensorwise if row.tensorwise_gh100 else float8_measured.TENSORWISE_OVER_ROWWISE
    shipped = (tp_costs.ASYNC_TP_HIDDEN, float8_measured.TENSORWISE_OVER_ROWWISE)
    if (hidden, tensorwise) != shipped:
        return _planned_with(row, hidden, tensorwise)
    return job_estimate(["--hardware", row.card, *row.overrides])[1].most_loaded()


def _planned_with(row: Row, hidden: float, tensorwise: float):
    saved_hidden, saved_table = tp_costs.ASYNC_TP_HIDDEN, float8_measured.SPEEDUPS["tensorwise"]["gh100"]
    tp_costs.ASYNC_TP_HIDDEN = hidden
    float8_measured.SPEEDUPS["tensorwise"]["gh100"] = tuple(
        tuple(tuple(min(float8_measured.FLOAT8_PEAK_GAIN, tensorwise * cell) for cell in line) for line in plane)
        for plane in float8_measured.H100_ROWWISE)
    try:
        return job_estimate(["--hardware", row.card, *row.overrides])[1].most_loaded()
    finally:
        tp_costs.ASYNC_TP_HIDDEN, float8_measured.SPEEDUPS["tensorwise"]["gh100"] = saved_hidden, saved_table


def tps(row: Row, constants: dict) -> float:
    """The row's predicted tokens/s/device under ``constants`` (shares by family, hidden, tensorwise)."""
    planned = estimate(row, constants["hidden"], constants["tensorwise"])
    scale = constants["shares"].get(row.family, constants["shares"][H100_FAMILY])
    hardware = planned.hardware
    base = constants["base"].get(row.family, constants["base"][H100_FAMILY])
    # A card planned with another's shares takes them as they are; its own are scaled by the fitted factor.
    achievable, fp8 = base[0] * scale, (base[1] * scale if base[1] else None)
    return dataclasses.replace(planned, hardware=dataclasses.replace(
        hardware, achievable=achievable, fp8_achievable=fp8)).tokens_per_device()


def log_errors(fit: list[Row], constants: dict) -> list[float]:
    return [math.log(tps(row, constants) / row.tps) for row in fit]


def fit_shares(fit: list[Row], constants: dict) -> dict:
    """Each family's factor on its shares with a mean log error of zero over its rows in ``fit``."""
    shares = {}
    for family in sorted({row.family for row in fit}, key=lambda f: f != H100_FAMILY):  # the H100's first
        own = [row for row in fit if row.family == family]
        low, high = 0.2, 5.0
        for _ in range(40):
            middle = math.sqrt(low * high)
            trial = {**constants, "shares": {**constants["shares"], **shares, family: middle},
                     "base": constants["base"]}
            low, high = (middle, high) if statistics.mean(log_errors(own, trial)) < 0 else (low, middle)
        shares[family] = math.sqrt(low * high)
    return shares


def fitted(fit: list[Row], shipped: dict) -> dict:
    """The constants fitted on ``fit``: shares, then the AsyncTP share, then tensorwise's factor, each at the least
    mean |log error| of the rows it touches, the shares refitted at each trial."""
    constants = {**shipped, "base": _bases_for(fit, shipped)}
    constants["shares"] = fit_shares(fit, constants)
    for key, grid, touched in (("hidden", ASYNC_GRID, [r for r in fit if r.async_tp]),
                               ("tensorwise", TENSORWISE_GRID, [r for r in fit if r.tensorwise_gh100])):
        if not touched:
            continue
        best = None
        for value in grid:
            trial = {**constants, key: value}
            trial["shares"] = fit_shares(fit, trial)
            error = statistics.mean(abs(e) for e in log_errors(touched, trial))
            best = min(best or (error, trial), (error, trial), key=lambda pair: pair[0])
        constants = best[1]
    return constants


def _bases_for(fit: list[Row], shipped: dict) -> dict:
    """The shares each family scales: its own where the fit has its rows, else the H100's (a card with no run)."""
    present = {row.family for row in fit}
    return {family: shares if family in present else shipped["base"][H100_FAMILY]
            for family, shares in shipped["base"].items()}


def shipped_constants(all_rows: list[Row]) -> dict:
    base = {}
    for row in all_rows:
        hardware = estimate(row, tp_costs.ASYNC_TP_HIDDEN, float8_measured.TENSORWISE_OVER_ROWWISE).hardware
        base.setdefault(row.family, (hardware.achievable, hardware.fp8_achievable))
    return {"shares": {family: 1.0 for family in base}, "base": base, "hidden": tp_costs.ASYNC_TP_HIDDEN,
            "tensorwise": float8_measured.TENSORWISE_OVER_ROWWISE}


def spread(values: list[float]) -> str:
    if not values:
        return "no rows"
    return (f"mean {statistics.mean(abs(v) for v in values):.1%}, worst {max(values, key=abs):+.1%}, "
            f"{sum(abs(v) <= 0.15 for v in values)}/{len(values)} within 15%")


def contained(all_rows: list[Row], held_out: dict) -> tuple[int, int]:
    """How many rows' held-out errors the printed band would have contained had their source never been published:
    the band for their card set from the card's rows of the other sources (its worst held-out error), and none
    ("expected error: unknown") for a card no other source has; and how many rows had no band. (The other sources'
    held-out errors come from fits that saw this row's source: the band is that much better informed.)"""
    inside = unknown = 0
    for row in all_rows:
        others = [abs(held_out[r]) for r in all_rows if r.family == row.family and r.source != row.source]
        unknown += not others
        inside += bool(others) and abs(held_out[row]) <= max(others)
    return inside, unknown


def main() -> None:
    start = time.perf_counter()
    all_rows = rows()
    shipped = shipped_constants(all_rows)
    as_shipped = {row: tps(row, shipped) / row.tps - 1 for row in all_rows}
    held_out, fits = {}, {}
    for source in SOURCES:
        fit = [row for row in all_rows if row.source != source]
        fits[source] = constants = fitted(fit, shipped)
        for row in all_rows:
            if row.source == source:
                held_out[row] = tps(row, constants) / row.tps - 1
        print(f"left out {SOURCES[source]}: shares {', '.join(f'{f} x{s:.3f}' for f, s in constants['shares'].items())}"
              f", ASYNC_TP_HIDDEN {constants['hidden']}, TENSORWISE_OVER_ROWWISE {constants['tensorwise']}",
              flush=True)
    print("\n| source | card | job | TPS/GPU published | error as shipped | error held out | memory error |")
    print("|---|---|---|---:|---:|---:|---:|")
    memory = {}
    for row in all_rows:
        planned = estimate(row, tp_costs.ASYNC_TP_HIDDEN, float8_measured.TENSORWISE_OVER_ROWWISE)
        memory[row] = None if row.memory is None else planned.reserved() / GIB / row.memory - 1
        print(f"| {row.source} | {row.card} | {row.name} | {row.tps:,} | {as_shipped[row]:+.0%} | "
              f"{held_out[row]:+.0%} | {'' if memory[row] is None else f'{memory[row]:+.0%}'} |")
    print()
    for family in sorted({row.family for row in all_rows}):
        own = [row for row in all_rows if row.family == family]
        print(f"{family}: tokens/s as shipped {spread([as_shipped[r] for r in own])}; held out "
              f"{spread([held_out[r] for r in own])}; memory {spread([memory[r] for r in own if memory[r] is not None])}")
    print(f"every card: tokens/s as shipped {spread(list(as_shipped.values()))}; held out "
          f"{spread(list(held_out.values()))}; memory {spread([m for m in memory.values() if m is not None])}")
    inside, unknown = contained(all_rows, held_out)
    print(f"the printed band, set without each row's source, contains {inside} of {len(all_rows)} held-out rows' "
          f"errors ({unknown} rows on cards no other source has: band unknown)")
    print(f"\n({time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
