"""How far the planner's figures have been from measurement: the band printed beside every estimate.

The bands are what the benches and tests measured, copied here when they are rerun (each names its source);
no row was tuned. A GPU estimate is judged against published runs, whose memory is what the allocator
reserved (the planner predicts what is allocated, so it reads low); a CPU estimate against this machine's
own steps, tracked tensor by tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ErrorBand", "error_band"]


@dataclass(frozen=True)
class ErrorBand:
    """Mean and worst relative error (predicted / measured - 1) of memory and of tokens/s, against ``source``."""

    source: str
    memory_mean: float
    memory_worst: float
    speed_mean: float
    speed_worst: float

    def describe(self) -> str:
        return (f"expected error (against {self.source}): memory mean {self.memory_mean:.0%}, worst "
                f"{self.memory_worst:+.0%}; tokens/s mean {self.speed_mean:.0%}, worst {self.speed_worst:+.0%}")


_BANDS = {
    # bench/planner_vs_seeds.py, 2026-11-27: the 17 rows of TorchTitan's published Llama 3.1 runs on H100s.
    "cuda": ErrorBand("17 published Llama 3.1 runs on H100s, bench/planner_vs_seeds.py", 0.17, -0.41, 0.10, 0.40),
    # tests/test_planner.py's 27 plans against torch's memory tracker (docs/planner.md), and the 8 step-time
    # ratios of bench/parallel_step_time.py.
    "cpu": ErrorBand("27 plans tracked on this CPU and 8 step-time ratios, docs/planner.md", 0.014, -0.044, 0.14,
                     -0.22),
}


def error_band(device_type: str) -> ErrorBand | None:
    """The band of the estimates for devices of ``device_type``; None where nothing was measured."""
    return _BANDS.get(device_type)
