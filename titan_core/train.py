"""The worker: build the model through the plugins' hooks, then run the training loop.

Runs in every rank: in the launching process itself for a single-process job, in the workers that
the launcher starts, or in each rank of a torchrun job.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from titan_core.attention import document_ids
from titan_core.data import Prefetcher, shared_tokenizer, validation_batches
from titan_core.errors import ConfigError
from titan_core import objective
from titan_core.mesh import ParallelMesh, cpu_threads, device_for_rank, set_collective_timeout
from titan_core.metrics import MetricsLogger, global_means
from titan_core.init import init_weights
from titan_core.plan import Hooks, build_plan, plugin_manager
from titan_core.profiling import StepProfiler

log = logging.getLogger("titan_core")


@dataclass
class TrainState:
    """Everything a checkpoint must hold to resume exactly; plugins read and restore it in place."""

    model_parts: list[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    dataloader: object
    step: int = 0


def worker_main(config_yaml: str, run_dir: str) -> None:
    """Entry point of a launched worker (module-level so that spawned interpreters can import it)."""
    train(OmegaConf.create(config_yaml), Path(run_dir))
    # At exit the interpreter collects and frees every object torch made (~1 s a process here); frozen ones
    # are left to the OS.
    gc.freeze()


def train(config, run_dir: Path) -> None:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = device_for_rank(int(os.environ.get("LOCAL_RANK", 0)), config.launch.device)
    _configure_logging(run_dir, rank)
    if device.type == "cpu" and (threads := cpu_threads(config.launch, world_size)):
        torch.set_num_threads(threads)
    backend = config.launch.backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, store=_rendezvous_store(rank, world_size), rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(seconds=config.launch.init_timeout_s))
    try:
        pm = plugin_manager(config)
        tokenizer = shared_tokenizer(config.tokenizer)
        plan = build_plan(config, pm, world_size, tokenizer.vocab_size, validate=False)  # the launcher validated
        _train(config, run_dir, Hooks(pm, plan, config), tokenizer, device, rank)
    except (ConfigError, FloatingPointError) as error:
        # Bad input found only once the model exists, or a diverged run: one line, not a traceback.
        kind, code = ("error", 2) if isinstance(error, ConfigError) else ("stopped", 1)
        log.error("%s", error)
        print(f"titan-core: {kind}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(code) from None
    except Exception as error:
        # The traceback goes to this rank's log; the console gets one line, with the likely cause of a timeout.
        log.exception("rank %d failed", rank)
        message = str(error).lower()
        hint = (f" (a collective waited past its timeout, launch.hang_timeout_s={config.launch.hang_timeout_s}: "
                "another rank stopped responding, or died)" if "timed out" in message else
                " (another rank ended first: its own line says why)" if "connection closed" in message else "")
        print(f"titan-core: rank {rank} failed: {type(error).__name__}: {str(error).strip().splitlines()[-1]}{hint}; "
              f"traceback in {run_dir / 'logs' / f'rank{rank}.log'}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def _rendezvous_store(rank: int, world_size: int) -> dist.Store:
    """The store the ranks meet in: one per attempt of the world.

    torchelastic's agent keeps one store across restarts of the world and hands it to every attempt
    unprefixed, so a restarted gloo group would read the dead attempt's addresses and connect to dead
    peers ("Connection refused"); each attempt gets its own key prefix here.
    """
    if "MASTER_ADDR" not in os.environ:  # a single process started without a launcher: a one-rank world
        return dist.HashStore()
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts)
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def build_model_parts(hooks: Hooks, mesh: ParallelMesh, config, device: torch.device) -> list[torch.nn.Module]:
    """This rank's model parts: built on meta, converted, transformed by every plugin in plan order,
    materialized on ``device``, initialized shard by shard, then handed to the ``after_init`` hooks."""
    plan = hooks.plan
    with torch.device("meta"):
        model = hooks.first("build_model", description=plan.model)
    hooks.each("convert_float8", model=model, config=config)
    model_parts = [model]
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


def _train(config, run_dir: Path, hooks: Hooks, tokenizer, device: torch.device, rank: int) -> None:
    training, plan = config.training, hooks.plan
    torch.manual_seed(training.seed)
    if training.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    mesh = ParallelMesh(plan.mesh_shape, device.type, plan.borrowed())
    set_collective_timeout(config.launch.init_timeout_s)

    model_parts = build_model_parts(hooks, mesh, config, device)
    local_params = sum(_local(p).numel() for part in model_parts for p in part.parameters())
    log.info("rank %d of %d on %s: mesh %s, %d model part(s), %.3gM parameters held locally",
             rank, plan.world_size, device, dict(plan.mesh_shape) or "none", len(model_parts), local_params / 1e6)

    loss_fn = cross_entropy_loss
    for name in hooks.order:
        loss_fn = hooks.call(name, "wrap_loss", loss_fn=loss_fn, model_parts=model_parts, config=config) or loss_fn
    schedule = hooks.first("build_schedule", model_parts=model_parts, mesh=mesh, config=config, loss_fn=loss_fn)
    objective.set_loss_weight(getattr(schedule, "loss_weight", 1 / training.grad_accum_steps))
    optimizer = hooks.first("build_optimizer", model_parts=model_parts, config=config)
    lr_scheduler = hooks.first("build_lr_scheduler", optimizer=optimizer, config=config)
    dp_rank = mesh.local_rank(*plan.data_parallel_dims)
    loader = hooks.first("build_dataloader", config=config, tokenizer=tokenizer, dp_rank=dp_rank, dp_size=plan.dp_size)
    dataloader = Prefetcher(loader, config.data.prefetch, pin=device.type == "cuda")
    state = TrainState(model_parts, optimizer, lr_scheduler, dataloader)
    state.step = hooks.first("load_checkpoint", state=state, config=config, run_dir=run_dir) or 0

    def each_micro_batch(schedule_pass, inputs: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
        """``schedule_pass`` (the schedule's run or evaluate) on each micro-batch of this rank's rows, inside the
        plugins' batch contexts; the losses of the ranks that compute one."""
        losses = []
        for micro_inputs, micro_labels in zip(inputs.chunk(training.grad_accum_steps),
                                              labels.chunk(training.grad_accum_steps)):
            micro_inputs = micro_inputs.to(device, non_blocking=True)  # pinned by the prefetcher on CUDA
            micro_labels = micro_labels.to(device, non_blocking=True)
            model_kwargs = ({"document_ids": document_ids(micro_inputs, tokenizer.bos_id)}
                            if training.attention_mask == "block_causal" else {})
            with contextlib.ExitStack() as contexts:
                for context in hooks.each("batch_context", inputs=micro_inputs, labels=micro_labels,
                                          model_kwargs=model_kwargs, model_parts=model_parts, mesh=mesh,
                                          config=config):
                    contexts.enter_context(context)
                loss = schedule_pass(micro_inputs, micro_labels, model_kwargs)
            if loss is not None:
                losses.append(loss.full_tensor() if isinstance(loss, DTensor) else loss)
        return losses

    validation = validation_batches(config, tokenizer, dp_rank, plan.dp_size)
    if validation and not callable(getattr(schedule, "evaluate", None)):
        raise ConfigError("validation.every", f"the schedule {type(schedule).__name__} (from a plugin's "
                          "build_schedule) has no evaluate(inputs, labels, model_kwargs)",
                          "set validation.every=0, or add evaluate to the schedule (docs/writing-plugins.md)")

    def validate() -> dict:
        """Mean loss over the validation batches (copies: a batch context may split its tensors in place)."""
        with torch.no_grad():
            losses = [loss for inputs, labels in validation
                      for loss in each_micro_batch(schedule.evaluate, inputs.clone(), labels.clone())]
        (loss,) = global_means([local_mean(losses)], device)
        return {"validation_loss": loss, "validation_perplexity": math.exp(min(loss, 700.0))}

    finite = FiniteWatch(device)
    metrics = MetricsLogger(config, run_dir, rank, plan.world_size, device,
                            plan.model.flops_per_token(training.seq_len), first_step=state.step)
    profiler = StepProfiler(list(config.metrics.profile_steps), run_dir, rank, device)
    first_step = state.step + 1
    while state.step < training.steps:
        state.step += 1
        profiler.step_begins(state.step)
        inputs, labels = next(dataloader)
        optimizer.zero_grad()
        loss = local_mean(each_micro_batch(schedule.run, inputs, labels))
        grad_norm = clip_grad_norm_(model_parts, training.max_norm, mesh)
        finite.record(state.step, loss, grad_norm)
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]  # what this step used, whoever set it
        lr_scheduler.step()
        hooks.each("after_optimizer_step", model_parts=model_parts, optimizer=optimizer, config=config,
                   step=state.step)
        metrics.record(state.step, loss)
        logged = {}
        if metrics.logs(state.step):  # the only host syncs of a step: the values logged
            finite.check()
            extra = validate() if validation and metrics.validates(state.step) else {}
            extra.update(dataloader.metrics())
            for answer in hooks.each("step_metrics", model_parts=model_parts, step=state.step, config=config):
                extra.update(answer)
            logged = metrics.log(state.step, grad_norm.item(), lr, extra)
        profiler.step_ended(state.step, model_parts, optimizer)
        hooks.each("on_step_end", step=state.step, metrics=logged, config=config)
        if state.step == first_step:  # compiled and warmed up: from now on a long wait means a hung rank
            set_collective_timeout(config.launch.hang_timeout_s)
        if state.step < training.steps:
            hooks.first("save_checkpoint", state=state, step=state.step, config=config, final=False,
                        check_finite=finite.check)
    profiler.stop()
    dataloader.close()
    finite.check()
    hooks.first("save_checkpoint", state=state, step=state.step, config=config, final=True, check_finite=finite.check)
    metrics.close()
    log.info("finished step %d", state.step)
    hooks.each("on_train_end", state=state, config=config)
    if config.testing.save_final_weights:
        save_full_weights(model_parts, run_dir / "final_weights" / f"rank{rank}.pt")


