"""The training loop: build the model through the plugins' hooks, then train it step by step.

Runs in every rank (``titan_core.launch.worker`` sets the rank up): in the launching process itself for a
single-process job, in the workers that the launcher starts, or in each rank of a torchrun job.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

import titan_core.objective as objective
from titan_core.attention import document_ids
from titan_core.data import Prefetcher
from titan_core.errors import ConfigError
from titan_core.grad_norm import FiniteWatch, clip_grad_norm_
from titan_core.initialization import init_weights
from titan_core.mesh import ParallelMesh, set_collective_timeout
from titan_core.metrics import MetricsLogger, global_means, trained_flops_per_token
from titan_core.capabilities import MIXED_PRECISION
from titan_core.options import compute_dtype
from titan_core.plugins import Hooks
from titan_core.preemption import StopSignals
from titan_core.profiling import StepProfiler
from titan_core.train_state import TrainState

log = logging.getLogger("titan_core")


def build_model_parts(hooks: Hooks, mesh: ParallelMesh, config, device: torch.device,
                      model: torch.nn.Module | None = None) -> list[torch.nn.Module]:
    """This rank's model parts from :meth:`Hooks.converted_model` (``model``, or built here): transformed by every
    plugin in plan order, materialized on ``device``, initialized shard by shard, then handed to ``after_init``."""
    plan = hooks.plan
    model_parts = [hooks.converted_model(config) if model is None else model]
    for plugin in plan.plugins:
        if plugin.declaration.stage is not None:
            model_parts = hooks.call(plugin.name, "apply_parallelism", model_parts=model_parts, mesh=mesh,
                                     config=config) or model_parts
    for part in model_parts:
        part.to_empty(device=device)
        init_weights(part, plan.model, config.training.seed)
    for name in hooks.order:
        model_parts = hooks.call(name, "after_init", model_parts=model_parts, mesh=mesh, config=config) or model_parts
    return model_parts


def build_training_step(hooks: Hooks, mesh: ParallelMesh, config, model_parts: list[torch.nn.Module],
                        device: torch.device, bos_id: int) -> TrainingStep:
    """The step a worker trains with (also what the planner's tests track): the loss as every plugin wraps it,
    normalised over the step's trained tokens, the plugins' schedule, optimizer and learning-rate schedule."""
    wrapped = cross_entropy_loss
    for name in hooks.order:
        wrapped = hooks.call(name, "wrap_loss", loss_fn=wrapped, model_parts=model_parts, config=config) or wrapped
    loss_fn = objective.TokenNormalisation(wrapped, hooks.plan, device)
    schedule = hooks.first("build_schedule", model_parts=model_parts, mesh=mesh, config=config, loss_fn=loss_fn)
    optimizer = hooks.first("build_optimizer", model_parts=model_parts, config=config)
    lr_scheduler = hooks.first("build_lr_scheduler", optimizer=optimizer, config=config)
    return TrainingStep(hooks, mesh, config, model_parts, schedule, loss_fn, optimizer, lr_scheduler, device, bos_id)


class TrainingStep:
    """One optimizer step of this rank: each micro-batch's forward and backward inside the plugins' batch
    contexts, the gradient event, clipping, the optimizer and learning-rate steps.

    Also the validation pass (the schedule's ``evaluate`` in the same contexts, without backward).
    """

    def __init__(self, hooks: Hooks, mesh: ParallelMesh, config, model_parts: list[torch.nn.Module], schedule,
                 loss_fn: objective.TokenNormalisation, optimizer: torch.optim.Optimizer, lr_scheduler,
                 device: torch.device, bos_id: int):
        self.hooks, self.mesh, self.config, self.model_parts = hooks, mesh, config, model_parts
        self.schedule, self.optimizer, self.lr_scheduler, self.loss_fn = schedule, optimizer, lr_scheduler, loss_fn
        self.stepper = optimizer  # what zero_grad and step are called on: plugins' wrap_optimizer may wrap it
        # Backward weighs each forward of a step by the schedule's loss_weight: 1 / forwards.
        self.forwards = 1 / getattr(schedule, "loss_weight", 1 / config.training.grad_accum_steps)
        self.device, self.bos_id = device, bos_id
        # The core's mixed precision: the weights stay float32, forward and backward compute in the narrower
        # dtype (autocast), unless a plugin does mixed precision its own way (FSDP's policy).
        dtype = compute_dtype(config.training.compute_dtype, "training.compute_dtype", device.type)
        self.autocast = (torch.autocast(device.type, dtype=dtype)
                         if dtype != torch.float32 and not hooks.plan.provides(MIXED_PRECISION) else None)

    def __call__(self, step: int, inputs: torch.Tensor, labels: torch.Tensor) -> tuple:
        """Train on one local batch; returns this rank's mean loss (None without the loss), the gradient
        norm, both on the device, and the learning rate the optimizer used."""
        self.stepper.zero_grad()
        inputs = inputs.to(self.device, non_blocking=True)  # pinned by the prefetcher on CUDA
        labels = labels.to(self.device, non_blocking=True)
        self.loss_fn.set_for([labels], self.forwards)
        loss = local_mean(self.each_micro_batch(self.schedule.run, inputs, labels))
        self.hooks.each("after_backward", model_parts=self.model_parts, mesh=self.mesh, step=step, config=self.config)
        grad_norm = clip_grad_norm_(self.model_parts, self.config.training.max_norm, self.mesh)
        self.stepper.step()
        first = self.optimizer.param_groups[0]  # what this step used, whoever set it, less a group's multiplier
        lr = first["lr"] / first.get("lr_multiplier", 1.0)
        self.lr_scheduler.step()
        self.hooks.each("after_optimizer_step", model_parts=self.model_parts, optimizer=self.optimizer,
                        config=self.config, step=step)
        return loss, grad_norm, lr

    def each_micro_batch(self, schedule_pass, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """``schedule_pass`` (the schedule's run or evaluate) on each micro-batch of this rank's rows (on the
        device), inside the plugins' batch contexts; the losses of the ranks that compute one."""
        losses = []
        count = self.config.training.grad_accum_steps
        for index, (micro_inputs, micro_labels) in enumerate(zip(inputs.chunk(count), labels.chunk(count))):
            model_kwargs = ({"document_ids": document_ids(micro_inputs, self.bos_id)}
                            if self.config.training.attention_mask == "block_causal" else {})
            with contextlib.ExitStack() as contexts:
                for context in self.hooks.each("batch_context", inputs=micro_inputs, labels=micro_labels,
                                               model_kwargs=model_kwargs, micro_batch=index, micro_batches=count,
                                               model_parts=self.model_parts, mesh=self.mesh, config=self.config):
                    contexts.enter_context(context)
                if self.autocast is not None:
                    contexts.enter_context(self.autocast)
                loss = schedule_pass(micro_inputs, micro_labels, model_kwargs)
            if loss is not None:
                losses.append(loss.full_tensor() if isinstance(loss, DTensor) else loss)
        return losses

    def validate(self, batches) -> dict:
        """Mean loss per trained token of the validation batches (copies: a batch context may split its tensors
        in place)."""
        batches = [(inputs.to(self.device, copy=True), labels.to(self.device, copy=True)) for inputs, labels in batches]
        self.loss_fn.set_for([labels for _, labels in batches], self.forwards)
        with torch.no_grad():
            losses = [loss for inputs, labels in batches
                      for loss in self.each_micro_batch(self.schedule.evaluate, inputs, labels)]
        (loss,) = global_means([local_mean(losses)], self.device)
        return {"validation_loss": loss, "validation_perplexity": math.exp(min(loss, 700.0))}


class Trainer:
    """This rank's run: everything the plugins build, then the loop over the steps."""

    def __init__(self, config, run_dir: Path, hooks: Hooks, tokenizer, device: torch.device, rank: int):
        training, plan = config.training, hooks.plan
        self.config, self.run_dir, self.hooks, self.rank = config, run_dir, hooks, rank
        torch.manual_seed(training.seed)
        if training.deterministic:
            torch.use_deterministic_algorithms(True)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        mesh = ParallelMesh(plan.mesh_shape, device.type, plan.borrowed())
        set_collective_timeout(config.launch.init_timeout_s)
        model = hooks.converted_model(config)
        flops = trained_flops_per_token(model, plan.model, training.seq_len)  # the whole model's, before any split
        model_parts = build_model_parts(hooks, mesh, config, device, model)
        local_params = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                           for part in model_parts for p in part.parameters())
        log.info("rank %d of %d on %s: mesh %s, %d model part(s), %.3gM parameters held locally",
                 rank, plan.world_size, device, dict(plan.mesh_shape) or "none", len(model_parts), local_params / 1e6)
        self.step = build_training_step(hooks, mesh, config, model_parts, device, tokenizer.bos_id)
        dp_rank = mesh.local_rank(*plan.data_parallel_dims)
        loader = hooks.first("build_dataloader", config=config, tokenizer=tokenizer,  # validation: in-group ranks
                             dp_rank=plan.data_shard(dp_rank), dp_size=plan.data_shards)
        dataloader = Prefetcher(loader, config.data.prefetch, pin=device.type == "cuda")
        self.state = TrainState(model_parts, self.step.optimizer, self.step.lr_scheduler, dataloader,
                                plugins=hooks.registry.stateful())
        self.state.step = hooks.first("load_checkpoint", state=self.state, config=config, run_dir=run_dir) or 0
        for name in hooks.order:
            self.step.stepper = hooks.call(name, "wrap_optimizer", optimizer=self.step.stepper, state=self.state,
                                           mesh=mesh, config=config) or self.step.stepper
        self.validation = hooks.first("build_validation_batches", config=config, tokenizer=tokenizer, dp_rank=dp_rank,
                                      dp_size=plan.dp_size) if config.validation.every else []
        if self.validation and not callable(getattr(self.step.schedule, "evaluate", None)):
            raise ConfigError("validation.every", f"the schedule {type(self.step.schedule).__name__} (from a plugin's "
                              "build_schedule) has no evaluate(inputs, labels, model_kwargs)",
                              "set validation.every=0, or add evaluate to the schedule (docs/writing-plugins.md)")
        self.finite = FiniteWatch(device)
        self.metrics = MetricsLogger(config, run_dir, rank, plan.world_size, device, flops, self.state.step)
        self.profiler = StepProfiler(list(config.metrics.profile_steps), run_dir, rank, device)

    def run(self, stop: StopSignals) -> signal.Signals | None:
        """Train up to ``training.steps``; returns the signal that stopped the run earlier, or None."""
        config, hooks, state, steps = self.config, self.hooks, self.state, self.config.training.steps
        first_step, stopped, saved = state.step + 1, None, None
        with objective.loss_weight(1 / self.step.forwards):
            while state.step < steps and stopped is None:
                state.step += 1
                self.profiler.step_begins(state.step)
                inputs, labels = next(state.dataloader)
                loss, grad_norm, lr = self.step(state.step, inputs, labels)
                self.finite.record(state.step, loss, grad_norm)
                self.metrics.record(state.step, loss)
                logged = self.log(state.step, grad_norm, lr) if self.metrics.logs(state.step) else {}
                self.profiler.step_ended(state.step, state.model_parts, state.optimizer)
                hooks.each("on_step_end", step=state.step, metrics=logged, config=config)
                if state.step == first_step:  # compiled and warmed up: from now on a long wait means a hung rank
                    set_collective_timeout(config.launch.hang_timeout_s)
                stopped = stop.agreed() if state.step < steps else None  # a stop at the last step is the end
                if stopped is not None or state.step < steps:
                    started = time.perf_counter()
                    saved = hooks.first("save_checkpoint", state=state, step=state.step, config=config, final=False,
                                        preempted=stopped is not None, check_finite=self.finite.check)
                    if saved is not None:  # the time of a save, not of a policy saying no
                        self.metrics.spent("checkpoint", time.perf_counter() - started)
        self.profiler.stop()
        state.dataloader.close()
        self.finite.check()
        if stopped is None:
            hooks.first("save_checkpoint", state=state, step=state.step, config=config, final=True, preempted=False,
                        check_finite=self.finite.check)
        self.metrics.close()
        hooks.each("on_train_end", state=state, preempted=stopped is not None, run_dir=self.run_dir, config=config)
        if stopped is not None:
            what = (f"saved {saved}; run the same command again to resume" if saved is not None else
                    "nothing saved (no checkpoint plugin): the same command starts again from step 1")
            line = f"stopped by {stopped.name} after step {state.step} of {steps}: {what}"
            log.info(line, extra={"console": False})  # rank 0's console gets the one line below
            if self.rank == 0:
                print(f"titan-core: {line}", file=sys.stderr, flush=True)
            return stopped
        log.info("finished step %d", state.step)
        if config.testing.save_final_weights:
            save_full_weights(state.model_parts, self.run_dir / "final_weights" / f"rank{self.rank}.pt")
        return None

    def log(self, step: int, grad_norm: torch.Tensor, lr: float) -> dict:
        """A logged step: the only host syncs of a step (the values logged, the NaN check)."""
        self.finite.check()
        extra = {}
        if self.validation and self.metrics.validates(step):
            started = time.perf_counter()
            extra = self.step.validate(self.validation)
            self.metrics.spent("validation", time.perf_counter() - started)
        extra.update(self.state.dataloader.metrics())
        for answer in self.hooks.each("step_metrics", model_parts=self.state.model_parts, mesh=self.step.mesh,
                                      step=step, config=self.config):
            extra.update(answer)
        return self.metrics.log(step, grad_norm.item(), lr, extra)


def local_mean(losses: list[torch.Tensor]) -> torch.Tensor | None:
    """The mean of this rank's micro-batch losses in fp32, on the device; None where none is computed."""
    return torch.stack(losses).float().mean() if losses else None


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy summed over the trained tokens, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=objective.IGNORE_INDEX,
                           reduction="sum")


def save_full_weights(model_parts: list[torch.nn.Module], path: Path) -> None:
    """Every parameter this rank holds, gathered to full tensors, in one torch file."""
    weights = {}
    for part in model_parts:
        state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        weights.update({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_name(path.name + ".partial")  # a reader sees the whole file or none
    torch.save(weights, written)
    os.replace(written, path)
