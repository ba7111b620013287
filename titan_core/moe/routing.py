"""The routing bookkeeping of a mixture-of-experts model, kept by its model plugin's object (an :class:`ExpertRouting`):
the balancing bias moved after each optimizer step, the load metrics over the global batch and the busiest
micro-batch, the experts no token chose for long (warned once, counts kept by the checkpoint), the ranks sharing a
micro-batch's balance loss."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from titan_core.hookspecs import hookimpl
from titan_core.moe.layer import MoE
from titan_core.plan import CP, TP

log = logging.getLogger("titan_core")
IDLE_WARNING_STEPS = 100  # an expert that no token chose for this many steps is reported once


def moe_layers(model_parts) -> list[MoE]:
    """Every MoE layer of this rank's model parts."""
    return [module for part in model_parts for module in part.modules() if isinstance(module, MoE)]


def global_counts(model_parts, plan, buffer: str) -> tuple[dict[int, MoE], torch.Tensor]:
    """This rank's MoE layers by block index, and (blocks, experts): the token copies each expert of each block
    received over the whole job, read from every layer's ``buffer``, which is reset. Every rank must call it."""
    args = plan.model.args
    layers = {int(name): module for part in model_parts for name, block in plan.model.blocks_of(part).items()
              for module in block.modules() if isinstance(module, MoE)}
    counts = torch.zeros(args.num_hidden_layers, args.num_experts, device=next(model_parts[0].buffers()).device)
    for layer, module in layers.items():
        counts[layer] = getattr(module, buffer).float()
        getattr(module, buffer).zero_()
    # Summed over every rank: data-, context- and tensor-parallel ranks route different tokens (tp splits a
    # mixture-of-experts layer's tokens), pipeline stages hold different blocks.
    dist.all_reduce(counts)
    return layers, counts


def share_token_groups(model_parts, mesh, plan) -> None:
    """With router_aux_loss_coef, give every MoE layer the ranks that share its tokens (tp, cp)."""
    if not plan.model.args.router_aux_loss_coef:
        return
    sharing = mesh.submesh((CP, TP))
    if sharing is None or sharing.size() == 1:
        return
    for module in moe_layers(model_parts):
        module.token_group, module.token_group_size = sharing.get_group(), sharing.size()
        module.aux_loss_scale = float(plan.degree(CP))


def update_routing_bias(model_parts, plan) -> None:
    """With router_bias_update_rate, move each expert's routing bias toward an even load."""
    rate = plan.model.args.router_bias_update_rate
    if not rate:
        return
    layers, counts = global_counts(model_parts, plan, "tokens_since_update")
    with torch.no_grad():
        for layer, module in layers.items():
            module.gate.expert_bias += rate * torch.sign(counts[layer].mean() - counts[layer])


def routing_metrics(model_parts, step, plan, idle_experts: IdleExperts, loads: MicroBatchLoads) -> dict:
    """How the routers spread the global batch's tokens over the experts since the last log."""
    args = plan.model.args
    sparse = [layer for layer in range(args.num_hidden_layers) if args.sparse(layer)]
    counts = global_counts(model_parts, plan, "tokens_per_expert")[1][sparse]
    load = counts / counts.mean(dim=1, keepdim=True).clamp(min=1)
    idle_experts.update(counts, sparse, step)
    rank_load_max, rank_load_peak = loads.busiest(model_parts)
    metrics = {"expert_load_min": load.min().item(), "expert_load_max": load.max().item(),
               "idle_experts": int((counts == 0).sum()), "expert_rank_load_max": rank_load_max,
               "expert_rank_load_peak": rank_load_peak}
    if args.router_aux_loss_coef:
        metrics["router_aux_loss"] = mean_balance_loss(model_parts, plan.degree(CP) * plan.degree(TP))
    return metrics


def rank_load(model_parts) -> float:
    """The rows this rank's experts computed per token copy it routed to them since the last call, which resets
    the counts (0 without a call): expert parallel's ranks receiving more copies than they send, the padded
    kernel's padding."""
    experts = [layer.experts for layer in moe_layers(model_parts)]
    rows, routed = _computed(experts)
    for module in experts:
        module.rows_computed = module.copies_routed = 0
    return rows / routed if routed else 0.0


def _computed(experts) -> tuple[int, int]:
    return sum(m.rows_computed for m in experts), sum(m.copies_routed for m in experts)


class MicroBatchLoads:
    """This rank's expert load (:func:`rank_load`) over each training micro-batch: the busiest one's since the last
    log is the load a step's memory peak meets (the interval's mean can hide it), the planner's
    ``--expert-load-peak``."""

    def __init__(self):
        self.peak = 0.0

    @contextlib.contextmanager
    def measuring(self, model_parts):
        """Around one micro-batch's forward and backward: keeps its load when it is the busiest yet."""
        experts = [layer.experts for layer in moe_layers(model_parts)]
        rows, routed = _computed(experts)
        yield
        more_rows, more_routed = _computed(experts)
        if more_routed > routed:  # an evaluation computes no training rows
            self.peak = max(self.peak, (more_rows - rows) / (more_routed - routed))

    def busiest(self, model_parts) -> tuple[float, float]:
        """The load since the last log and the busiest micro-batch's, each on its busiest rank (1 when every call
        computed one row per copy: the compiled kernels, which count nothing); resets both. Every rank must
        call it."""
        loads = torch.tensor([rank_load(model_parts), self.peak], device=next(model_parts[0].buffers()).device)
        self.peak = 0.0
        dist.all_reduce(loads, op=dist.ReduceOp.MAX)
        mean, peak = loads.tolist()
        return max(1.0, mean), max(1.0, peak)


