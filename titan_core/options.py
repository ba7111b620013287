"""Option values that several plugins share."""

from __future__ import annotations

import torch

from titan_core.errors import ConfigError

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def float_dtype(value: str, field: str) -> torch.dtype:
    """The floating-point dtype ``value`` names; a ConfigError naming ``field`` for anything else."""
    if value not in FLOAT_DTYPES:
        raise ConfigError(field, f"unknown dtype '{value}'", f"use one of {', '.join(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[value]
