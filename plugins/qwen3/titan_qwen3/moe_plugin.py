"""The Qwen3-MoE model plugin: Qwen3's options plus the experts', its description and its HF names."""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import torch
import torch.distributed as dist

from titan_core import (CORE_ATTENTION, CP, TP, ConfigError, ExpertsLayout, HFAdapter, ModelDescription, ParamInit,
                        hookimpl, read_options)
from titan_qwen3.model import rope_table
from titan_qwen3.moe import MoE, Qwen3Moe, Qwen3MoeArgs
from titan_qwen3 import plugin as qwen3

log = logging.getLogger("titan_core")
FAMILY = "qwen3_moe"
IDLE_WARNING_STEPS = 100  # an expert that no token chose for this many steps is reported once
OPTIONS = tuple(f.name for f in dataclasses.fields(Qwen3MoeArgs) if f.name != "seq_len")
DEEPSEEK_ROUTING = ("score_function", "num_shared_experts", "router_bias_update_rate", "n_group", "topk_group",
                    "routed_scaling_factor")  # not in HF's Qwen3-MoE
SCORE_FUNCTIONS = ("softmax", "sigmoid")


def qwen3_moe_args(model_config, vocab_size: int, seq_len: int) -> Qwen3MoeArgs:
    options = read_options(model_config, OPTIONS, "Qwen3-MoE", vocab_size)
    options["mlp_only_layers"] = tuple(options.get("mlp_only_layers") or ())
    args = Qwen3MoeArgs(**options, seq_len=seq_len)
    qwen3.check_attention_shape(args)
    if not 1 <= args.num_experts_per_tok <= args.num_experts:
        raise ConfigError("model.num_experts_per_tok", f"{args.num_experts_per_tok} experts per token out of "
                          f"{args.num_experts}", f"choose 1 to {args.num_experts}")
    if args.decoder_sparse_step < 1:
        raise ConfigError("model.decoder_sparse_step", f"{args.decoder_sparse_step} is not a positive integer",
                          "use 1 for experts in every block, n for every n-th")
    if args.score_function not in SCORE_FUNCTIONS:
        raise ConfigError("model.score_function", f"unknown router score '{args.score_function}'",
                          f"use one of {', '.join(SCORE_FUNCTIONS)}")
    for field in ("num_shared_experts", "router_bias_update_rate", "router_aux_loss_coef"):
        if getattr(args, field) < 0:
            raise ConfigError(f"model.{field}", f"{getattr(args, field)} is negative", "use 0 (off) or more")
    if args.n_group < 1 or args.num_experts % args.n_group:
        raise ConfigError("model.n_group", f"{args.n_group} groups do not divide {args.num_experts} experts",
                          "use 1 (no groups) or a divisor of model.num_experts")
    per_group = args.num_experts // args.n_group
    if args.n_group > 1 and per_group < 2:
        raise ConfigError("model.n_group", f"groups of {per_group} expert: a group is ranked by its two best",
                          "use groups of two experts or more")
    if not 1 <= args.topk_group <= args.n_group or args.num_experts_per_tok > args.topk_group * per_group:
        raise ConfigError("model.topk_group", f"{args.topk_group} of {args.n_group} groups of {per_group} experts "
                          f"cannot hold {args.num_experts_per_tok} chosen experts",
                          f"choose 1 to {args.n_group} groups holding at least model.num_experts_per_tok experts")
    if not args.routed_scaling_factor > 0:
        raise ConfigError("model.routed_scaling_factor", f"{args.routed_scaling_factor} is not positive",
                          "use 1.0 (off) or DeepSeek-V3's 2.5")
    return args


def moe_param_init(args: Qwen3MoeArgs):
    dense = qwen3.param_init(args)

    def rule(name: str) -> ParamInit:
        if name.endswith("experts.down_proj"):  # residual writers, like the dense down_proj
            return ParamInit.normal(0.02 / math.sqrt(2 * args.num_hidden_layers))
        return dense(name)
    return rule


