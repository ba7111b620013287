"""The adapters themselves: which weights get them, how they are added to a built model, split under tensor
parallel, drawn, and found again in the model's parts.

A chosen ``nn.Linear`` gets two children, ``lora_A`` (rank x in) and ``lora_B`` (out x rank), and a forward hook
adding ``scale * lora_B(lora_A(dropout(x)))`` to its output. A mixture of experts' stacked linears
(``ExpertsLayout.linears``, each (experts, out, in)) get a pair per expert, held as stacks ``<name>_lora_A``
(experts, rank, in) and ``<name>_lora_B`` (experts, out, rank) beside the weight, so expert parallel and FSDP split
them by expert with it; the experts' forward then reads ``weight + scale * B @ A`` for each (one transient stack the
size of the weight, as PEFT's ``target_parameters`` does).
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from titan_core import ConfigError, ModelDescription, attribute, canonical_name, keep_precision, lacks, local_box

FIELD = "plugins.lora"
ROLES = ("attention", "mlp")  # the description's block_regions, in their order
EXPERTS = "experts"  # the stacked linears of a mixture of experts' experts


def target_paths(description: ModelDescription, targets) -> tuple[str, ...]:
    """Block-relative paths of the linears ``targets`` names (roles or paths)."""
    targets = [target for target in targets if target != EXPERTS]
    if not targets:
        return ()
    layout = description.tensor_parallel
    if layout is None:
        raise ConfigError(f"{FIELD}.targets", lacks(description, "tensor_parallel", "lora (a block's linears)"),
                          "use a model whose description lists its block linears")
    linears = (*layout.block_colwise, *layout.block_rowwise)
    chosen = []
    for target in targets:
        if target in ROLES:
            region = layout.block_regions[ROLES.index(target)]
            chosen += [path for path in linears if path.startswith(f"{region}.")]
        elif target in linears:
            chosen.append(target)
        else:
            raise ConfigError(f"{FIELD}.targets", f"unknown target '{target}'",
                              f"use {', '.join((*ROLES, EXPERTS))} or some of {', '.join(linears)}")
    return tuple(dict.fromkeys(chosen))


def expert_stacks(description: ModelDescription, targets) -> tuple[str, ...]:
    """The experts' stacked linears ``targets`` asks for: all of them with ``experts``, else none."""
    if EXPERTS not in targets:
        return ()
    if description.experts is None:
        raise ConfigError(f"{FIELD}.targets", lacks(description, "experts", "lora on experts"),
                          "adapt attention and mlp")
    if not description.experts.linears:
        raise ConfigError(f"{FIELD}.targets", f"model '{description.family}' names no stacked linears of its experts "
                          "(ExpertsLayout.linears is empty), which lora on experts needs", "adapt attention and mlp")
    return description.experts.linears


def chosen_experts(model: nn.Module, description: ModelDescription) -> dict[str, nn.Module]:
    """Every block's experts module, by name from the root (dense blocks have none)."""
    layout = description.experts
    if layout is None:  # a dense model
        return {}
    return {f"{description.blocks}.{index}.{layout.module}": experts
            for index, block in description.blocks_of(model).items()
            if (experts := description.experts_of(block)) is not None}


def chosen_linears(model: nn.Module, description: ModelDescription, paths) -> dict[str, nn.Linear]:
    """The linears to adapt, by name from the root (a block without one, or a stage without the block, has none)."""
    return {f"{description.blocks}.{index}.{path}": linear
            for index, block in description.blocks_of(model).items()
            for path, linear in block_linears(block, paths).items()}


def block_linears(block: nn.Module, paths) -> dict[str, nn.Linear]:
    """The linears to adapt of one block, by path within it."""
    return {path: linear for path in paths if isinstance(linear := optional_attribute(block, path), nn.Linear)}


def optional_attribute(root: nn.Module, path: str):
    try:
        return attribute(root, path)
    except AttributeError:  # a sparse block of a mixture of experts has no dense MLP
        return None


