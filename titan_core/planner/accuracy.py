"""How far the planner's figures have been from measurement: the band printed beside every estimate.

The bands are what the benches and tests measured, copied here when they are rerun (each names its source);
no row was tuned. A GPU estimate's tokens/s is judged against published runs it was not fitted on (each source left
out of the fit in turn), its memory against what the published runs' allocator reserved (against the estimate's
reserved figure, ``Estimate.reserved``); a CPU estimate against this machine's own steps, tracked tensor by tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ErrorBand", "error_band"]


@dataclass(frozen=True)
class ErrorBand:
    """Mean and worst relative error (predicted / measured - 1) of memory and of tokens/s, against ``source``
    (memory None: no run published it)."""

    source: str
    memory_mean: float | None
    memory_worst: float | None
    speed_mean: float
    speed_worst: float

    def describe(self) -> str:
        memory = self._memory_spread()
        memory = "memory not published" if memory is None else f"memory {memory}"
        speed = _spread(self.speed_mean, self.speed_worst)
        return f"expected error (against {self.source}): {memory}; tokens/s {speed}"

    def memory_note(self) -> str:
        """What follows the memory figure: its expected error, or nothing where no run published memory."""
        memory = self._memory_spread()
        return "" if memory is None else f"  [expected error: {memory}]"

    def _memory_spread(self) -> str | None:
        """The memory error's spread; None where no run published memory (mean and worst are None together)."""
        if self.memory_mean is None or self.memory_worst is None:
            return None
        return _spread(self.memory_mean, self.memory_worst)

    def speed_note(self) -> str:
        """What follows the tokens/s figure: its expected error."""
        return f"  [expected error: {_spread(self.speed_mean, self.speed_worst)}]"


def _spread(mean: float, worst: float) -> str:
    return f"mean {mean:.0%}, worst {worst:+.0%}"


# bench/planner_held_out.py, 2026-12-07 (50 rows): each published run predicted with the constants fitted on the other
# sources only (leave one source out: a card whose only source is left out is planned with the H100's shares, as a
# card without runs is). Memory has no constant fitted on published runs: its error is bench/planner_vs_seeds.py's.
_H100 = ErrorBand("36 published Llama 3 runs on H100s (21 with memory), each held out from the fit, "
                  "bench/planner_held_out.py", 0.051, -0.173, 0.090, 0.304)
_BY_PROFILE = {
    **{name: _H100 for name in ("h100_sxm", "h100_sxm_96gb", "h100_pcie", "h100_nvl")},
    "h200": ErrorBand("2 published Llama 3 runs on H200s, held out from the fit, bench/planner_held_out.py", 0.059,
                      -0.068, 0.161, -0.168),
    "a100": ErrorBand("3 published Llama 3 runs on A100s, held out from the fit, bench/planner_held_out.py", None, None,
                      0.396, -0.430),
    "mi300x": ErrorBand("4 published Llama 3 runs on MI300Xs, held out from the fit, bench/planner_held_out.py", 0.046,
                        -0.051, 0.437, 0.458),
    "b200": ErrorBand("5 published runs on B200s (Llama 3 8B at 750 W, 4 with memory; Qwen3 30B-A3B), each source held "
                      "out from the fit, bench/planner_held_out.py", 0.110, 0.112, 0.162, -0.212),
    # tests/test_planner_memory.py's 35 plans and pipeline ranks against torch's memory tracker (docs/planner.md), and
    # bench/parallel_step_time.py's 10 plans (one to eight workers), tokens/s as this profile prints them.
    "cpu-measured": ErrorBand("35 plans tracked on this CPU and 10 plans' step times, docs/planner.md", 0.008, -0.030,
                              0.67, 1.29),
}
# A GPU without published runs of its own (L40S, GB200, a profile from a file) has no band: the other cards'
# errors say nothing of it (an A100 run once missed by -47% where every card's band said "worst -8%").
_BY_DEVICE_TYPE = {
    # Any other CPU profile (one --calibrate wrote fits one process): the same tracked plans, and the tokens/s of
    # bench/parallel_step_time.py's 9 plans of several workers relative to one process.
    "cpu": ErrorBand("35 plans tracked on this CPU and 9 plans' step times relative to one process, docs/planner.md",
                     0.008, -0.030, 0.25, 0.67),
}


def error_band(profile: str, device_type: str) -> ErrorBand | None:
    """The band of the estimates on the hardware profile ``profile`` (its own published runs) or, for a CPU without
    any, on CPUs; None where nothing was measured (any GPU without runs of its own)."""
    return _BY_PROFILE.get(profile) or _BY_DEVICE_TYPE.get(device_type)
