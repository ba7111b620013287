"""A mixture-of-experts feed-forward sub-layer any model plugin can use, with the routing options it reads.

Each token's router scores (softmax over the experts, or sigmoid: each expert on its own; in fp32) choose its
``num_experts_per_tok`` experts; with ``norm_topk_prob`` the chosen scores are renormalized to sum to one.
Every token is computed by every expert it chose (dropless: no capacity, nothing dropped). The tokens are
sorted by expert and the experts' SwiGLU runs as one grouped matmul over all of them, never a Python loop.

DeepSeek-V3's routing is available as options: ``num_shared_experts`` (a SwiGLU every token goes through
besides its chosen experts), ``router_bias_update_rate`` (balancing without an auxiliary loss: a per-expert
bias, added to the scores only to choose the experts, moves after every optimizer step by that rate toward the
experts that received fewer tokens than the mean; :class:`ExpertRouting` does it over the global batch),
``n_group`` / ``topk_group`` (group-limited routing: the experts fall into ``n_group`` groups, each ranked by
the sum of its two best choice scores, and a token chooses only among the best ``topk_group`` groups'
experts, which bounds the nodes its copies travel to) and ``routed_scaling_factor`` (the chosen experts'
weights multiplied by it, after any renormalization).

gpt-oss's experts are available too: ``router_bias`` (the router's logits have a learned bias),
``expert_projection_bias`` (each expert's projections add a bias) and ``expert_activation=clamped_swiglu`` (the
gate clamped above and the up projection on both sides at ``swiglu_limit``, then ``(up + 1) * gate *
sigmoid(swiglu_alpha * gate)``). Its routing, a softmax over the chosen experts' logits, is ``softmax`` with
``norm_topk_prob``: renormalizing the chosen experts' softmax scores gives the same weights.

``router_aux_loss_coef`` adds the classic load-balancing loss instead (Switch Transformer, DeepSeek's
normalization): per MoE layer and micro-batch of T tokens, E / (k T^2) * sum_i c_i S_i, where c_i counts
the copies expert i received and S_i sums its scores over the tokens (1 when the load and the scores
are even), averaged over the MoE layers and weighted by the coefficient. It enters the gradient through
``add_loss``; the logged loss stays the logits' cross entropy. When tensor or context parallel split a
micro-batch's tokens over ranks, the counts are summed over those ranks first (``token_group``), so each
rank adds its exact share of the whole micro-batch's loss.

Names follow transformers' MoE modules (``gate.weight`` the router, ``experts.gate_up_proj`` (experts,
2 x moe_intermediate_size, hidden), ``experts.down_proj`` (experts, hidden, moe_intermediate_size),
``shared_experts.{gate,up,down}_proj``), so a checkpoint is exported and read back by renaming only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from titan_core.errors import ConfigError
from titan_core.feed_forward import GatedMLP
from titan_core.objective import add_loss

SCORE_FUNCTIONS = ("softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass
class MoeOptions:
    """The experts' and the router's options (``model.*``, transformers' names). A model's options dataclass
    derives from it and also has ``hidden_size`` and ``num_hidden_layers``; its ``sparse(layer)`` says which
    blocks have experts."""

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True  # transformers' Qwen3-MoE default is false; the released configs set true
    score_function: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    num_shared_experts: int = 0  # DeepSeek-V3: 1, of moe_intermediate_size each
    router_bias_update_rate: float = 0.0  # DeepSeek-V3: 1e-3; 0 leaves the choice to the scores alone
    router_aux_loss_coef: float = 0.0  # load-balancing loss weight (transformers' name); 0: none
    n_group: int = 1  # DeepSeek-V3: 8 groups of experts, a token choosing among the best topk_group of them
    topk_group: int = 1  # DeepSeek-V3: 4
    routed_scaling_factor: float = 1.0  # DeepSeek-V3: 2.5, on the chosen experts' weights
    router_bias: bool = False  # gpt-oss: a bias on the router's logits
    expert_projection_bias: bool = False  # gpt-oss: a bias on each expert's projections
    expert_activation: str = "silu"  # or "clamped_swiglu" (gpt-oss)
    swiglu_alpha: float = 1.702  # clamped_swiglu: the sigmoid's slope
    swiglu_limit: float = 7.0  # clamped_swiglu: where the gate and up projections are clamped

    if TYPE_CHECKING:  # fields of the model's options dataclass that derives from this one
        @property
        def hidden_size(self) -> int: ...

        @property
        def num_hidden_layers(self) -> int: ...

    def sparse(self, layer: int) -> bool:
        """Whether block ``layer`` has experts (every block unless the model says otherwise)."""
        return True


def check_moe_options(options: MoeOptions) -> None:
    """Refuse routing options that cannot work, in one line naming the field."""
    for field in ("num_experts", "moe_intermediate_size"):  # 0: experts of no width, which torch runs without a word
        value = getattr(options, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.{field}", f"{value!r} is not a positive number",
                              f"set model.{field} to a positive integer")
    if not 1 <= options.num_experts_per_tok <= options.num_experts:
        raise ConfigError("model.num_experts_per_tok", f"{options.num_experts_per_tok} experts per token out of "
                          f"{options.num_experts}", f"choose 1 to {options.num_experts}")
    if options.score_function not in SCORE_FUNCTIONS:
        raise ConfigError("model.score_function", f"unknown router score '{options.score_function}'",
                          f"use one of {', '.join(SCORE_FUNCTIONS)}")
    for field in ("num_shared_experts", "router_bias_update_rate", "router_aux_loss_coef"):
        if getattr(options, field) < 0:
            raise ConfigError(f"model.{field}", f"{getattr(options, field)} is negative", "use 0 (off) or more")
    if options.n_group < 1 or options.num_experts % options.n_group:
        raise ConfigError("model.n_group", f"{options.n_group} groups do not divide {options.num_experts} experts",
                          "use 1 (no groups) or a divisor of model.num_experts")
    per_group = options.num_experts // options.n_group
    if options.n_group > 1 and per_group < 2:
        raise ConfigError("model.n_group", f"groups of {per_group} expert: a group is ranked by its two best",
                          "use groups of two experts or more")
    if not 1 <= options.topk_group <= options.n_group or options.num_experts_per_tok > options.topk_group * per_group:
        raise ConfigError("model.topk_group", f"{options.topk_group} of {options.n_group} groups of {per_group} "
                          f"experts cannot hold {options.num_experts_per_tok} chosen experts",
                          f"choose 1 to {options.n_group} groups holding at least model.num_experts_per_tok experts")
    if options.expert_activation not in EXPERT_ACTIVATIONS:
        raise ConfigError("model.expert_activation", f"unknown expert activation '{options.expert_activation}'",
                          f"use one of {', '.join(EXPERT_ACTIVATIONS)}")
    if options.expert_activation == "clamped_swiglu" and not options.swiglu_limit > 0:
        raise ConfigError("model.swiglu_limit", f"{options.swiglu_limit} clamps every gate below zero",
                          "use a positive limit (gpt-oss: 7.0)")
    if not options.routed_scaling_factor > 0:
        raise ConfigError("model.routed_scaling_factor", f"{options.routed_scaling_factor} is not positive",
                          "use 1.0 (off) or DeepSeek-V3's 2.5")


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): a dense feed-forward, and the shared experts of a MoE layer."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    @staticmethod
    def described_at(module: str) -> GatedMLP:
        """The :class:`GatedMLP` of blocks whose feed-forward at ``module`` is this SwiGLU."""
        return GatedMLP(module, gate="gate_proj", up="up_proj", down="down_proj")
class TopKRouter(nn.Module):
    def __init__(self, args: MoeOptions):
        super().__init__()
        self.top_k, self.normalize = args.num_experts_per_tok, args.norm_topk_prob
        self.score_function = args.score_function
        self.groups, self.chosen_groups, self.scale = args.n_group, args.topk_group, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.bias = nn.Parameter(torch.empty(args.num_experts)) if args.router_bias else None
        # Saved with the weights, so that a resumed run keeps the balance it learned; sigmoid routers keep one even
        # when it does not move (a released DeepSeek-V3's, fine-tuned with the rate at 0).
        biased = args.router_bias_update_rate or args.score_function == "sigmoid"
        self.register_buffer("expert_bias", torch.zeros(args.num_experts) if biased else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, hidden) -> the chosen experts' weights and indices, each (tokens, top_k), and every
        expert's score (tokens, experts)."""
        logits = F.linear(x, self.weight, self.bias).float()
        scores = logits.softmax(dim=-1) if self.score_function == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.groups > 1:
            choice = self.within_best_groups(choice)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.scale).type_as(x), experts, scores

    def within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """The choice scores with every expert outside the token's ``topk_group`` best groups at -inf."""
        grouped = choice.unflatten(-1, (self.groups, -1))
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.chosen_groups, dim=-1).indices
        kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(-1, best, True)
        return grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)


