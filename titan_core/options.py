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


def replica_count(value: int, field: str) -> int:
    """A count of model replicas (1: none), checked before the core sizes the mesh with it."""
    if value < 1:
        raise ConfigError(field, f"{value} is not a positive integer", "set 1 for no replicas, or more")
    return value


def count_or_null(value, field: str, meaning_of_null: str) -> int | None:
    """An optional count: null, or an integer >= 1; a ConfigError naming ``field`` for anything else."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(field, f"{value!r} is not a positive integer or null", f"use 1 or more, or null for "
                          f"{meaning_of_null}")
    return value
