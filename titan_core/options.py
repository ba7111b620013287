"""Option values that several plugins share."""

from __future__ import annotations

import warnings

import torch

from titan_core.errors import ConfigError

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Under a narrow compute dtype on the CPU, autocast leaves a norm's bfloat16 input beside its float32 weight
# (CUDA's runs norms in float32), and torch warns that it takes the unfused path: nothing a user can act on.
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)


def float_dtype(value: str, field: str) -> torch.dtype:
    """The floating-point dtype ``value`` names; a ConfigError naming ``field`` for anything else."""
    if value not in FLOAT_DTYPES:
        raise ConfigError(field, f"unknown dtype '{value}'", f"use one of {', '.join(FLOAT_DTYPES)}")
    return FLOAT_DTYPES[value]


def compute_dtype(value: str | None, field: str, device_type: str) -> torch.dtype:
    """The dtype parameters are gathered and computed in: as set, or for null bfloat16 on GPUs (mixed
    precision, TorchTitan's default: half the bytes in flight) and float32 on the CPU (exact parity with one
    process, and CPUs gain little from bf16)."""
    if value is None:
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return float_dtype(value, field)


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


def text_or_null(value, field: str) -> str | None:
    """An optional name or path: null, or text; a ConfigError naming ``field`` for anything else (Hydra reads
    ``7`` or ``true`` as a number or a boolean, where an option with a null default accepts any kind)."""
    if value is not None and not isinstance(value, str):
        raise ConfigError(field, f"{value!r} is not text", f"quote it for Hydra: \"{field}='{value}'\"")
    return value


def check_positive(args, names, family: str) -> None:
    """Refuse a size, count, rank or factor of a model that is not a positive number (a null option stays null): a
    zero-width latent or a head dimension of 0 builds a model torch runs without a word."""
    for name in names:
        value = getattr(args, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ConfigError(f"model.{name}", f"{value!r} is not a positive number",
                              f"set model.{name} to a positive value, as {family}'s presets do")
