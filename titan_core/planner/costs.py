"""Load every enabled plugin's pricing, run its ``estimate_costs`` on the model's estimate, and print the sum."""

from __future__ import annotations

import functools

import torch
from omegaconf import OmegaConf

from titan_core.data import load_tokenizer
from titan_core.errors import ConfigError
from titan_core.hookspecs import hookimpl
from titan_core.job.checks import check_job
from titan_core.job.command_line import composed
from titan_core.job.model_folder import apply_model_folder
from titan_core.mesh import device_kind
from titan_core.moe.routing import ExpertRouting
from titan_core.options import FLOAT_DTYPES, compute_dtype
from titan_core.plan import Plan
from titan_core.planner.accuracy import error_band
from titan_core.planner.estimate import CATEGORIES, GIB, Estimate, evaluated
from titan_core.planner.facts import model_facts, optimizer_facts
from titan_core.planner import hookspecs
from titan_core.planner.hardware import Hardware, by_device_name, cpu_measured
from titan_core.planner.ledger import Ledger
from titan_core.plugins import Hooks, Registry, Room, build_plan


class ExpertRoutingCosts:
    """The planner's pricing of a model plugin deriving :class:`titan_core.ExpertRouting` (the core's routing hooks)."""

    @hookimpl
    def estimate_costs(self, estimate, plan) -> None:
        """A MoE model: with router_bias_update_rate, the all-reduce of every block's expert counts over every rank
        after each optimizer step (the load metrics' all-reduces, on logging steps only, are not counted)."""
        args = plan.model.args
        if args.router_bias_update_rate:
            estimate.add_collective("all-reduce of the experts' token counts", tuple(plan.mesh_shape),
                                    4 * args.num_hidden_layers * args.num_experts, overlapped=False,
                                    plugin=plan.model.family, calls=1)


# Each plugin's pricing module (entry-point group titan_core.costs), and the core's for ExpertRouting's hooks.
PRICING = Room(hookspecs, hookspecs.COSTS_GROUP,
               lambda plugin: [ExpertRoutingCosts()] if isinstance(plugin, ExpertRouting) else [])


def _converted(build, conversions: list, **kwargs):
    """The model ``build`` makes, converted in place by each of ``conversions`` in turn."""
    model = build(**kwargs)
    for convert in conversions:
        convert(model)
    return model


