"""What a model says of its blocks' feed-forward layers, for the plugins that swap them (module overrides)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatedMLP:
    """A block's feed-forward sub-module at ``module`` (a path inside one block) that computes
    ``down(silu(gate(x)) * up(x))`` with three bias-free ``nn.Linear`` children named ``gate``, ``up`` and ``down``,
    and no other parameter (SwiGLU): what a fused SwiGLU replaces. A block whose module at that path lacks the three
    linears (a mixture of experts' sparse block) is left alone."""

    module: str
    gate: str
    up: str
    down: str
