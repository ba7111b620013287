"""The core's learning-rate schedule: warm-up, then a decay of the shape the config names."""

from __future__ import annotations

import math

import torch

# How each decay falls from 1 to 0 as its progress goes from 0 to 1.
DECAY_SHAPES = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
                "sqrt": lambda p: 1 - math.sqrt(p)}


def lr_schedule(config):
    """Linear warm-up to ``optimizer.lr``, then to ``min_lr_ratio`` of it: cosine or linear decay over the rest
    of training, or warmup-stable-decay (``wsd``: the full rate until the last ``decay_steps``, which decay in
    ``decay_shape``). A function of the step alone, so a run resumes at any step with the same rate."""
    steps, s = config.training.steps, config.lr_scheduler
    warmup, floor = s.warmup_steps, s.min_lr_ratio
    decay_steps = s.decay_steps or max(1, steps // 5)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if s.decay == "none":
            return 1.0
        if s.decay == "wsd":
            progress = max(0.0, (step - (steps - decay_steps)) / decay_steps)
            return floor + (1 - floor) * DECAY_SHAPES[s.decay_shape](min(1.0, progress))
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * DECAY_SHAPES[s.decay](progress)
    return factor


class StepSchedule(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` of one factor for every parameter group, whose checkpointed state is its step alone.

    The rates come from the job's own config (``optimizer.lr``, the groups' multipliers, ``lr_scheduler.*``), so
    a job resumed with a different rate or different parameter groups runs the schedule its config describes.
    """

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch, self._step_count = state_dict["last_epoch"], state_dict["_step_count"]
        self._last_lr = [base * factor(self.last_epoch) for factor, base in zip(self.lr_lambdas, self.base_lrs)]