def mean_balance_loss(model_parts, sharing: int) -> float:
    """The balance loss of a MoE layer and micro-batch, averaged over the forwards since the last log; every
    rank must call it. A forward's loss is split in parts over the ``sharing`` ranks holding its tokens."""
    layers = moe_layers(model_parts)
    totals = torch.zeros(2, device=next(model_parts[0].buffers()).device)
    for module in layers:
        totals += torch.stack([module.aux_loss_parts, module.aux_loss_forwards.float()])
        module.aux_loss_parts.zero_()
        module.aux_loss_forwards.zero_()
    dist.all_reduce(totals)
    parts, forwards = totals.tolist()
    return parts * sharing / forwards if forwards else 0.0


class IdleExperts:
    """Counts, per (sparse block, expert), the logged steps since a token last chose it; warns once at ``limit``.

    Its counts are the same on every rank (they come from the all-reduced loads), so a checkpoint keeps them
    as they are and a resumed run warns when the uninterrupted one would have.
    """

    def __init__(self, limit: int):
        self.limit, self.last_step = limit, 0
        self.idle: torch.Tensor | None = None  # (sparse blocks, experts): logged steps without a token
        self.warned: torch.Tensor | None = None  # the same shape: already reported

    def size(self, sparse_blocks: int, experts: int, device: torch.device) -> None:
        self.idle = torch.zeros(sparse_blocks, experts, device=device)
        self.warned = torch.zeros(sparse_blocks, experts, dtype=torch.bool, device=device)

    def update(self, counts: torch.Tensor, sparse: list[int], step: int) -> list[tuple[int, int]]:
        """Record the counts since the last logged step; returns the (block, expert) pairs newly reported."""
        if self.idle is None or self.warned is None:
            self.size(counts.shape[0], counts.shape[1], counts.device)
        idle, warned = self.idle, self.warned
        assert idle is not None and warned is not None  # sized just above
        self.idle = idle = torch.where(counts == 0, idle + (step - self.last_step), torch.zeros_like(idle))
        self.last_step = step
        new = (idle >= self.limit) & ~warned
        self.warned = warned | new
        reported = [(sparse[row], expert) for row, expert in new.nonzero().tolist()]
        for block, expert in reported:
            if dist.get_rank() == 0:
                log.warning("expert %d of block %d has received no token for %d steps: its router never chooses it",
                            expert, block, int(idle[sparse.index(block), expert]))
        return reported

    def state_dict(self) -> dict:
        return {} if self.idle is None else {"idle": self.idle, "warned": self.warned, "last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.idle, self.warned, self.last_step = state["idle"], state["warned"], state["last_step"]


class ExpertRouting:
    """The base class of a MoE model plugin's object: its routing state and the hooks that keep it.

    A model plugin deriving from it (``class MyMoePlugin(ExpertRouting)``, named by its entry point) adds its own
    ``describe_model`` and ``build_model``; the idle-expert counts are its checkpointed state, so a resumed run warns
    when the uninterrupted one would have and a sweep's next job, with another expert count, starts afresh.
    """

    def __init__(self, idle_warning_steps: int = IDLE_WARNING_STEPS):
        self.idle_experts = IdleExperts(idle_warning_steps)
        self.micro_batch_loads = MicroBatchLoads()

    @hookimpl
    def after_init(self, model_parts, mesh, plan) -> None:
        """A MoE model: size the idle-expert counts; with router_aux_loss_coef, give every MoE layer the ranks
        that share its tokens (tp, cp)."""
        args = plan.model.args
        sparse = sum(args.sparse(layer) for layer in range(args.num_hidden_layers))
        self.idle_experts.size(sparse, args.num_experts, next(model_parts[0].buffers()).device)
        share_token_groups(model_parts, mesh, plan)

    @hookimpl
    def batch_context(self, model_parts):
        """A MoE model: measures the micro-batch's expert load, for the busiest one's metric."""
        return self.micro_batch_loads.measuring(model_parts)

    @hookimpl
    def after_optimizer_step(self, model_parts, plan) -> None:
        """A MoE model: with router_bias_update_rate, move each expert's routing bias toward an even load."""
        update_routing_bias(model_parts, plan)

    @hookimpl
    def step_metrics(self, model_parts, step, plan) -> dict:
        """A MoE model: how the routers spread the global batch's tokens over the experts since the last log."""
        return routing_metrics(model_parts, step, plan, self.idle_experts, self.micro_batch_loads)

    def state_dict(self) -> dict:
        return self.idle_experts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.idle_experts.load_state_dict(state)


def init_routing_buffers(part) -> None:
    """Zero the counters and the routing bias of every MoE layer of ``part`` (from a model's ``init_buffers``)."""
    for module in part.modules():
        if isinstance(module, MoE):
            for counter in (module.tokens_per_expert, module.tokens_since_update, module.aux_loss_parts,
                            module.aux_loss_forwards):
                counter.zero_()
            if module.gate.expert_bias is not None:
                module.gate.expert_bias.zero_()
