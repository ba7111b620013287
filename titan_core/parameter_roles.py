"""The role each trainable parameter plays in its model, and the optimizer's parameter groups built from them.

A role is read from the model's description, so it holds for every model and every plan: ``embedding`` for
the parameters of the modules ``inputs`` names, ``output`` for the weight of the ``logits`` linear, ``bias``
for biases, ``norm`` for every other parameter of fewer than two dimensions (norm scales and gains), and
``matrix`` for the rest (attention and MLP weights, 3-D expert stacks, adapters). ``optimizer.no_weight_decay``
and ``optimizer.lr_multipliers`` name roles; an optimizer plugin reads them through :func:`parameter_role`
(Muon takes the matrices, AdamW the rest).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import nn

from titan_core.description import ModelDescription, canonical_name
from titan_core.errors import ConfigError

MATRIX, EMBEDDING, OUTPUT, NORM, BIAS = "matrix", "embedding", "output", "norm", "bias"
PARAMETER_ROLES = (MATRIX, EMBEDDING, OUTPUT, NORM, BIAS)


def parameter_role(description: ModelDescription, name: str, param: nn.Parameter) -> str:
    """The role of the parameter called ``name`` (as ``named_parameters`` of a model part gives it)."""
    name = canonical_name(name)
    if description.logits is not None and name == f"{description.logits}.weight":
        return OUTPUT
    if any(name.startswith(f"{path}.") for path in description.inputs or ()):
        return EMBEDDING
    if name.rpartition(".")[2] == "bias":
        return BIAS
    return NORM if param.ndim < 2 else MATRIX


def param_groups(model_parts: Sequence[nn.Module], description: ModelDescription, lr: float, weight_decay: float,
                 no_weight_decay: Sequence[str], lr_multipliers: Mapping[str, float]) -> list[dict]:
    """The trainable parameters of ``model_parts`` in one group per role, in ``PARAMETER_ROLES`` order (roles
    without parameters left out), for ``torch.optim.Optimizer(groups, ...)``.

    Each group holds ``params``, ``role``, ``lr`` (``lr`` times the role's multiplier), ``lr_multiplier`` (which
    the logged learning rate is divided by) and ``weight_decay`` (0 for the roles of ``no_weight_decay``).
    """
    by_role: dict[str, list[nn.Parameter]] = {role: [] for role in PARAMETER_ROLES}
    for part in model_parts:
        for name, param in part.named_parameters():
            if param.requires_grad:
                by_role[parameter_role(description, name, param)].append(param)
    groups = [{"params": params, "role": role, "lr": lr * lr_multipliers.get(role, 1.0),
               "lr_multiplier": float(lr_multipliers.get(role, 1.0)),
               "weight_decay": 0.0 if role in no_weight_decay else weight_decay}
              for role, params in by_role.items() if params]
    # A rank with nothing to train (a pipeline stage whose blocks a conversion froze) steps one empty group: its step
    # does nothing, its state stays empty, and its learning rate is logged like the others'.
    return groups or [{"params": [], "role": PARAMETER_ROLES[0], "lr": lr, "lr_multiplier": 1.0,
                       "weight_decay": weight_decay}]


def check_param_group_rules(no_weight_decay, lr_multipliers) -> None:
    """Refuse a role that does not exist and a multiplier that is not a positive number, naming the field (the
    schema has already refused values of another kind)."""
    known = ", ".join(PARAMETER_ROLES)
    for role in no_weight_decay:
        if role not in PARAMETER_ROLES:
            raise ConfigError("optimizer.no_weight_decay", f"'{role}' is not a parameter role", f"use some of {known}")
    for role, factor in lr_multipliers.items():
        if role not in PARAMETER_ROLES:
            raise ConfigError(f"optimizer.lr_multipliers.{role}", f"'{role}' is not a parameter role",
                              f"use some of {known}")
        if not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"optimizer.lr_multipliers.{role}", f"{factor!r} is not a positive number",
                              "set a factor of optimizer.lr greater than 0")