def estimate(config, plan: Plan, registry: Registry, hardware: Hardware, traced: dict | None = None,
             expert_load: float = 1.0, expert_load_peak: float | None = None) -> Estimate:
    """One rank's estimate: the model alone, then each enabled plugin's ``estimate_costs`` in plan order, then the
    model plugin's.
    ``traced`` keeps the model's facts by dtype and conversions (and the optimizer's traffic) between estimates
    of the same model, sequence length and attention mask; ``expert_load`` and ``expert_load_peak``:
    :attr:`Estimate.expert_load` and :attr:`Estimate.expert_load_peak` (the plan command's ``--expert-load`` and
    ``--expert-load-peak``)."""
    traced = {} if traced is None else traced
    registry.open_room(PRICING)
    for flag, load in (("--expert-load", expert_load), ("--expert-load-peak", expert_load_peak)):
        if load not in (1, None) and plan.model.experts is None:
            raise ConfigError(flag, f"model '{plan.model.family}' has no experts to route unevenly",
                              f"leave {flag} out for a dense model")

    def facts_in(dtype: torch.dtype, conversions: dict | None = None, autocast: bool = False):
        key = (dtype, autocast, hardware.device_type, *sorted(conversions or ()))
        if key not in traced:
            build = functools.partial(_converted, functools.partial(registry.call, registry.model, "build_model"),
                                      list((conversions or {}).values()))
            traced[key] = model_facts(plan.model, build, dtype, config.training.seq_len,
                                      config.training.attention_mask == "block_causal", autocast,
                                      hardware.device_type)
        return traced[key]

    training = config.training
    hooks = Hooks(registry, plan, config)
    if "optimizer" not in traced:
        traced["optimizer"] = optimizer_facts(functools.partial(hooks.first, "build_optimizer"), config)
    optimizer = traced["optimizer"]

    def costed(conversions: dict) -> Estimate:
        """The model alone, then each enabled plugin's ``estimate_costs``, the model traced with ``conversions``."""
        result = Estimate(config=config, plan=plan, hardware=hardware, facts_in=facts_in,
                          trace_conversions=dict(conversions), device_type=hardware.device_type,
                          expert_load=expert_load, expert_load_peak=expert_load_peak,
                          blocks=list(range(plan.model.n_layers)),
                          microbatch_rows=training.global_batch_size // plan.dp_size // training.grad_accum_steps,
                          # the core's mixed precision (a plugin providing its own sets the dtype in estimate_costs)
                          compute_dtype=compute_dtype(training.compute_dtype, "training.compute_dtype",
                                                      hardware.device_type))
        result.optimizer_bytes, result.optimizer_state_bytes = optimizer.traffic, optimizer.state
        # The largest group and tensor as this rank keeps them (of what trains: a frozen model's adapters).
        result.optimizer_step_bytes = lambda e: optimizer.temporaries(
            *(min(elements / (e.weight_split * e.state_shards), e.trained_params())
              for elements in (e.facts.largest_role, e.facts.largest_parameter)))
        result.optimizer_operators = lambda e: optimizer.operators(e.facts.parameter_roles, e.facts.parameter_tensors)
        # The core's own collective: the step's trained tokens, summed over every rank before the first forward.
        result.add_collective("all-reduce of the step's trained tokens", tuple(plan.mesh_shape), 4, overlapped=False,
                              plugin="core", calls=1)
        result.add_memory("buffers", _logits_room, "the logits' room, left when an eager loss upcasts them: its "
                          "float32 tensors are larger", "core", when="cached")
        result.add_memory("activations", _weight_copies, "the weights' copies in the compute dtype, which autocast "
                          "caches until the micro-batch's backward ends", "core")
        result.add_memory("gradients", _whole_gradients_accumulated, "split weights' gradients kept whole across "
                          "micro-batches", "core", when="accumulated")
        for name in (p.name for p in plan.plugins):
            if registry.implements(name, "estimate_costs"):
                hooks.call(name, "estimate_costs", estimate=result, ledger=Ledger(result, name), config=config,
                           hardware=hardware)
                result.counted.append(name)
            else:
                result.not_counted.append(name)
        # Last, as in every ordered hook: the model plugin, for what its own hooks run besides the model (the
        # trace counts the model itself, so a model plugin without it is not "not counted").
        hooks.call(registry.model, "estimate_costs", estimate=result, ledger=Ledger(result, registry.model),
                   config=config, hardware=hardware)
        return result

    result = costed({})
    if result.trace_conversions:
        # Again, traced as converted from the first plugin on: one placed before the converting plugin read the
        # facts of the model unconverted (tp's split of the activations, before lora's adapters joined them).
        result = costed(result.trace_conversions)
    result.facts  # traced now, in the dtype the plugins chose, so that a model the trace cannot run fails here
    return result


def planned_job(overrides: list[str], hardware: Hardware, expert_load: float = 1.0,
                expert_load_peak: float | None = None) -> tuple[Plan, Estimate]:
    """The plan and the estimate on ``hardware`` of the job ``overrides`` describe, composed and checked as
    ``python -m titan_core.run`` checks it, its experts routed as unevenly as ``expert_load`` (over the step) and
    ``expert_load_peak`` (over the busiest micro-batch) say; raises ConfigError on bad input."""
    config = on_hardware(composed_job(overrides), hardware)
    registry = Registry(config)
    plan = build_plan(config, registry, None, load_tokenizer(config.tokenizer).vocab_size)
    check_job(config, plan)
    return plan, estimate(config, plan, registry, hardware, expert_load=expert_load, expert_load_peak=expert_load_peak)


def composed_job(overrides: list[str]):
    """The job config of ``overrides`` as the launcher reads it: composed and checked, its model and tokenizer
    taken from the Hugging Face folder it starts from (``model.path``)."""
    config = composed(overrides)
    apply_model_folder(config)
    return config