def flops_per_token(args: Qwen3MoeArgs):
    """Qwen3's, counting the router and the experts a token meets in sparse blocks (chosen and shared)."""
    hidden = args.hidden_size
    sparse = sum(args.sparse(i) for i in range(args.num_hidden_layers))
    met = args.num_experts_per_tok + args.num_shared_experts
    experts = sparse * (hidden * args.num_experts + met * 3 * hidden * args.moe_intermediate_size)
    dense = (args.num_hidden_layers - sparse) * 3 * hidden * args.intermediate_size
    return qwen3.flops_per_token(args, experts + dense)


def hf_config(args: Qwen3MoeArgs) -> dict:
    options = tuple(name for name in OPTIONS if name not in DEEPSEEK_ROUTING)
    return {**qwen3.hf_config(args, options, "Qwen3MoeForCausalLM", "qwen3_moe"),
            "mlp_only_layers": list(args.mlp_only_layers)}


# Released checkpoints (and transformers before 5) store each expert's projections apart:
# model.layers.L.mlp.experts.E.gate_proj.weight (moe_intermediate x hidden), up_proj, down_proj.
EXPERT_PIECES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


def expert_pieces(args: Qwen3MoeArgs):
    def pieces(name: str) -> list[list[str]] | None:
        block, _, projection = name.rpartition(".mlp.experts.")
        if not block or projection not in EXPERT_PIECES:
            return None
        return [[f"model.{block}.mlp.experts.{e}.{part}.weight" for part in EXPERT_PIECES[projection]]
                for e in range(args.num_experts)]
    return pieces


def from_hf(name: str) -> str | None:
    return None if PER_EXPERT.search(name) else qwen3.from_hf(name)


def options_from_hf(config: dict) -> dict:
    """``model.*`` options reproducing a Hugging Face Qwen3-MoE config (older files say num_local_experts)."""
    options = qwen3.options_from_hf(config, OPTIONS, FAMILY)
    if "num_experts" not in config and "num_local_experts" in config:
        options["num_experts"] = config["num_local_experts"]
    options["norm_topk_prob"] = config.get("norm_topk_prob", False)  # transformers' default when unset
    # transformers adds the load-balancing loss only with output_router_logits: training's choice, not the file's.
    options.pop("router_aux_loss_coef", None)
    return options


def describe(args: Qwen3MoeArgs) -> ModelDescription:
    untied = not args.tie_word_embeddings
    return ModelDescription(
        family=FAMILY, args=args, n_layers=args.num_hidden_layers,
        param_init=moe_param_init(args), flops_per_token=flops_per_token(args),
        blocks="layers",
        inputs=("embed_tokens",) if untied else None, outputs=("norm", "lm_head") if untied else None,
        # Qwen3's (dense blocks); tensor parallel splits the tokens of the sparse blocks' mlp.
        tensor_parallel=qwen3.tensor_parallel_layout(args) if untied else None,
        attention=CORE_ATTENTION, position_buffers=("rope",),
        init_buffers=lambda part: init_buffers(part, args),
        float8_skip=("lm_head", "mlp.gate"), logits="lm_head" if untied else None,
        experts=ExpertsLayout(module="mlp.experts", count=args.num_experts, linears=("gate_up_proj", "down_proj")),
        # DeepSeek-V3's routing options compute what transformers' Qwen3-MoE does not: no HF folder claims it.
        hf=HFAdapter(config=hf_config(args), to_hf=qwen3.to_hf, from_hf=from_hf, options_from_hf=options_from_hf,
                     tied={"lm_head.weight": "embed_tokens.weight"} if untied else {},
                     pieces=expert_pieces(args)) if args.qwen3_routing else None,
    )


def init_buffers(part, args: Qwen3MoeArgs) -> None:
    part.rope.copy_(rope_table(args))
    for module in part.modules():
        if isinstance(module, MoE):
            for counter in (module.tokens_per_expert, module.tokens_since_update, module.aux_loss_parts,
                            module.aux_loss_forwards):
                counter.zero_()
            if module.gate.expert_bias is not None:
                module.gate.expert_bias.zero_()


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
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, MoE) and sharing is not None and sharing.size() > 1:
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


