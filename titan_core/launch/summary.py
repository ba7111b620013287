"""What a run has on, said in its first lines: the precision and who decides it, the learning-rate schedule, the
optimizer and its parameter groups; and, for a schedule that cannot do what its options say, a warning with the fix."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from titan_core.capabilities import MIXED_PRECISION
from titan_core.mesh import device_kind
from titan_core.options import FLOAT_DTYPES, compute_dtype
from titan_core.plan import Plan

__all__ = ["run_lines", "optimizer_line"]


def run_lines(config, plan: Plan) -> list[str]:
    """The precision and the schedule, then a warning for each schedule option that cannot do what it says."""
    return [f"titan-core: precision: {precision(config, plan)}", f"titan-core: schedule: {schedule(config)}",
            *(f"titan-core: warning: {warning}" for warning in schedule_warnings(config))]


def precision(config, plan: Plan) -> str:
    deciding = [p.name for p in plan.plugins if MIXED_PRECISION in p.declaration.provides]
    if deciding:
        return f"{deciding[0]}'s mixed precision (its options), the core's autocast off"
    dtype = compute_dtype(config.training.compute_dtype, "training.compute_dtype", device_kind(config.launch.device))
    name = next(name for name, value in FLOAT_DTYPES.items() if value == dtype)
    chosen = ("training.compute_dtype" if config.training.compute_dtype is not None
              else "training.compute_dtype=null: the device's default")
    if dtype == torch.float32:
        return f"float32, no autocast ({chosen})"
    return f"{name} autocast over float32 weights ({chosen})"


def schedule(config) -> str:
    s, steps, lr = config.lr_scheduler, config.training.steps, config.optimizer.lr
    floor = f"{lr * s.min_lr_ratio:.3g}"
    warmup = f"warm-up {s.warmup_steps} steps to {lr:.3g}, then " if s.warmup_steps else f"{lr:.3g}, "
    if s.decay == "none":
        return f"{warmup}constant to step {steps} (lr_scheduler.*)"
    if s.decay == "wsd":
        return (f"{warmup}stable until step {steps - decay_steps(config)}, then a {s.decay_shape} decay over the last "
                f"{decay_steps(config)} to {floor} (lr_scheduler.*)")
    return f"{warmup}{s.decay} decay to {floor} at step {steps} (lr_scheduler.*)"


def decay_steps(config) -> int:
    return config.lr_scheduler.decay_steps or max(1, config.training.steps // 5)


def schedule_warnings(config) -> list[str]:
    s, steps = config.lr_scheduler, config.training.steps
    warnings = []
    if s.warmup_steps > steps > 0:
        warnings.append(f"lr_scheduler.warmup_steps={s.warmup_steps} is longer than the run's {steps} steps: the "
                        f"learning rate never reaches optimizer.lr; fix: set lr_scheduler.warmup_steps={steps} or less")
    if s.decay == "wsd" and decay_steps(config) == 1 and steps > 1:
        warnings.append(f"the wsd decay lasts 1 step of {steps}: the rate drops to its floor at once; fix: set "
                        f"lr_scheduler.decay_steps to a fifth or so of training.steps")
    return warnings


def optimizer_line(optimizer: torch.optim.Optimizer, owner: str) -> str:
    """The optimizer, who built it (a plugin, or the core), and each parameter group: its role, the parameters this
    rank holds of it, its learning rate and decay."""
    groups = ", ".join(f"{group.get('role', index)} ({sum(_local(p) for p in group['params']):,} parameters on this "
                       f"rank, lr {group.get('initial_lr', group['lr']):.3g}, weight decay {group.get('weight_decay', 0):.3g})"
                       for index, group in enumerate(optimizer.param_groups))
    return f"optimizer: {type(optimizer).__name__} ({owner}): {groups}"


def _local(parameter: torch.Tensor) -> int:
    return parameter.to_local().numel() if isinstance(parameter, DTensor) else parameter.numel()