def on_hardware(config, hardware: Hardware):
    """The job as it runs on ``hardware``: a null ``launch.device`` and ``training.compute_dtype`` resolved for its
    device type, so that the plugins' checks judge the job planned (bfloat16 on a GPU, AsyncTP on CUDA), not one
    on the machine that plans it."""
    resolved = {}
    if config.launch.device is None:
        resolved["launch"] = {"device": hardware.device_type}
    if config.training.compute_dtype is None:
        dtype = compute_dtype(None, "training.compute_dtype", hardware.device_type)
        resolved["training"] = {"compute_dtype": next(name for name, value in FLOAT_DTYPES.items() if value == dtype)}
    return OmegaConf.merge(config, resolved) if resolved else config


def _logits_room(result: Estimate) -> float:
    """The logits as the model returns them, freed once an eager loss has made their float32 copy: as backward
    starts that block stays free (the loss's float32 tensors and their gradients are twice its size), cached by
    the allocator beside what is allocated (the seeds' 8B step replayed through a model of PyTorch's caching
    allocator: tests/allocator_replay.py)."""
    return result.leaves_logits_room * result.microbatch_tokens * result.facts.output / result.logits_split


def _weight_copies(result: Estimate) -> float:
    """The copies autocast makes of the weights this rank computes with (its share of each block's, the output
    layer's if it holds it), cached from their first use to the end of the micro-batch, backward included (the
    core's step runs backward inside autocast)."""
    facts = result.facts
    blocks = result.casts_block_weights * sum(facts.block_weight_casts[i] * result.block_gathered(i)
                                              / facts.block_params[i] for i in result.blocks if facts.block_params[i])
    return blocks + facts.outer_weight_casts * result.holds_outputs / result.weight_split


def _whole_gradients_accumulated(result: Estimate) -> float:
    """Over several micro-batches, what autograd keeps of a split weight's gradient beyond the weight's share: the
    first backward leaves in the parameter the whole gradient its weight's backward made (tensor parallel's
    embedding: the whole table, replicated, under torch's tracker), and the next ones add into it. A sharder that
    holds the gradients counts what it keeps of them itself."""
    if result.sharder_holds_gradients or not result.gradients_at_peak():
        return 0.0
    return result.made_gradient_bytes * evaluated(result.grad_whole_params, result) * result.trained_share


