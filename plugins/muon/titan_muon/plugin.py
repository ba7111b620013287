"""Muon as titan-core's optimizer: the ``matrix`` parameters (attention and MLP weights, expert stacks, adapters)
step by Muon, the embeddings, the output layer, norms and biases by AdamW, as Moonlight's recipe does.

Both follow the core's parameter groups (``optimizer.no_weight_decay``, ``optimizer.lr_multipliers``); AdamW
takes ``optimizer.*`` as the core's does, Muon its own options (docs/plugins/muon.md). Any plan that holds the
matrices as DTensors (fsdp, tp, their stacks, pipeline stages) works unchanged: each matrix is made whole,
orthogonalised by one rank of its mesh and sent back (:mod:`titan_muon.exchange`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from titan_core import FLOAT_DTYPES, ConfigError, Declaration, Plan, hookimpl, param_groups

from titan_muon.optimizer import MuonWithAdamW, NewtonSchulz

FIELD = "plugins.muon"
ADJUST_LR_RULES = ("original", "match_rms_adamw")
MATRIX = "matrix"  # the parameter role Muon steps (docs/config.md)
HONOURED = ("lr", "betas", "eps", "weight_decay", "no_weight_decay", "lr_multipliers", "implementation")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def validate_options(config, options) -> None:
    checks = (
        ("lr", options.lr is None or _positive(options.lr), "a positive number, or null for optimizer.lr"),
        ("weight_decay", options.weight_decay is None or _positive(options.weight_decay) or options.weight_decay == 0,
         "a number >= 0, or null for optimizer.weight_decay"),
        ("momentum", isinstance(options.momentum, (int, float)) and 0 <= options.momentum < 1, "a number in [0, 1)"),
        ("ns_steps", isinstance(options.ns_steps, int) and 1 <= options.ns_steps < 100, "an integer from 1 to 99"),
        ("ns_coefficients", len(options.ns_coefficients) == 3 and all(
            isinstance(c, (int, float)) for c in options.ns_coefficients), "three numbers (a, b, c)"),
        ("eps", _positive(options.eps), "a positive number"),
        ("adjust_lr", options.adjust_lr in ADJUST_LR_RULES, f"one of {', '.join(ADJUST_LR_RULES)}"),
        ("ns_dtype", options.ns_dtype in ("bfloat16", "float32"), "bfloat16 or float32"),
        ("momentum_dtype", options.momentum_dtype in ("bfloat16", "float32"), "bfloat16 or float32"),
    )
    for name, acceptable, what in checks:
        if not acceptable:
            raise ConfigError(f"{FIELD}.{name}", f"{options[name]!r} is not {what}", f"set {FIELD}.{name} to {what}")
    if config.optimizer.state_dtype != "float32":
        raise ConfigError("optimizer.state_dtype", f"{config.optimizer.state_dtype} AdamW states are the core's "
                          "AdamW's; muon's AdamW keeps float32 ones", "set optimizer.state_dtype=float32")


def muon_groups(model_parts, config, options, plan: Plan) -> list[dict]:
    """The core's groups by role, the matrices' marked for Muon with its options (and its rate, when set)."""
    opt = config.optimizer
    groups = param_groups(model_parts, plan.model, opt.lr, opt.weight_decay, opt.no_weight_decay, opt.lr_multipliers)
    for group in groups:
        if group["role"] == MATRIX:
            group.update(muon=True, momentum=options.momentum, nesterov=options.nesterov, adjust_lr=options.adjust_lr)
            if options.lr is not None:
                group["lr_multiplier"] *= options.lr / opt.lr
                group["lr"] = opt.lr * group["lr_multiplier"]
            if options.weight_decay is not None and group["weight_decay"]:
                group["weight_decay"] = options.weight_decay
    return groups


class MuonPlugin:
    """The run's Muon optimizer, kept to report how the Newton–Schulz work spread over the ranks."""

    def __init__(self):
        self.optimizer: MuonWithAdamW | None = None

    @hookimpl
    def declare(self):
        """muon: no model transform and no mesh dimension: an optimizer over whatever the plan built, taking the core's
        optimizer options but state_dtype (its AdamW keeps float32 moments, Muon its momentum_dtype)."""
        return Declaration(optimizer_options=frozenset(HONOURED))

    @hookimpl
    def validate(self, config, plugin_config):
        """muon: its numbers, the Newton–Schulz dtype, and AdamW states it can keep (float32)."""
        validate_options(config, plugin_config)

    @hookimpl
    def build_optimizer(self, model_parts, config, plugin_config, plan: Plan):
        """muon: Muon for the matrices, torch's AdamW for the rest, in the core's parameter groups."""
        opt = config.optimizer
        newton_schulz = NewtonSchulz(tuple(plugin_config.ns_coefficients), plugin_config.ns_steps, plugin_config.eps,
                                     FLOAT_DTYPES[plugin_config.ns_dtype])
        self.optimizer = MuonWithAdamW(muon_groups(model_parts, config, plugin_config, plan), newton_schulz,
                                       FLOAT_DTYPES[plugin_config.momentum_dtype], lr=opt.lr, betas=tuple(opt.betas),
                                       eps=opt.eps, weight_decay=opt.weight_decay,
                                       fused=opt.implementation == "fused", foreach=opt.implementation in (None, "foreach"))
        return self.optimizer

    @hookimpl
    def step_metrics(self, mesh):
        """muon: how the step's Newton–Schulz work spread over the ranks, and the busiest rank's traffic for it."""
        optimizer = self.optimizer
        assert optimizer is not None  # build_optimizer made it before the first step
        flops, received = float(optimizer.newton_schulz.flops), float(optimizer.received_bytes)
        busiest = torch.tensor([flops, received], device=mesh.device_type)
        total = torch.tensor([flops], device=mesh.device_type)
        if dist.is_initialized():
            dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
            dist.all_reduce(total)
        return {"muon_ns_busiest_share": busiest[0].item() / max(total.item(), 1.0),
                "muon_ns_gflop_busiest": busiest[0].item() / 1e9, "muon_received_mib_busiest": busiest[1].item() / 2**20}
