"""LoRA: low-rank adapters on the linears a user names by role, every other weight frozen.

``convert_modules`` gives each chosen ``nn.Linear`` of every block two children, ``lora_A`` (rank x in) and
``lora_B`` (out x rank), and a forward hook adding ``scale * lora_B(lora_A(dropout(x)))`` to its output. The base
weights keep their names, so the Hugging Face import and export of the base work unchanged, and the parallelism
plugins shard the adapters with their block. Every other parameter is frozen: the optimizer keeps state only for
the adapters. ``after_init`` draws ``lora_A`` as PEFT does (Kaiming-uniform) from one generator per adapter, so
every plan starts alike, and zeroes ``lora_B`` (training starts at the base model), or reads a PEFT adapter.
``on_train_end`` writes the adapters in PEFT's format. ``base_dtype=bfloat16`` holds the frozen linears in
bfloat16: what autocast rounds them to for every matmul anyway, in half the bytes.

Under tensor parallel (stage 210, right after tp's 200) each adapter is split like its linear: a linear split by
output features has its ``lora_B`` split the same way, one split by input features its ``lora_A``; the other
factor is whole on every rank. The update then has the base output's placement (its slice of the features, or
partial sums that the base's own reduction adds up), so tensor parallel adds no collective of its own for it.

The roles come from the model's description: its tensor-parallel layout lists each block's linears, and its
first region is attention, its second the MLP. A mixture of experts' experts are grouped tensors, not linears:
not adapted (yet), and refused by name.
"""

from __future__ import annotations

import json
import logging
import math
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from titan_core import CP, DP_REPLICATE, DP_SHARD, MIXED_PRECISION, TP, ConfigError, Declaration, ModelDescription, \
    attribute, build_meta_model, canonical_name, compute_dtype, device_kind, hookimpl, lacks, local_box, text_or_null

log = logging.getLogger("titan_core")
FIELD = "plugins.lora"
STAGE = 210  # right after tensor parallel split the adapted linears, before CP, AC, compile and FSDP
ROLES = ("attention", "mlp")  # the description's block_regions, in their order
PEFT_PREFIX = "base_model.model."
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
BASE_DTYPES = ("float32", "bfloat16")


def target_paths(description: ModelDescription, targets) -> tuple[str, ...]:
    """Block-relative paths of the linears ``targets`` names (roles or paths)."""
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
        elif target == "experts":
            raise ConfigError(f"{FIELD}.targets", "experts are grouped tensors, which lora does not adapt yet",
                              "adapt attention and the dense MLPs")
        else:
            raise ConfigError(f"{FIELD}.targets", f"unknown target '{target}'",
                              f"use {', '.join(ROLES)} or some of {', '.join(linears)}")
    return tuple(dict.fromkeys(chosen))


def chosen_linears(model: nn.Module, description: ModelDescription, paths) -> dict[str, nn.Linear]:
    """The linears to adapt, by name from the root (a block without one, or a stage without the block, has none)."""
    found = {}
    for index, block in attribute(model, description.blocks).items():
        for path in paths:
            linear = optional_attribute(block, path)
            if isinstance(linear, nn.Linear):
                found[f"{description.blocks}.{index}.{path}"] = linear
    return found


def optional_attribute(root: nn.Module, path: str):
    try:
        return attribute(root, path)
    except AttributeError:  # a sparse block of a mixture of experts has no dense MLP
        return None


def scale(options) -> float:
    return options.alpha / (math.sqrt(options.rank) if options.rslora else options.rank)


def add_adapter(linear: nn.Linear, rank: int, scaling: float, dropout: float) -> None:
    device = linear.weight.device
    linear.lora_A = nn.Linear(linear.in_features, rank, bias=False, device=device)
    linear.lora_B = nn.Linear(rank, linear.out_features, bias=False, device=device)
    linear.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    linear.lora_scaling = scaling
    linear.register_forward_hook(add_low_rank_update)


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


def adapters(model_parts) -> dict[str, nn.Linear]:
    """The adapted linears of this rank's parts, by canonical name."""
    return {canonical_name(name): module for part in model_parts for name, module in part.named_modules()
            if isinstance(getattr(module, "lora_A", None), nn.Linear)}


def peft_name(adapter: str, which: str, description: ModelDescription) -> str:
    """PEFT's file name of an adapter's ``lora_A``/``lora_B`` weight (through the model's Hugging Face names)."""
    return PEFT_PREFIX + description.hf.to_hf(f"{adapter}.weight").removesuffix(".weight") + f".{which}.weight"


def read_peft_config(folder: Path) -> dict:
    for file in ADAPTER_FILES:
        if not (folder / file).is_file():
            raise ConfigError(f"{FIELD}.init_from", f"{folder} has no {file}", "point it at a PEFT adapter folder")
    return json.loads((folder / "adapter_config.json").read_text())


