"""LoRA: low-rank adapters on the linears a user names by role (and on a mixture of experts' stacked linears),
every other weight frozen.

``convert_modules`` adds the adapters to the meta model (titan_lora.adapters says how) and freezes the rest: the
base weights keep their names, so the Hugging Face import and export of the base work unchanged, the parallelism
plugins shard the adapters with their block, and the optimizer keeps state only for the adapters. ``after_init``
draws each ``lora_A`` as PEFT does (Kaiming-uniform) from one generator per adapter, so every plan starts alike,
and zeroes ``lora_B`` (training starts at the base model), or reads a PEFT adapter. ``on_train_end`` writes the
adapters in PEFT's format (titan_lora.peft_format). ``base_dtype=bfloat16`` holds the frozen linears and expert
stacks in bfloat16: what autocast rounds them to for every matmul anyway, in half the bytes.

Under tensor parallel (stage 210, right after tp's 200) each adapter is split like its linear: a linear split by
output features has its ``lora_B`` split the same way, one split by input features its ``lora_A``; the other
factor is whole on every rank. The update then has the base output's placement (its slice of the features, or
partial sums that the base's own reduction adds up), so tensor parallel adds no collective of its own for it.
Expert parallel (stage 350) splits the experts' factors by expert, as it splits their weights.

The roles come from the model's description: its tensor-parallel layout lists each block's linears, and its
first region is attention, its second the MLP; ``experts`` are its ``ExpertsLayout.linears``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from titan_core import MIXED_PRECISION, TP, ConfigError, Declaration, build_meta_model, canonical_name, compute_dtype, \
    device_kind, hookimpl, lacks, local_box, text_or_null

from titan_lora.adapters import EXPERTS, FIELD, ROLES, add_adapter, add_expert_adapters, adapters, chosen_experts, \
    chosen_linears, every_factor, expert_adapters, expert_stacks, frozen_matmul_weights, initialize, scale, \
    split_like_base, target_paths
from titan_lora.merge import merge
from titan_lora.peft_format import check_peft_config, export_peft, peft_name, peft_stack_name, read_peft, \
    read_peft_config

log = logging.getLogger("titan_core")
STAGE = 210  # right after tensor parallel split the adapted linears, before CP, AC, compile and FSDP
BASE_DTYPES = ("float32", "bfloat16")
EXPORTS = ("peft", "merged", "both", "none")


def validate_options(config, options, plan) -> None:
    if not isinstance(options.rank, int) or isinstance(options.rank, bool) or options.rank < 1:
        raise ConfigError(f"{FIELD}.rank", f"{options.rank!r} is not a positive integer", "set e.g. 8 or 16")
    if not options.alpha > 0:
        raise ConfigError(f"{FIELD}.alpha", f"{options.alpha!r} is not a positive number", "set e.g. 2 x rank")
    if not 0 <= options.dropout < 1:
        raise ConfigError(f"{FIELD}.dropout", f"{options.dropout!r} is not in [0, 1)", "set e.g. 0.0 or 0.05")
    if not options.targets:
        raise ConfigError(f"{FIELD}.targets", "is empty", f"name some of {', '.join(ROLES)}")
    if options.export not in EXPORTS:
        raise ConfigError(f"{FIELD}.export", f"{options.export!r} is not one of {', '.join(EXPORTS)}",
                          "export the adapters (peft), the base with them folded in (merged), both, or none")
    if options.export in ("merged", "both") and not config.model.get("path"):
        raise ConfigError(f"{FIELD}.export", f"{options.export} folds the adapters into the base's Hugging Face "
                          "folder, and this job starts from none", "start from a folder (model=hf model.path=...), "
                          f"or set {FIELD}.export=peft")
    if options.export in ("merged", "both") and expert_stacks(plan.model, options.targets):
        raise ConfigError(f"{FIELD}.export", f"{options.export}: adapters on stacked experts are merged by PEFT only "
                          "(a folder may store a stack as one tensor or as every expert's projections apart)",
                          f"set {FIELD}.export=peft and merge with PEFT (merge_and_unload), or leave experts out of "
                          f"{FIELD}.targets")
    if options.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"{FIELD}.base_dtype", f"{options.base_dtype!r} is not one of {', '.join(BASE_DTYPES)}",
                          f"set {FIELD}.base_dtype=bfloat16 to hold the frozen linears in half the bytes")
    computes = compute_dtype(config.training.compute_dtype, "training.compute_dtype", device_kind(config.launch.device))
    if options.base_dtype == "bfloat16" and computes == torch.float32 and not plan.provides(MIXED_PRECISION):
        # Nothing would cast them: a float32 activation cannot meet a bfloat16 weight in a matmul.
        raise ConfigError(f"{FIELD}.base_dtype", "a bfloat16 base needs bfloat16 compute or a plugin's mixed "
                          "precision, and this job computes in float32", "set training.compute_dtype=bfloat16")
    stacks = expert_stacks(plan.model, options.targets)
    if options.dropout and stacks:
        # The update is folded into each expert's weight, so no input of it can be dropped (PEFT refuses it too).
        raise ConfigError(f"{FIELD}.dropout", f"{options.dropout!r} with adapters on experts is not possible",
                          "set plugins.lora.dropout=0.0, or leave experts out of plugins.lora.targets")
    if options.dropout and plan.degree(TP) > 1:
        # The masks would be drawn on split and replicated DTensors: untested that every rank draws alike.
        raise ConfigError(f"{FIELD}.dropout", f"{options.dropout!r} under tensor parallel is not supported yet",
                          "set plugins.lora.dropout=0.0, or plugins.tp.degree=1")
    paths = target_paths(plan.model, options.targets)
    model = build_meta_model(config, plan.model)
    for target in options.targets:
        if not (chosen_experts(model, plan.model) if target == EXPERTS
                else chosen_linears(model, plan.model, target_paths(plan.model, [target]))):
            raise ConfigError(f"{FIELD}.targets", f"'{target}' names no linear of model '{plan.model.family}'s blocks",
                              "adapt another role")
    if (options.export != "none" or options.init_from) and plan.model.hf is None:
        raise ConfigError(f"{FIELD}.export", lacks(plan.model, "hf", "PEFT's adapter format"),
                          f"set {FIELD}.export=none and {FIELD}.init_from=null")
    if (options.export != "none" or options.init_from) and stacks:
        # PEFT's stacked factors follow the file's (experts, out, in) weight; a file arranging it otherwise (gpt-oss:
        # transposed, gate and up interleaved) would be adapted along the wrong dimensions.
        rearranged = [stack for name in chosen_experts(model, plan.model) for stack in stacks
                      if plan.model.hf.stored(f"{name}.{stack}") is not None]
        if rearranged:
            raise ConfigError(f"{FIELD}.export", f"model '{plan.model.family}' stores its experts' {rearranged[0]} "
                              "transposed or interleaved in Hugging Face folders, which PEFT's adapters on experts "
                              "cannot follow", f"leave experts out of {FIELD}.targets, or set {FIELD}.export=none "
                              f"and {FIELD}.init_from=null")
    if text_or_null(options.init_from, f"{FIELD}.init_from"):
        folder = Path(options.init_from).expanduser()
        peft = read_peft_config(folder)
        check_peft_config(peft, options, folder)
        check_factor_shapes(folder, factor_shapes(model, plan.model, options, paths, stacks), options,
                            peft.get("base_model_name_or_path"))


def factor_shapes(model, description, options, paths, stacks) -> dict[str, tuple[int, int]]:
    """The shape of each factor a PEFT adapter of ``options`` holds for ``model``, by PEFT's name: (rank, in) and
    (out, rank) of a linear's; a stack's hold every expert's, (experts x rank, in) and (out, rank x experts)."""
    shapes = {}
    for name, linear in chosen_linears(model, description, paths).items():
        shapes[peft_name(name, "lora_A", description)] = (options.rank, linear.in_features)
        shapes[peft_name(name, "lora_B", description)] = (linear.out_features, options.rank)
    for name, experts in (chosen_experts(model, description) if stacks else {}).items():
        for stack in stacks:
            count, out, inputs = getattr(experts, stack).shape
            shapes[peft_stack_name(name, stacks, stack, "lora_A", description)] = (options.rank * count, inputs)
            shapes[peft_stack_name(name, stacks, stack, "lora_B", description)] = (out, options.rank * count)
    return shapes