def report(result: Estimate) -> str:
    """The estimate as the plan command prints it."""
    result = result.most_loaded()
    hardware, plan, config = result.hardware, result.plan, result.config
    memory = result.memory()
    total = sum(memory.values())
    stepping = memory == result.step_peak()
    reserved = result.reserved()
    band = error_band(hardware.name, hardware.device_type)
    memory_note, speed_note = (band.memory_note(), band.speed_note()) if band else ("", "")
    shape = " x ".join(f"{d} {n}" for d, n in plan.mesh_shape.items()) or "one process"
    lines = [f"titan-core estimate: {plan.model.family}, world {plan.world_size} ({shape}), "
             f"{hardware.name} ({hardware.memory_gib:.1f} GiB, {hardware.peak_tflops():.3g} TFLOPS bf16 dense)",
             f"  memory per rank (the most loaded), at its peak{' (as the optimizer steps)' * stepping}: "
             f"{_size(total)} ({_fit(total, hardware)}){'' if reserved > total else memory_note}"]
    for category in CATEGORIES:
        lines.append(f"    {category:<12} {_size(memory[category]):>11}" + (
            "  (made in backward as the activations are freed)" if category == "gradients" and not memory[category]
            else "  (freed by then)" if category == "activations" and not memory[category] else ""))
        if category == "optimizer" and stepping:
            own = evaluated(result.optimizer_step_bytes, result)
            lines.append(f"      the step's own, beyond the states: {_size(own)}")
        terms = [(what, evaluated(nbytes, result), plugin, when) for term_category, what, nbytes, plugin, when
                 in result.memory_terms if term_category == category and when != "cached"]
        for what, nbytes, plugin, when in terms:
            if nbytes:  # a term that does not apply to this rank or plan
                moment = {"start": " (as backward starts)", "blocks": " (during the blocks' backward)",
                          "end": " (after the blocks' backward)",
                          "accumulated": " (as the gradients accumulate)",
                          "regathered": " (as backward reaches each block)",
                          "unreleased": " (until backward has run each unit)",
                          "held": " (across steps)"}.get(when, "")
                lines.append(f"      {plugin}: {what} {_size(nbytes)}{moment}")
    if reserved > total:  # the figure published runs give, which a GPU's band measures, takes the memory band
        lines.append(f"  reserved by the caching allocator at that peak: {_size(reserved)} (torch.cuda."
                     f"max_memory_reserved; beyond what fits, it empties its cache and retries, slower){memory_note}")
        cached = [(plugin, what, evaluated(nbytes, result)) for _, what, nbytes, plugin, when in result.memory_terms
                  if when == "cached"]
        lines += [f"      {plugin}: {what} {_size(nbytes)}" for plugin, what, nbytes in cached if nbytes > 0]
    if total > hardware.usable_gib * GIB:
        largest = max(memory, key=memory.__getitem__)
        lines.append(f"  why it does not fit: {largest}, {_size(memory[largest])}, is the largest part; --recommend "
                     "with the same overrides tries every plan the enabled plugins offer and lists those that fit")
    seconds = result.step_seconds()
    tokens = config.training.global_batch_size * config.training.seq_len
    flops = result.step_flops()
    lines += [f"  step: {seconds['step']:.4g} s = " + ", ".join(
                  f"{part} {value:.4g}" for part, value in seconds.items() if part != "step"),
              f"  FLOPs per rank per step: {flops:.4g}; MFU {flops / seconds['step'] / (result.peak_tflops() * 1e12):.1%}",
              f"  throughput: {result.tokens_per_device():,.0f} tokens/s/device "
              f"({tokens / seconds['step']:,.0f} tokens/s for the job){speed_note}"]
    for what, flops, plugin in result.flops_terms:
        lines.append(f"  matrix products {plugin}: {what}: {evaluated(flops, result):.4g} FLOPs per step "
                     f"at {hardware.matmul_tflops():.4g} TFLOPS")
    for what, nbytes, plugin in result.traffic_terms:
        lines.append(f"  memory traffic {plugin}: {what}: {_size(evaluated(nbytes, result))} per step "
                     f"at {hardware.memory_gbps:.0f} GB/s")
    for c in result.collectives:
        lines.append(f"  collective {c.plugin}: {c.name} over {' x '.join(c.dims) or 'the one rank'}: "
                     f"{_size(evaluated(c.bytes, result))} per step "
                     f"at {result.link_gbps(c.dims):.0f} GB/s{' (overlapped)' if c.overlapped else ''}")
    if result.not_counted:
        lines.append(f"  not counted (no estimate_costs hook): {', '.join(result.not_counted)}")
    lines.append(f"  {band.describe()}" if band else f"  expected error: unknown: no measured run on {hardware.name} "
                 "(docs/planner.md lists the cards with runs)")
    return "\n".join(lines)


def _fit(total: float, hardware: Hardware) -> str:
    room = hardware.usable_gib * GIB - total
    verdict = f"fits, {_size(room)} to spare," if room >= 0 else f"DOES NOT FIT, {_size(-room)} over,"
    return f"{verdict} in the {hardware.usable_gib:.1f} GiB a plan may fill of {hardware.memory_gib:.1f}"


def estimate_here(config, plan: Plan) -> str:
    """The estimate on the devices this job would run on (the dry run's): the GPU's profile, or this CPU
    measured now."""
    if device_kind(config.launch.device) == "cuda":
        name = torch.cuda.get_device_name()
        hardware = by_device_name(name)
        if hardware is None:
            return (f"titan-core estimate: no profile for '{name}'; plan it with python -m titan_core.planner "
                    "--hardware <a YAML file of its figures>")
    else:
        hardware = cpu_measured()
    try:
        return report(estimate(config, plan, Registry(config), hardware))
    except ConfigError as error:  # the job itself was checked: what the planner cannot price is no reason to stop
        return f"titan-core estimate: not available: {error}"


def _size(nbytes: float) -> str:
    """Bytes in the largest unit they fill, with their sign (a term that saves memory is negative)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