def check_peft_config(peft: dict, options, folder: Path) -> None:
    """A PEFT adapter is read only into adapters of its own rank and scale."""
    mine = {"r": options.rank, "lora_alpha": options.alpha, "use_rslora": options.rslora}
    for key, value in mine.items():
        if peft.get(key, False if key == "use_rslora" else None) != value:
            option = {"r": "rank", "lora_alpha": "alpha", "use_rslora": "rslora"}[key]
            raise ConfigError(f"{FIELD}.{option}", f"{value!r} disagrees with {peft.get(key)!r} in "
                              f"{folder / 'adapter_config.json'}", f"set {FIELD}.{option}={peft.get(key)}")


def validate_options(config, options, plan) -> None:
    if not isinstance(options.rank, int) or isinstance(options.rank, bool) or options.rank < 1:
        raise ConfigError(f"{FIELD}.rank", f"{options.rank!r} is not a positive integer", "set e.g. 8 or 16")
    if not options.alpha > 0:
        raise ConfigError(f"{FIELD}.alpha", f"{options.alpha!r} is not a positive number", "set e.g. 2 x rank")
    if not 0 <= options.dropout < 1:
        raise ConfigError(f"{FIELD}.dropout", f"{options.dropout!r} is not in [0, 1)", "set e.g. 0.0 or 0.05")
    if not options.targets:
        raise ConfigError(f"{FIELD}.targets", "is empty", f"name some of {', '.join(ROLES)}")
    if options.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"{FIELD}.base_dtype", f"{options.base_dtype!r} is not one of {', '.join(BASE_DTYPES)}",
                          f"set {FIELD}.base_dtype=bfloat16 to hold the frozen linears in half the bytes")
    computes = compute_dtype(config.training.compute_dtype, "training.compute_dtype", device_kind(config.launch.device))
    if options.base_dtype == "bfloat16" and computes == torch.float32 and not plan.provides(MIXED_PRECISION):
        # Nothing would cast them: a float32 activation cannot meet a bfloat16 weight in a matmul.
        raise ConfigError(f"{FIELD}.base_dtype", "a bfloat16 base needs bfloat16 compute or a plugin's mixed "
                          "precision, and this job computes in float32", "set training.compute_dtype=bfloat16")
    if options.dropout and plan.degree(TP) > 1:
        # The masks would be drawn on split and replicated DTensors: untested that every rank draws alike.
        raise ConfigError(f"{FIELD}.dropout", f"{options.dropout!r} under tensor parallel is not supported yet",
                          "set plugins.lora.dropout=0.0, or plugins.tp.degree=1")
    paths = target_paths(plan.model, options.targets)
    model = build_meta_model(config, plan.model)
    for target in options.targets:
        if not chosen_linears(model, plan.model, target_paths(plan.model, [target])):
            raise ConfigError(f"{FIELD}.targets", f"'{target}' names no linear of model '{plan.model.family}'s blocks",
                              "adapt another role (a mixture of experts' experts are not linears)")
    if (options.export or options.init_from) and plan.model.hf is None:
        raise ConfigError(f"{FIELD}.export", lacks(plan.model, "hf", "PEFT's adapter format"),
                          f"set {FIELD}.export=false and {FIELD}.init_from=null")
    if text_or_null(options.init_from, f"{FIELD}.init_from"):
        folder = Path(options.init_from).expanduser()
        check_peft_config(read_peft_config(folder), options, folder)
        with safe_open(folder / "adapter_model.safetensors", "pt") as file:
            stored = set(file.keys())
        wanted = {peft_name(name, which, plan.model) for name in chosen_linears(model, plan.model, paths)
                  for which in ("lora_A", "lora_B")}
        if wanted != stored:
            odd = sorted(wanted ^ stored)[0]
            raise ConfigError(f"{FIELD}.init_from", f"{folder} {'lacks' if odd in wanted else 'has'} {odd} for "
                              f"targets {list(options.targets)}", "set plugins.lora.targets to the adapter's modules")


@torch.no_grad()
def initialize(linears: dict[str, nn.Linear], seed: int) -> None:
    """lora_A drawn as PEFT draws it, from a generator of the adapter's own (so every plan draws alike, each
    rank copying its box), lora_B zero."""
    for name, linear in linears.items():
        weight = torch.empty(linear.lora_A.weight.shape)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
        copy_box(linear.lora_A.weight, weight)
        local_box(linear.lora_B.weight)[0].zero_()


def copy_box(param: torch.Tensor, full: torch.Tensor) -> None:
    local, offset = local_box(param)
    local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))].to(local.dtype))


@torch.no_grad()
def read_peft(linears: dict[str, nn.Linear], folder: Path, description: ModelDescription) -> None:
    with safe_open(folder / "adapter_model.safetensors", "pt") as file:
        for name, linear in linears.items():
            for which in ("lora_A", "lora_B"):
                copy_box(getattr(linear, which).weight, file.get_tensor(peft_name(name, which, description)))


def writes_for_its_stage(mesh) -> bool:
    """Whether this rank speaks for its pipeline stage: the first of the ranks holding the same parameters."""
    return mesh.local_rank(DP_REPLICATE, DP_SHARD, CP, TP) == 0


