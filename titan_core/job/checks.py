"""The core's own checks of a composed job: every number, the batch split, the optimizer and its schedule, the
attention mask, the data and the memory a sequence needs. The plugins' checks run in ``build_plan``, the
devices' where the job starts (``titan_core.launch.prepare``); together they find everything that can be wrong
with the input before any worker starts."""

from __future__ import annotations

import logging
import math
import os

import torch
from omegaconf import OmegaConf
from torch import nn

from titan_core.attention import MASKS
from titan_core.data import check_data
from titan_core.default_hooks import ADAMW_IMPLEMENTATIONS
from titan_core.lr_schedule import DECAY_SHAPES
from titan_core.description import CORE_ATTENTION, attribute
from titan_core.errors import ConfigError
from titan_core.mesh import device_kind
from titan_core.parameter_roles import check_param_group_rules
from titan_core.plan import CP, TP, Plan
from titan_core.job.schema import core_defaults, plugin_defaults, show
from titan_core.plugins import Hooks, Registry


log = logging.getLogger("titan_core")
GIB = 2**30


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The core's numeric options: the field, whether a value is acceptable, and what is. Checked before launch.
NUMBERS = (
    ("training.max_norm", lambda v: v is None or _number(v) and v > 0, "a positive number, or null for no clipping"),
    ("training.seed", lambda v: _count(v) and v >= 0, "an integer >= 0"),
    ("optimizer.lr", lambda v: _number(v) and v > 0, "a positive number"),
    ("optimizer.betas", lambda v: isinstance(v, list) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
     "two numbers in [0, 1), such as [0.9, 0.95]"),
    ("optimizer.eps", lambda v: _number(v) and v > 0, "a positive number"),
    ("optimizer.weight_decay", lambda v: _number(v) and v >= 0, "a number >= 0"),
    ("lr_scheduler.warmup_steps", lambda v: _count(v) and v >= 0, "an integer >= 0"),
    ("lr_scheduler.min_lr_ratio", lambda v: _number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    ("metrics.log_every", lambda v: _count(v) and v >= 1, "a positive integer"),
    ("metrics.progress_every_s", lambda v: _number(v) and v > 0, "a positive number of seconds"),
    ("validation.every", lambda v: _count(v) and v >= 0, "an integer >= 0 (0: no validation)"),
    ("validation.batches", lambda v: _count(v) and v >= 1, "a positive integer"),
    ("data.prefetch", lambda v: _count(v) and v >= 0, "an integer >= 0 (0: each batch made in the step)"),
    ("validation.holdout_every", lambda v: _count(v) and v >= 2, "an integer >= 2"),
    ("metrics.peak_tflops", lambda v: v is None or _number(v) and v > 0, "a positive number, or null"),
    ("metrics.profile_steps", lambda v: v == [] or isinstance(v, list) and len(v) == 2 and all(map(_count, v))
     and 1 <= v[0] <= v[1], "[first, last], steps from 1 with first <= last (or [] for no profiling)"),
    ("launch.world_size", lambda v: v is None or _count(v) and v >= 1, "a positive integer, or null"),
    ("launch.max_restarts", lambda v: _count(v) and v >= 0, "an integer >= 0"),
    ("launch.cpu_threads_per_worker", lambda v: _count(v) and v >= 1, "a positive integer"),
    ("launch.init_timeout_s", lambda v: _number(v) and v > 0, "a positive number of seconds"),
    ("launch.hang_timeout_s", lambda v: _number(v) and v > 0, "a positive number of seconds"),
    ("launch.stop_timeout_s", lambda v: _number(v) and v > 0, "a positive number of seconds"),
)


def check_numbers(config) -> None:
    for field, acceptable, what in NUMBERS:
        value = OmegaConf.select(config, field)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if not acceptable(value):
            raise ConfigError(field, f"{value!r} is not {what}", f"set {field} to {what}")


def check_job(config, plan: Plan) -> None:
    """The core's own checks of the job, wherever it will run; the plugins' ran in build_plan."""
    check_numbers(config)
    training = config.training
    if not isinstance(training.steps, int) or training.steps < 0:
        raise ConfigError("training.steps", f"{training.steps!r} is not an integer >= 0",
                          "set the number of optimizer steps (0 builds and initializes only)")
    for field in ("global_batch_size", "seq_len", "grad_accum_steps"):
        if not isinstance(training[field], int) or training[field] < 1:
            raise ConfigError(f"training.{field}", f"{training[field]!r} is not a positive integer",
                              "set a positive integer")
    split = plan.data_shards * training.grad_accum_steps
    if training.global_batch_size % split:
        raise ConfigError("training.global_batch_size",
                          f"{training.global_batch_size} sequences do not split over {plan.data_shards} data-parallel "
                          f"rank(s) x {training.grad_accum_steps} micro-batch(es)",
                          f"use a multiple of {split}")
    check_optimizer(config.optimizer)
    if training.compute_dtype not in (None, "float32", "bfloat16"):
        raise ConfigError("training.compute_dtype", f"unsupported dtype '{training.compute_dtype}'",
                          "use bfloat16 or float32 (float16 would need loss scaling), or null")
    check_attention_mask(training.attention_mask, plan)
    check_schedule(config.lr_scheduler, training.steps)
    check_data(config)


def check_schedule(schedule, steps: int) -> None:
    if schedule.decay not in ("cosine", "linear", "wsd", "none"):
        raise ConfigError("lr_scheduler.decay", f"unknown decay '{schedule.decay}'", "use cosine, linear, wsd or none")
    if schedule.decay_shape not in DECAY_SHAPES:
        raise ConfigError("lr_scheduler.decay_shape", f"unknown shape '{schedule.decay_shape}'",
                          f"use one of {', '.join(DECAY_SHAPES)}")
    decay_steps = schedule.decay_steps
    # wsd's own options would do nothing beside another decay: a silent mistake (conf/config.yaml's defaults).
    for option, value, default in (("decay_steps", decay_steps, None), ("decay_shape", schedule.decay_shape, "linear")):
        if schedule.decay != "wsd" and value != default:
            raise ConfigError(f"lr_scheduler.{option}", f"{value} does nothing unless lr_scheduler.decay=wsd "
                              f"(decay is {schedule.decay})", f"set lr_scheduler.decay=wsd, or leave "
                              f"lr_scheduler.{option} at its default ({'null' if default is None else default})")
    if decay_steps is not None and (not _count(decay_steps) or not 1 <= decay_steps <= max(1, steps)):
        raise ConfigError("lr_scheduler.decay_steps", f"{decay_steps!r} is not a number of steps from 1 to "
                          f"training.steps ({steps})", "set it within the run, or null for a fifth of it")


def check_attention_mask(mask: str, plan: Plan) -> None:
    if mask not in MASKS:
        raise ConfigError("training.attention_mask", f"unknown mask '{mask}'", f"use one of {', '.join(MASKS)}")
    if mask == "block_causal" and plan.model.attention != CORE_ATTENTION:
        seam = f"attends through '{plan.model.attention}'" if plan.model.attention else "describes no attention seam"
        raise ConfigError("training.attention_mask", f"model '{plan.model.family}' {seam}, which cannot mask "
                          f"documents (block_causal needs ModelDescription.attention = '{CORE_ATTENTION}')",
                          "set training.attention_mask=causal")


def check_optimizer(optimizer) -> None:
    check_param_group_rules(optimizer.no_weight_decay, optimizer.lr_multipliers)
    if optimizer.implementation is not None and optimizer.implementation not in ADAMW_IMPLEMENTATIONS:
        raise ConfigError("optimizer.implementation", f"unknown AdamW implementation '{optimizer.implementation}'",
                          f"use one of {', '.join(ADAMW_IMPLEMENTATIONS)}")
    if optimizer.state_dtype not in ("float32", "bfloat16"):
        raise ConfigError("optimizer.state_dtype", f"unsupported state dtype '{optimizer.state_dtype}'",
                          "use float32 or bfloat16")
    if optimizer.state_dtype != "float32" and optimizer.implementation not in (None, "for_loop"):
        raise ConfigError("optimizer.implementation", f"'{optimizer.implementation}' keeps float32 states, but "
                          f"optimizer.state_dtype={optimizer.state_dtype} updates one parameter at a time",
                          "set optimizer.implementation=null (or for_loop)")


# No model's residual stream is wider: below the length at which even this width would not fit, nothing is built.
WIDEST_STREAM = 1 << 16
SMALLEST_DEVICE = 1 << 30  # bytes: less memory than any device the core runs on


def check_memory(config, plan: Plan, registry: Registry) -> None:
    """A sequence that cannot fit, refused before launch: a rank holds at least one sequence's residual stream
    (split over cp and tp at most, in bfloat16 at least), whatever the plan. A lower bound, so it never refuses a
    job that would fit; ``launch.check_memory=false`` skips it (a plugin splitting sequences its own way)."""
    seq_len, split = config.training.seq_len, plan.degree(CP) * plan.degree(TP)
    if not config.launch.check_memory or seq_len * WIDEST_STREAM * 2 / split <= SMALLEST_DEVICE:
        return  # fits whatever the model and the device: no need to ask the device or build the model
    memory = device_memory(config.launch.device)
    if seq_len * WIDEST_STREAM * 2 / split <= memory:
        return
    with torch.device("meta"):
        model = registry.call(registry.model, "build_model", description=plan.model)
    embeddings = [module for module in (attribute(model, path) for path in plan.model.inputs or ())
                  if isinstance(module, nn.Embedding)]
    logits = attribute(model, plan.model.logits) if plan.model.logits else None
    width = max((m.embedding_dim for m in embeddings), default=getattr(logits, "in_features", None))
    if width is not None and seq_len * width * 2 / split > memory:
        where = "a GPU" if device_kind(config.launch.device) == "cuda" else "this machine"
        raise ConfigError("training.seq_len", f"one sequence of {seq_len:,} tokens needs at least "
                          f"{seq_len * width * 2 / split / GIB:,.1f} GiB on a rank for its residual stream alone "
                          f"(width {width} in bfloat16, split over cp x tp = {split}), more than the "
                          f"{memory / GIB:.1f} GiB of {where}",
                          "shorten training.seq_len or split it over more ranks (cp), or set "
                          "launch.check_memory=false to launch anyway")


def check_conversions(config, plan: Plan, registry: Registry) -> None:
    """Where two or more plugins convert modules, each may refuse what another made (an override refusing linears
    another plugin converted): the conversions run here on the meta model first, so that a refusal comes before
    launch, not from every worker. One converter alone validates its options in ``validate``; its conversion is not
    run twice. Any other failure is left to the workers, which meet it again and report it in their one line."""
    hooks = Hooks(registry, plan, config)
    if len(hooks.implementing("convert_modules")) < 2:
        return
    try:
        hooks.converted_model(config)
    except ConfigError:
        raise
    except Exception:  # a plugin's bug, not a refusal: a traceback here would skip the workers' one-line report
        log.debug("a module conversion failed before launch; the workers will report it", exc_info=True)


def check_optimizer_options(config, plan: Plan, registry: Registry) -> None:
    """An optimizer plugin receives the core's ``optimizer.*`` options and honours those its declaration names
    (``Declaration.optimizer_options``); one set away from the core's default that it does not honour is refused,
    never ignored."""
    owner = registry.owner("build_optimizer")
    planned = {p.name: p.declaration for p in plan.plugins}
    if owner not in planned:  # the core's AdamW honours every one
        return
    honoured, defaults = planned[owner].optimizer_options, core_defaults()["optimizer"]
    for key, default in defaults.items():
        value = OmegaConf.to_container(config.optimizer)[key]
        if key not in honoured and value != default:
            kept = ", ".join(f"optimizer.{k}" for k in defaults if k in honoured) or "none of them"
            raise ConfigError(f"optimizer.{key}", f"is set to {value!r}, and plugin '{owner}' builds the optimizer "
                              f"without it (it honours {kept})", f"remove the override of optimizer.{key}, or "
                              f"use {owner}'s own options (docs)")


def check_options_that_act(config, plan: Plan) -> None:
    """An option a plugin declares acting only beside another setting (``Declaration.acts_only``), set away from
    its default where it would do nothing, is refused naming the setting it needs: a silent mistake otherwise."""
    for plugin in plan.plugins:
        options, defaults = config.plugins[plugin.name], plugin_defaults(plugin.name)
        for option, (condition, acts) in plugin.declaration.acts_only.items():
            value = OmegaConf.to_container(options)[option]
            if value != defaults.get(option) and not acts(options, config):
                raise ConfigError(f"plugins.{plugin.name}.{option}", f"{show(value)} does nothing unless {condition}",
                                  f"set {condition}, or leave plugins.{plugin.name}.{option} at its default "
                                  f"({show(defaults.get(option))})")


def device_memory(configured_device: str | None) -> int:
    """Bytes of memory of one device the job's ranks run on: a GPU's, or this machine's."""
    if device_kind(configured_device) == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