class FiniteWatch:
    """Whether every step's loss and gradient norm were finite, kept on the device: the host asks (a sync)
    only on logged steps and before a checkpoint is written, so a step that logs nothing never waits."""

    def __init__(self, device: torch.device):
        self.first_bad = torch.zeros(3, device=device)  # step (0: none yet), its mean loss, its grad norm

    def record(self, step: int, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> None:
        loss = torch.zeros((), device=grad_norm.device) if loss is None else loss  # a stage without the loss
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        # torch.full, not torch.tensor: a copy from the host would wait for the device to finish the step.
        seen = torch.stack([torch.full((), float(step), device=grad_norm.device), loss, grad_norm.float()])
        self.first_bad = torch.where((self.first_bad[0] == 0) & ~finite, seen, self.first_bad)

    def check(self) -> None:
        step, loss, grad_norm = self.first_bad.tolist()
        if step:
            raise FloatingPointError(f"loss is {loss} at step {int(step)} (grad norm {grad_norm}): stopped before "
                                     "any checkpoint holds the weights it updated; lower optimizer.lr or check the "
                                     "data")


def local_mean(losses: list[torch.Tensor]) -> torch.Tensor | None:
    """The mean of this rank's micro-batch losses in fp32, on the device; None where none is computed."""
    return torch.stack(losses).float().mean() if losses else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def clip_grad_norm_(model_parts: list[torch.nn.Module], max_norm: float | None, mesh: ParallelMesh) -> torch.Tensor:
    """Total L2 norm of all gradients across every shard and pipeline stage (a tensor: reading it is a host
    sync); clips to ``max_norm``."""
    by_mesh: dict[object, list[torch.Tensor]] = {}  # DTensors of different meshes (experts') never mix in one op
    for part in model_parts:
        for p in part.parameters():
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = [torch.zeros((), device=mesh.device_type)]
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    norm = torch.stack(squares).sum()
    pp = mesh.submesh("pp")
    if pp is not None:  # each stage holds different parameters: sum the squares over stages
        dist.all_reduce(norm, group=pp.get_group())
    norm = norm.sqrt()
    if max_norm:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def save_full_weights(model_parts: list[torch.nn.Module], path: Path) -> None:
    """Every parameter this rank holds, gathered to full tensors, in one torch file."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = {}
    for part in model_parts:
        state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        weights.update({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_name(path.name + ".partial")  # a reader sees the whole file or none
    torch.save(weights, written)
    os.replace(written, path)


def _configure_logging(run_dir: Path, rank: int) -> None:
    """Every rank logs to logs/rank<r>.log in the run dir; rank 0 also to the console."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("titan_core")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(message)s", "%H:%M:%S")
    handlers = [logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
        handlers[-1].addFilter(lambda record: not record.exc_info)  # tracebacks stay in the file
    for handler in handlers:
        handler.setFormatter(fmt)
        logger.addHandler(handler)