def routing_metrics(model_parts, step, plan, idle_experts: IdleExperts) -> dict:
    """How the routers spread the global batch's tokens over the experts since the last log."""
    args = plan.model.args
    sparse = [layer for layer in range(args.num_hidden_layers) if args.sparse(layer)]
    counts = global_counts(model_parts, plan, "tokens_per_expert")[1][sparse]
    load = counts / counts.mean(dim=1, keepdim=True).clamp(min=1)
    idle_experts.update(counts, sparse, step)
    metrics = {"expert_load_min": load.min().item(), "expert_load_max": load.max().item(),
               "idle_experts": int((counts == 0).sum())}
    if args.router_aux_loss_coef:
        metrics["router_aux_loss"] = mean_balance_loss(model_parts, plan.degree(CP) * plan.degree(TP))
    return metrics


def mean_balance_loss(model_parts, sharing: int) -> float:
    """The balance loss of a MoE layer and micro-batch, averaged over the forwards since the last log; every
    rank must call it. A forward's loss is split in parts over the ``sharing`` ranks holding its tokens."""
    layers = [module for part in model_parts for module in part.modules() if isinstance(module, MoE)]
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
        if self.idle is None:
            self.size(*counts.shape, counts.device)
        self.idle = torch.where(counts == 0, self.idle + (step - self.last_step), torch.zeros_like(self.idle))
        self.last_step = step
        new = (self.idle >= self.limit) & ~self.warned
        self.warned |= new
        reported = [(sparse[row], expert) for row, expert in new.nonzero().tolist()]
        for block, expert in reported:
            if dist.get_rank() == 0:
                log.warning("expert %d of block %d has received no token for %d steps: its router never chooses it",
                            expert, block, int(self.idle[sparse.index(block), expert]))
        return reported

    def state_dict(self) -> dict:
        return {} if self.idle is None else {"idle": self.idle, "warned": self.warned, "last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        self.idle, self.warned, self.last_step = state["idle"], state["warned"], state["last_step"]


class Qwen3MoePlugin:
    """The Qwen3-MoE model plugin of one run (the entry point names the class): its own idle-expert counts,
    which a checkpoint keeps, so that a sweep's next job, with another expert count, starts afresh."""

    def __init__(self):
        self.idle_experts = IdleExperts(IDLE_WARNING_STEPS)

    @hookimpl
    def describe_model(self, model_config, vocab_size, seq_len):
        """Qwen3-MoE: check the options; describe blocks, RoPE positions, the logits layer and HF names."""
        return describe(qwen3_moe_args(model_config, vocab_size, seq_len))

    @hookimpl
    def hf_model_options(self, hf_config):
        """Qwen3-MoE: the options of a Qwen3MoeForCausalLM config.json."""
        return options_from_hf(hf_config) if hf_config.get("model_type") == "qwen3_moe" else None

    @hookimpl
    def build_model(self, description):
        """Qwen3-MoE: the model of the described options."""
        return Qwen3Moe(description.args)

    @hookimpl
    def after_init(self, model_parts, mesh, plan):
        """Qwen3-MoE: size the idle-expert counts; with router_aux_loss_coef, give every MoE layer the ranks that
        share its tokens (tp, cp)."""
        args = plan.model.args
        sparse = sum(args.sparse(layer) for layer in range(args.num_hidden_layers))
        self.idle_experts.size(sparse, args.num_experts, next(model_parts[0].buffers()).device)
        share_token_groups(model_parts, mesh, plan)

    @hookimpl
    def after_optimizer_step(self, model_parts, plan):
        """Qwen3-MoE: with router_bias_update_rate, move each expert's routing bias toward an even load."""
        update_routing_bias(model_parts, plan)

    @hookimpl
    def step_metrics(self, model_parts, step, plan):
        """Qwen3-MoE: how the routers spread the global batch's tokens over the experts since the last log."""
        return routing_metrics(model_parts, step, plan, self.idle_experts)

    def state_dict(self) -> dict:
        return self.idle_experts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.idle_experts.load_state_dict(state)