def check_factor_shapes(folder: Path, expected: dict[str, tuple[int, int]], options, trained_on: str | None) -> None:
    """The adapter in ``folder`` holds exactly the factors ``expected`` names, at those shapes (read from the file's
    header): an adapter of another rank or of another base model is refused before launch, never cut to fit."""
    with safe_open(folder / "adapter_model.safetensors", "pt") as file:
        stored = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}
    on = f" (trained on {trained_on})" if trained_on else ""
    if expected.keys() != stored.keys():
        odd = sorted(expected.keys() ^ stored.keys())[0]
        raise ConfigError(f"{FIELD}.init_from", f"{folder}{on} {'lacks' if odd in expected else 'has'} {odd} for "
                          f"targets {list(options.targets)}", "set plugins.lora.targets to the adapter's modules, "
                          "or start from an adapter of this model")
    for name, shape in sorted(expected.items()):
        rank_at = 0 if ".lora_A." in name else -1
        if stored[name][rank_at] != shape[rank_at]:  # copied into a smaller adapter, a factor would be cut
            raise ConfigError(f"{FIELD}.init_from", f"{folder}'s {name} has rank {stored[name][rank_at]}, not the "
                              f"{FIELD}.rank={options.rank} its adapter_config.json says",
                              "export the adapter again with PEFT (save_pretrained)")
        if stored[name] != shape:
            raise ConfigError(f"{FIELD}.init_from", f"{folder}'s {name} is {list(stored[name])}, this model's "
                              f"adapter there {list(shape)}: the adapter is of another model{on}",
                              "start from an adapter trained on this model (model.path)")


