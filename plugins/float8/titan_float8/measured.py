"""Published measurements of float8 linears' speed against bfloat16, by the shape of the matmul, and their lookup.

A float8 linear's gain depends on its shape: its casts grow with M*K + M*N + K*N while its matmuls' time grows
with M*K*N, and the scaled matmul kernels themselves lose efficiency on narrow shapes. Priced at one rate, a
rowwise linear split 8 ways by tensor parallel came out 36% faster than TorchTitan measured it, slower than
bfloat16 there. So where a table measured on the card's chip exists, the planner reads each linear's speed-up
in it instead of computing one from the peak rates and the casts' bytes.
"""

from __future__ import annotations

import math
from typing import Any

# M, K and N of the table's forward matmul (M rows of K features into N), each from 1,024 to 32,768.
SIZES = (1024, 2048, 4096, 8192, 16384, 32768)

# A compiled LayerNorm -> Linear -> Sigmoid, forward and backward, float8 rowwise (torchao's dynamic scales,
# its default kernels) against bfloat16, on an H100 with PyTorch 2.8.0a0+git48807d5: pytorch/ao
# docs/static/fp8-rowwise-perf.png (PR #2312, fdddb2cfa2a4ea930dfce9ef23429013b466b22d, 2025-06-06).
# Indexed [M][K][N] by the positions of ``SIZES``.
H100_ROWWISE = (
    ((0.42, 0.42, 0.50, 0.51, 0.56, 0.56),  # M 1024
     (0.40, 0.38, 0.42, 0.50, 0.50, 0.56),
     (0.48, 0.43, 0.46, 0.53, 0.57, 0.60),
     (0.45, 0.48, 0.54, 0.62, 0.60, 0.62),
     (0.46, 0.48, 0.54, 0.60, 0.60, 0.61),
     (0.45, 0.50, 0.55, 0.60, 0.62, 0.65)),
    ((0.43, 0.43, 0.48, 0.55, 0.62, 0.65),  # M 2048
     (0.38, 0.45, 0.58, 0.65, 0.72, 0.75),
     (0.43, 0.50, 0.68, 0.78, 0.81, 0.82),
     (0.46, 0.58, 0.73, 0.82, 0.87, 0.89),
     (0.48, 0.62, 0.75, 0.83, 0.84, 0.85),
     (0.50, 0.64, 0.75, 0.84, 0.83, 0.99)),
    ((0.45, 0.47, 0.57, 0.66, 0.72, 0.76),  # M 4096
     (0.43, 0.53, 0.70, 0.83, 0.90, 0.91),
     (0.44, 0.64, 0.84, 1.01, 1.01, 1.04),
     (0.53, 0.72, 0.91, 1.01, 1.07, 1.13),
     (0.53, 0.74, 0.92, 1.05, 1.10, 1.18),
     (0.54, 0.75, 0.93, 1.02, 1.17, 1.18)),
    ((0.48, 0.52, 0.65, 0.77, 0.83, 0.84),  # M 8192
     (0.45, 0.64, 0.82, 1.01, 1.03, 1.06),
     (0.52, 0.76, 1.00, 1.13, 1.17, 1.19),
     (0.59, 0.85, 1.05, 1.20, 1.31, 1.41),
     (0.58, 0.82, 1.03, 1.22, 1.37, 1.40),
     (0.59, 0.82, 1.04, 1.30, 1.36, 1.46)),
    ((0.48, 0.58, 0.73, 0.86, 0.85, 0.89),  # M 16384
     (0.51, 0.70, 0.90, 1.05, 1.07, 1.15),
     (0.57, 0.79, 1.02, 1.20, 1.26, 1.40),
     (0.61, 0.87, 1.08, 1.33, 1.39, 1.49),
     (0.59, 0.83, 1.07, 1.34, 1.42, 1.55),
     (0.60, 0.85, 1.16, 1.35, 1.48, 1.72)),
    ((0.51, 0.62, 0.77, 0.87, 0.88, 0.94),  # M 32768
     (0.54, 0.73, 0.91, 1.08, 1.14, 1.27),
     (0.59, 0.81, 1.04, 1.28, 1.35, 1.49),
     (0.63, 0.87, 1.11, 1.41, 1.50, 1.62),
     (0.60, 0.83, 1.16, 1.39, 1.49, 1.73),
     (0.63, 0.93, 1.16, 1.48, 1.70, 1.52)),
)

# Tensorwise on the same chip. Its per-shape table is published as an image only (pytorch/ao
# docs/source/workflows/training.md, "Performance"), which this machine cannot fetch. Its linears lose speed on
# narrow shapes as rowwise's do (the kernels' tiles, the casts' share of the time) and gain more at every shape
# (one scale a tensor: fewer bytes cast, no rescaling of the backward's outputs), up to the float8 peak's double of
# bfloat16's: TENSORWISE_OVER_ROWWISE times rowwise's speed-up, at most FLOAT8_PEAK_GAIN. The factor (two decimals)
# is the one that plans TorchTitan's Llama 3.1 8B FSDP 8 + compile + float8 job (the seeds' table 1, 8,532 TPS/GPU)
# as it ran, as the card's float8 share was fitted before: priced at one float8 rate whatever the shapes, the 8B
# jobs with TP 8 came out 32% and 35% fast once their casts were counted as TorchTitan ran them (on the shards).
TENSORWISE_OVER_ROWWISE = 1.57
FLOAT8_PEAK_GAIN = 2.0
H100_TENSORWISE = tuple(tuple(tuple(min(FLOAT8_PEAK_GAIN, TENSORWISE_OVER_ROWWISE * cell) for cell in row)
                              for row in plane) for plane in H100_ROWWISE)

# By recipe, then by the chip a profile names (``Hardware.chip``): the H200 is an H100's die with more memory.
SPEEDUPS: dict[str, dict[str, Any]] = {"rowwise": {"gh100": H100_ROWWISE}, "tensorwise": {"gh100": H100_TENSORWISE}}


def _position(size: float) -> float:
    """Where ``size`` falls among ``SIZES``, in steps of a doubling, held to the table's edges: beyond them the
    nearest measurement stands (so a size under 1,024, tensor parallel's keys and values, is priced as 1,024,
    which flatters it)."""
    return min(max(math.log2(size / SIZES[0]), 0.0), len(SIZES) - 1.0)


def speedup(table, m: float, k: float, n: float) -> float:
    """The table's speed-up of a linear of forward shape (m, k, n), interpolated between measured shapes linearly
    in each size's logarithm."""
    corners = [(int(min(math.floor(p), len(SIZES) - 2)), p) for p in map(_position, (m, k, n))]
    result = 0.0
    for corner in range(8):
        weight, index = 1.0, []
        for axis, (low, position) in enumerate(corners):
            upper = corner >> axis & 1
            fraction = position - low
            weight *= fraction if upper else 1 - fraction
            index.append(low + upper)
        result += weight * table[index[0]][index[1]][index[2]]
    return result