def frozen_matmul_weights(model: nn.Module, description: ModelDescription) -> list[torch.Tensor]:
    """What autocast would round for its matmuls anyway, and a bfloat16 base holds so: every linear's weights and
    the experts' stacked linears (embeddings and norms keep their float32)."""
    weights = [p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    if description.experts is not None and description.blocks is not None:
        weights += [experts.get_parameter(stack) for experts in chosen_experts(model, description).values()
                    for stack in description.experts.linears]
    return weights


def scale(options) -> float:
    return options.alpha / (math.sqrt(options.rank) if options.rslora else options.rank)


def add_adapter(linear: nn.Linear, rank: int, scaling: float, dropout: float) -> None:
    device = linear.weight.device
    linear.lora_A = nn.Linear(linear.in_features, rank, bias=False, device=device)
    linear.lora_B = nn.Linear(rank, linear.out_features, bias=False, device=device)
    linear.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    linear.lora_scaling = scaling
    linear.register_forward_hook(add_low_rank_update)
    keep_precision(linear)  # the adapter reads its input and adds to its output, in the stream's precision


def add_low_rank_update(linear: nn.Linear, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The adapted linear's output: the frozen base's plus the scaled low-rank update."""
    return output + linear.lora_B(linear.lora_A(linear.lora_dropout(inputs[0]))) * linear.lora_scaling


def split_like_base(linear: nn.Linear) -> None:
    """Split the adapter's factor that shares a split dimension with the linear's weight, replicate the other."""
    base = linear.weight
    if not isinstance(base, DTensor):
        return
    for factor, dim in ((linear.lora_B, 0), (linear.lora_A, 1)):
        placements = [p if isinstance(p, Shard) and p.dim == dim else Replicate() for p in base.placements]
        factor.weight = nn.Parameter(distribute_tensor(factor.weight, base.device_mesh, placements, src_data_rank=None))


def add_expert_adapters(experts: nn.Module, stacks: tuple[str, ...], rank: int, scaling: float) -> None:
    """Stacks of per-expert factors beside each stacked weight, read by the experts' forward as one adapted weight."""
    for stack in stacks:
        count, out, inputs = getattr(experts, stack).shape
        device = getattr(experts, stack).device
        experts.register_parameter(f"{stack}_lora_A", nn.Parameter(torch.empty(count, rank, inputs, device=device)))
        experts.register_parameter(f"{stack}_lora_B", nn.Parameter(torch.empty(count, out, rank, device=device)))
    experts.lora_stacks, experts.lora_scaling = stacks, scaling
    # A class is hashable: mypy checks it against Hashable by its instances' __hash__ (python/mypy#11470).
    experts.__class__ = _adapted_experts_class(type(experts))  # type: ignore[arg-type]


@functools.cache
def _adapted_experts_class(cls: type) -> type:
    # A subclass, not a wrapper module: parameter names stay the model's (checkpoints, the HF import of the base),
    # and expert parallel mixes its own class in over this one.
    return type(f"Adapted{cls.__name__}", (AdaptedExperts, cls), {})


class AdaptedExperts:
    """Mixed into the class of an experts module: the same call, with each adapted stack read as its sum."""

    lora_stacks: tuple[str, ...]
    lora_scaling: float
    _parameters: dict[str, torch.Tensor]  # those of the nn.Module it is mixed into

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        with adapted_stacks(self):
            # A mixin: forward is that of the experts class it is mixed into (made by _adapted_experts_class).
            return super().forward(tokens, counts)  # type: ignore[misc]


@contextlib.contextmanager
def adapted_stacks(experts: AdaptedExperts):
    """Each adapted stack seen as ``weight + scale * B @ A`` during the call (whatever tensors the module holds
    now: expert parallel's local slices, FSDP's gathered ones); gradients reach the factors only."""
    held = experts._parameters
    saved = {stack: held[stack] for stack in experts.lora_stacks}
    for stack, weight in saved.items():
        update = torch.bmm(held[f"{stack}_lora_B"], held[f"{stack}_lora_A"]) * experts.lora_scaling
        held[stack] = weight + update.to(weight.dtype)
    try:
        yield
    finally:
        held.update(saved)


def adapters(model_parts) -> dict[str, nn.Linear]:
    """The adapted linears of this rank's parts, by canonical name."""
    return {canonical_name(name): module for part in model_parts for name, module in part.named_modules()
            if isinstance(getattr(module, "lora_A", None), nn.Linear)}


def expert_adapters(model_parts) -> dict[str, AdaptedExperts]:
    """The adapted experts modules of this rank's parts, by canonical name."""
    return {canonical_name(name): module for part in model_parts for name, module in part.named_modules()
            if isinstance(module, AdaptedExperts)}


@torch.no_grad()
def initialize(factors: dict[str, tuple[torch.Tensor, torch.Tensor]], seed: int) -> None:
    """Each ``name: (A, B)``: A drawn as PEFT draws it (Kaiming-uniform over its input features; a stack as PEFT's
    (experts x rank, in) matrix), from a generator of the adapter's own (so every plan draws alike, each rank
    copying its box), B zero."""
    for name, (lora_a, lora_b) in factors.items():
        weight = torch.empty(lora_a.shape[:-1].numel(), lora_a.shape[-1])
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
        copy_box(lora_a, weight.view(lora_a.shape))
        local_box(lora_b)[0].zero_()


def every_factor(model_parts) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's adapters as ``name: (A, B)``: each linear's, and each stack's of each experts module."""
    factors = {name: (linear.lora_A.weight, linear.lora_B.weight) for name, linear in adapters(model_parts).items()}
    for name, experts in expert_adapters(model_parts).items():
        for stack in experts.lora_stacks:
            factors[f"{name}.{stack}"] = (getattr(experts, f"{stack}_lora_A"), getattr(experts, f"{stack}_lora_B"))
    return factors


def copy_box(param: torch.Tensor, full: torch.Tensor) -> None:
    local, offset = local_box(param)
    local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))].to(local.dtype))