def adapt(model, plugin_config, plan) -> set[str]:
    """Freeze every weight of ``model`` (those of matmuls in bfloat16 if asked) and give the chosen linears and
    expert stacks their adapters, in place; the names of the modules adapted."""
    model.requires_grad_(False)
    if plugin_config.base_dtype == "bfloat16":
        for weight in frozen_matmul_weights(model, plan.model):
            weight.data = weight.data.to(torch.bfloat16)
    linears = chosen_linears(model, plan.model, target_paths(plan.model, plugin_config.targets))
    for linear in linears.values():
        add_adapter(linear, plugin_config.rank, scale(plugin_config), plugin_config.dropout)
    stacks = expert_stacks(plan.model, plugin_config.targets)
    experts = chosen_experts(model, plan.model) if stacks else {}
    for module in experts.values():
        add_expert_adapters(module, stacks, plugin_config.rank, scale(plugin_config))
    return set(linears) | set(experts)


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
    def convert_modules(self, model, plugin_config, plan):
        """lora: freeze every weight (those of matmuls in bfloat16 if asked) and give the chosen linears and expert
        stacks their adapters."""
        self.adapted = adapt(model, plugin_config, plan)

    @hookimpl
    def apply_parallelism(self, model_parts):
        """lora: split each adapter like the linear it adapts, where a parallelism split that linear."""
        for linear in adapters(model_parts).values():
            split_like_base(linear)

    @hookimpl
    def after_init(self, model_parts, mesh, config, plugin_config, plan):
        """lora: check that no later conversion dropped an adapter, then draw them or read a PEFT adapter."""
        lost = [canonical_name(name) for part in model_parts for name, module in part.named_modules()
                if canonical_name(name) in self.adapted and not hasattr(module, "lora_scaling")]
        if lost:
            raise ConfigError(FIELD, f"{len(lost)} adapted linear(s) lost their adapters to a later module conversion "
                              f"({lost[0]}, ...)", "convert those modules before lora (plan order: stage, then name)")
        initialize(every_factor(model_parts), config.training.seed)
        if plugin_config.init_from:
            read_peft(model_parts, Path(plugin_config.init_from).expanduser(), plan.model)
        trainable = sum(local_box(p)[0].numel() for part in model_parts for p in part.parameters() if p.requires_grad)
        log.info("lora: %d linears and %d experts modules adapted (rank %d, scale %.3g); %d trainable values on this "
                 "rank", len(adapters(model_parts)), len(expert_adapters(model_parts)), plugin_config.rank,
                 scale(plugin_config), trainable)
        self.mesh = mesh

    @hookimpl
    def on_train_end(self, state, preempted, run_dir, config, plugin_config, plan):
        """lora: once every step ran, write the adapters in PEFT's format (adapter-step-N in the run dir) and/or the
        base's folder with them folded in (merged-step-N)."""
        if plugin_config.export == "none" or preempted:
            return
        run_dir, base = Path(run_dir), config.model.get("path")
        adapter = run_dir / f"adapter-step-{state.step}"
        export_peft(state.model_parts, adapter, plugin_config, plan.model, base, self.mesh)
        if plugin_config.export in ("merged", "both") and dist.get_rank() == 0:
            merged = merge(Path(base).expanduser(), adapter, run_dir / f"merged-step-{state.step}")
            log.info("lora: wrote %s (%d weights merged)", run_dir / f"merged-step-{state.step}", merged)
            if plugin_config.export == "merged":
                shutil.rmtree(adapter)