class GroupedExperts(nn.Module):
    """Every expert's gated feed-forward, applied to tokens already sorted by expert (``counts`` of each)."""

    def __init__(self, args: MoeOptions):
        super().__init__()
        experts, hidden, inner = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        biased = args.expert_projection_bias
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inner)) if biased else None
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden)) if biased else None
        self.clamped = args.expert_activation == "clamped_swiglu"
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit
        # Copies this rank routed to the coming call, when another module moved them here (expert parallel sets
        # it; None: the call's own tokens); the rows the calls computed and the copies routed to them since the
        # metrics last read them (ExpertRouting's expert_rank_load_max: what the planner's --expert-load takes).
        self.routed: int | None = None
        self.rows_computed = self.copies_routed = 0

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        grouped = tokens.is_cuda and tokens.dtype == torch.bfloat16
        if torch.compiler.is_compiling():  # one row per copy, and no host state inside a graph
            return self._grouped(tokens, counts) if grouped else self._gathered(tokens, counts)
        if grouped:
            out, rows = self._grouped(tokens, counts), len(tokens)
        else:  # every expert's batch padded to the busiest one's (read once: a host sync)
            most = int(counts.max()) if len(tokens) else 0
            out, rows = self._padded(tokens, counts, most), len(counts) * most
        if torch.is_grad_enabled():  # training's load (an evaluation's is not what the planner plans)
            self.rows_computed += rows
            self.copies_routed += len(tokens) if self.routed is None else self.routed
        return out

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if not self.clamped:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _grouped(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # torch._grouped_mm: one kernel over variable-size groups (bf16; fp32 is refused on CPU in torch 2.13).
        ends = counts.cumsum(0, dtype=torch.int32)
        gate_up = torch._grouped_mm(tokens, self.gate_up_proj.transpose(-2, -1), offs=ends)
        if self.gate_up_proj_bias is None:
            return torch._grouped_mm(self.activate(gate_up), self.down_proj.transpose(-2, -1), offs=ends)
        experts = torch.repeat_interleave(torch.arange(len(counts), device=tokens.device), counts,
                                          output_size=len(tokens))
        out = torch._grouped_mm(self.activate(gate_up + self.gate_up_proj_bias[experts]),
                                self.down_proj.transpose(-2, -1), offs=ends)
        assert self.down_proj_bias is not None, "the projections' biases exist together"
        return out + self.down_proj_bias[experts]

    def _padded(self, tokens: torch.Tensor, counts: torch.Tensor, most: int) -> torch.Tensor:
        # Each expert's tokens in one row of an (experts, most tokens, hidden) batch, then two batched matmuls.
        experts = torch.repeat_interleave(torch.arange(len(counts), device=tokens.device), counts)
        starts = counts.cumsum(0) - counts
        slots = torch.arange(len(tokens), device=tokens.device) - starts[experts]
        # Filled in place: an out-of-place fill would keep the zeros alive beside the batch while the experts run.
        padded = tokens.new_zeros(len(counts), most, tokens.shape[-1]).index_put_((experts, slots), tokens)
        return self.batched(padded)[experts, slots]

    def batched(self, padded: torch.Tensor) -> torch.Tensor:
        """(experts, rows, hidden) -> (experts, rows, hidden): each expert's feed-forward on its own row."""
        # Weights first: their gradients then come out of the matmul in their own layout and become the .grad
        # as they are, where a transposed weight's gradient needed a copy as large as every expert's weights.
        gate_up = torch.bmm(self.gate_up_proj, padded.mT).mT
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[:, None]
        out = torch.bmm(self.down_proj, self.activate(gate_up).mT).mT
        return out if self.down_proj_bias is None else out + self.down_proj_bias[:, None]

    def _gathered(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Static shapes for the compiler (the padded batch's size depends on the routing, which inductor
        # cannot lower): each token copy multiplies its own expert's gathered weights. Memory grows with
        # tokens x expert size, so only compiled fp32 or CPU runs take this path.
        experts = torch.repeat_interleave(torch.arange(len(counts), device=tokens.device), counts,
                                          output_size=len(tokens))
        gate_up = torch.bmm(self.gate_up_proj[experts], tokens[:, :, None]).squeeze(-1)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[experts]
        out = torch.bmm(self.down_proj[experts], self.activate(gate_up)[:, :, None]).squeeze(-1)
        return out if self.down_proj_bias is None else out + self.down_proj_bias[experts]


class MoE(nn.Module):
    """Route, sort the token copies by expert, run the experts, weight and sum each token's copies. ``args``: the
    model's options (a :class:`MoeOptions` with ``hidden_size`` and ``num_hidden_layers``)."""

    def __init__(self, args: MoeOptions):
        super().__init__()
        self.num_experts = args.num_experts
        self.gate = TopKRouter(args)
        self.experts = GroupedExperts(args)
        self.shared_experts = (SwiGLU(args.hidden_size, args.num_shared_experts * args.moe_intermediate_size)
                               if args.num_shared_experts else None)
        # Token copies each expert received since the metrics last read it, and since the routing bias was
        # last updated (recomputation counts twice, which neither the logged load ratios nor the sign of
        # each expert's distance to the mean load see).
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("tokens_since_update", torch.zeros(args.num_experts, dtype=torch.long), persistent=False)
        # The balance loss's share of this layer, and the sum of this rank's parts of it since the metrics
        # last read it, with the forwards they came from.
        self.aux_loss_coef = args.router_aux_loss_coef / sum(map(args.sparse, range(args.num_hidden_layers)))
        self.register_buffer("aux_loss_parts", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss_forwards", torch.zeros((), dtype=torch.long), persistent=False)
        # Set by the model plugin when tensor or context parallel split a micro-batch's tokens over ranks:
        # their group and its size, and the factor that undoes the sharder's averaging over context-parallel
        # ranks (tensor-parallel ones are summed).
        self.token_group, self.token_group_size, self.aux_loss_scale = None, 1, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, scores = self.gate(x)
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        if torch.is_grad_enabled():  # training: an evaluation's tokens neither show in the routing metrics nor steer
            with torch.no_grad():
                self.tokens_per_expert += counts
                self.tokens_since_update += counts
        token = order // experts.shape[1]  # which token each sorted copy belongs to
        out = self.experts(x[token], counts) * weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add(0, token, out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.aux_loss_coef and torch.is_grad_enabled():
            out = add_loss(out, self.balance_loss(scores, counts) * (self.aux_loss_coef * self.aux_loss_scale))
        return out.reshape(shape)

    def balance_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's part of the layer's balance loss over the whole micro-batch (the parts of the ranks
        sharing it sum to the loss)."""
        counts, tokens = counts.float(), scores.shape[0] * self.token_group_size
        if self.token_group is not None:
            counts = funcol.all_reduce(counts, "sum", self.token_group)
        part = (counts * scores.sum(0)).sum() * (self.num_experts / (self.gate.top_k * tokens ** 2))
        with torch.no_grad():
            self.aux_loss_parts += part
            self.aux_loss_forwards += 1
        return part
