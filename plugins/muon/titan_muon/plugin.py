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

from titan_core import (CP, DP_REPLICATE, DP_SHARD, FLOAT_DTYPES, PP, TP, ConfigError, Declaration, Plan,
                        build_meta_model, hookimpl, param_groups, parameter_role)

from titan_muon.exchange import assign_owners
from titan_muon.optimizer import MuonWithAdamW, NewtonSchulz

FIELD = "plugins.muon"
ADJUST_LR_RULES = ("original", "match_rms_adamw")
MATRIX = "matrix"  # the parameter role Muon steps (docs/config.md)


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
        """muon: no model transform and no mesh dimension: an optimizer over whatever the plan built."""
        return Declaration()

    @hookimpl
    def validate(self, config, plugin_config):
        """muon: its numbers, the Newton–Schulz dtype, and AdamW states it can keep (float32)."""
        validate_options(config, plugin_config)

    @hookimpl
    def estimate_costs(self, estimate, config, plugin_config, plan):
        """muon: one momentum per matrix element, AdamW's two float32 moments for the rest; what its step holds
        beyond them; this rank's share of the Newton–Schulz work; the matrices' updates sent to their owners and
        their rows sent back."""
        model = build_meta_model(config, plan.model)
        matrices = [p.shape for name, p in model.named_parameters() if parameter_role(plan.model, name, p) == MATRIX]
        every = sum(p.numel() for p in model.parameters())
        matrix_share = sum(shape.numel() for shape in matrices) / every
        whole_matrices = [shape for shape in matrices if len(shape) == 2]  # not expert stacks: exchanged
        layout = plan.model.tensor_parallel
        relaid = sum(p.numel() for name, p in model.named_parameters() if layout is not None and p.ndim == 2
                     and any(name.endswith(f".{linear}.weight") for linear in layout.block_rowwise)) / every
        exchanged_share = sum(shape.numel() for shape in whole_matrices) / every
        momentum_bytes = FLOAT_DTYPES[plugin_config.momentum_dtype].itemsize
        estimate.optimizer_state_bytes = momentum_bytes * matrix_share + 8 * (1 - matrix_share)
        dims = [dim for dim in (DP_REPLICATE, DP_SHARD, CP, TP) if plan.degree(dim) > 1]
        ranks = math.prod(plan.degree(dim) for dim in dims)  # the ranks a matrix's mesh spreads over
        work = sum(NewtonSchulz.cost_of(shape, plugin_config.ns_steps) for shape in matrices) / every
        estimate.optimizer_flops = lambda e: e.held_params() * work / ranks
        result_bytes = FLOAT_DTYPES[plugin_config.ns_dtype].itemsize
        # The owners are chosen by work, not bytes: the rank that owns the most receives that much more.
        owned = [0] * ranks
        costs = [NewtonSchulz.cost_of(shape, 1) for shape in whole_matrices]
        for shape, owner in zip(whole_matrices, assign_owners(costs, ranks)):
            owned[owner] += shape.numel()
        most_owned = max(owned) * ranks / max(1, sum(owned))
        largest = max((shape[-2:].numel() for shape in matrices), default=0)
        # Each update is a new float32 tensor unless it is the stored momentum itself.
        update_copies = int(plugin_config.nesterov or momentum_bytes < 4)

        def step_bytes(e):
            """What the step holds at once, the most of its phases: every update and, under a mesh, the rows laid out
            for the exchange (tensor parallel's split by input features), the exchange's sent and received buffers
            and, at a second level, what the first brought; or the orthogonalised updates and Newton–Schulz's
            working matrices; or those and AdamW's batched update of the other parameters."""
            held = e.sharded_params() * e.trained_share
            matrix, moved = held * matrix_share, held * exchanged_share
            updates = 4 * matrix * update_copies
            orthogonalised = result_bytes * matrix + 3 * result_bytes * largest
            adamw = result_bytes * matrix + 4 * (held - matrix)
            if ranks == 1:
                return max(updates + orthogonalised, adamw)
            # gloo has no all-to-all: DTensor re-lays by gathering, and a rank's rows keep the gathered matrix (on a
            # second mesh dimension a copy of its rows too: measured under torch 2.13).
            gathered = plan.degree(TP) + (len(dims) > 1)
            relaid_copies = (gathered if e.device_type == "cpu" else 1) * (plan.degree(TP) > 1)
            exchanging = updates + 4 * held * relaid * relaid_copies + 4 * moved * ((len(dims) > 1) + 1 + most_owned)
            return max(exchanging, updates + orthogonalised, adamw)

        estimate.optimizer_step_bytes = step_bytes
        if ranks == 1:
            return

        def exchanged(bytes_per_element):  # of its owned matrices, the rows it does not hold; of the others, its own
            return lambda e: e.held_params() * exchanged_share * bytes_per_element * (ranks - 1) / ranks**2

        levels, calls = len(dims), 2 * sum(len(shape) == 2 for shape in matrices) / plan.degree(PP)
        estimate.add_collective("all-to-all of the Muon updates to their owners", tuple(dims), exchanged(4),
                                overlapped=False, plugin="muon", calls=levels)
        estimate.add_collective("all-to-all of the orthogonalised rows back", tuple(dims), exchanged(result_bytes),
                                overlapped=False, plugin="muon", calls=levels)
        if plan.degree(TP) > 1:  # a tensor-parallel split laid out by rows and back: most of its piece each way
            tp = plan.degree(TP)
            estimate.add_collective(
                "re-layout of the tensor-parallel matrices by rows", (TP,),
                lambda e: e.held_params() * exchanged_share / ranks * (tp - 1) / tp * (4 + result_bytes),
                overlapped=False, plugin="muon", calls=calls)

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
        flops, received = float(self.optimizer.newton_schulz.flops), float(self.optimizer.received_bytes)
        busiest = torch.tensor([flops, received], device=mesh.device_type)
        total = torch.tensor([flops], device=mesh.device_type)
        if dist.is_initialized():
            dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
            dist.all_reduce(total)
        return {"muon_ns_busiest_share": busiest[0].item() / max(total.item(), 1.0),
                "muon_ns_gflop_busiest": busiest[0].item() / 1e9, "muon_received_mib_busiest": busiest[1].item() / 2**20}
