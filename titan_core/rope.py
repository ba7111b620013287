"""Rotary position frequencies shared by model plugins: plain RoPE's and YaRN's (context stretched past the length a
model was pre-trained at; DeepSeek-V3, gpt-oss)."""

from __future__ import annotations

import math

import torch


def rope_frequencies(dim: int, base: float) -> torch.Tensor:
    """The angle per position of each of a head's ``dim // 2`` rotated feature pairs."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's logit temperature correction for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(dim: int, base: float, factor: float, original_context: int, beta_fast: float,
                     beta_slow: float, truncate: bool = True) -> torch.Tensor:
    """RoPE's frequencies with YaRN: the pairs turning fewer than ``beta_slow`` times over the ``original_context``
    are slowed ``factor`` times (interpolated), those turning more than ``beta_fast`` times kept, with a linear ramp
    between; ``truncate`` rounds the ramp's ends to whole pairs (DeepSeek-V3 does, gpt-oss does not)."""
    freqs = rope_frequencies(dim, base)
    if factor <= 1:
        return freqs

    def pair_turning(rotations: float) -> float:  # the feature pair that turns ``rotations`` times
        return dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)