def export_peft(linears: dict[str, nn.Linear], folder: Path, options, description: ModelDescription,
                base: str | None, mesh) -> None:
    """Write the adapters as PEFT's ``adapter_model.safetensors`` and ``adapter_config.json`` (rank 0 writes;
    each pipeline stage's first rank sends its own)."""
    tensors = {peft_name(name, which, description): full(getattr(linear, which).weight)
               for name, linear in linears.items() for which in ("lora_A", "lora_B")}
    shares = [None] * dist.get_world_size()
    dist.gather_object(tensors if writes_for_its_stage(mesh) else None, shares if dist.get_rank() == 0 else None)
    if dist.get_rank() != 0:
        return
    tensors = {name: tensor for share in shares if share for name, tensor in share.items()}
    modules = sorted({name.rsplit(".", 3)[1] for name in tensors})  # <module>.lora_A.weight
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": options.rank,
        "lora_alpha": options.alpha, "lora_dropout": options.dropout, "use_rslora": options.rslora,
        "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "inference_mode": True}, indent=2))
    log.info("LoRA adapters of %d linears written to %s (PEFT format)", len(linears), folder)


def full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (a collective over the ranks sharing a sharded one)."""
    whole = param.full_tensor() if hasattr(param, "full_tensor") else param
    return whole.detach().to("cpu", torch.float32).contiguous()


class LoraPlugin:
    """The run's LoRA: which linears it adapted, checked again once the model is built."""

    def __init__(self):
        self.adapted: set[str] = set()
        self.mesh = None

    @hookimpl
    def declare(self):
        """lora: a model transform right after tensor parallel's, which splits the adapters like their linears."""
        return Declaration(stage=STAGE)

    @hookimpl
    def validate(self, config, plugin_config, plan):
        """lora: every option, the targets against the model's blocks, a PEFT adapter to start from, before launch."""
        validate_options(config, plugin_config, plan)

    @hookimpl
    def estimate_costs(self, estimate, config, plugin_config, plan):
        """lora: only the adapters train: gradients and optimizer states for their share of the model's size."""
        model = build_meta_model(config, plan.model)
        linears = chosen_linears(model, plan.model, target_paths(plan.model, plugin_config.targets))
        adapters = sum(plugin_config.rank * (linear.in_features + linear.out_features) for linear in linears.values())
        every = sum(p.numel() for p in model.parameters())
        estimate.trained_share = adapters / every
        if plugin_config.base_dtype == "bfloat16":
            narrow = sum(p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()) / every
            estimate.add_memory("parameters", lambda e: -2 * narrow * e.held_params() / (e.weight_split * e.state_shards),
                                "the frozen linears held in bfloat16 (2 bytes each, not 4)", "lora")

    @hookimpl
    def convert_modules(self, model, plugin_config, plan):
        """lora: freeze every weight (the linears' in bfloat16 if asked) and give the chosen linears their adapters."""
        model.requires_grad_(False)
        if plugin_config.base_dtype == "bfloat16":
            # Only what autocast would round for its matmuls anyway: embeddings and norms keep their float32.
            for linear in [m for m in model.modules() if isinstance(m, nn.Linear)]:
                linear.to(torch.bfloat16)
        linears = chosen_linears(model, plan.model, target_paths(plan.model, plugin_config.targets))
        for linear in linears.values():
            add_adapter(linear, plugin_config.rank, scale(plugin_config), plugin_config.dropout)
        self.adapted = set(linears)

    @hookimpl
    def apply_parallelism(self, model_parts):
        """lora: split each adapter like the linear it adapts, where a parallelism split that linear."""
        for linear in adapters(model_parts).values():
            split_like_base(linear)

    @hookimpl
    def after_init(self, model_parts, mesh, config, plugin_config, plan):
        """lora: check that no later conversion dropped an adapter, then draw them or read a PEFT adapter."""
        lost = [canonical_name(name) for part in model_parts for name, module in part.named_modules()
                if canonical_name(name) in self.adapted and not hasattr(module, "lora_A")]
        if lost:
            raise ConfigError(FIELD, f"{len(lost)} adapted linear(s) lost their adapters to a later module conversion "
                              f"({lost[0]}, ...)", "convert those modules before lora (plan order: stage, then name)")
        linears = adapters(model_parts)
        initialize(linears, config.training.seed)
        if plugin_config.init_from:
            read_peft(linears, Path(plugin_config.init_from).expanduser(), plan.model)
        trainable = sum(local_box(p)[0].numel() for part in model_parts for p in part.parameters() if p.requires_grad)
        log.info("lora: %d linears adapted (rank %d, scale %.3g); %d trainable values on this rank", len(linears),
                 plugin_config.rank, scale(plugin_config), trainable)
        self.mesh = mesh

    @hookimpl
    def on_train_end(self, state, preempted, run_dir, config, plugin_config, plan):
        """lora: write the adapters in PEFT's format (adapter-step-N in the run dir) once every step ran."""
        if plugin_config.export and not preempted:
            export_peft(adapters(state.model_parts), Path(run_dir) / f"adapter-step-{state.step}", plugin_config,
                        plan.model, config.model.get("path"), self.mesh)
