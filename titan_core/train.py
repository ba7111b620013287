"""The worker: build the model through the plugins' hooks, then run the training loop.

Runs in every rank: in the launching process itself for a single-process job, in the workers that
the launcher starts, or in each rank of a torchrun job.
"""

from __future__ import annotations

import contextlib
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
from titan_core.data import load_tokenizer
from titan_core.errors import ConfigError
from titan_core import objective
from titan_core.mesh import ParallelMesh, device_for_rank, set_collective_timeout
from titan_core.metrics import MetricsLogger
from titan_core.init import init_weights
from titan_core.plan import Hooks, build_plan, plugin_manager

log = logging.getLogger("titan_core")


@dataclass
class TrainState:
    """Everything a checkpoint must hold to resume exactly; plugins read and restore it in place."""

    model_parts: list[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    dataloader: object
    step: int = 0


def worker_main(config_path: str, run_dir: str) -> None:
    """Entry point of a launched worker (module-level so that spawned interpreters can import it)."""
    train(OmegaConf.load(config_path), Path(run_dir))


def train(config, run_dir: Path) -> None:
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = device_for_rank(int(os.environ.get("LOCAL_RANK", 0)), config.launch.device)
    _configure_logging(run_dir, rank)
    if device.type == "cpu" and world_size > 1:
        torch.set_num_threads(config.launch.cpu_threads_per_worker)
    backend = config.launch.backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, store=_rendezvous_store(rank, world_size), rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(seconds=config.launch.init_timeout_s))
    try:
        pm = plugin_manager(config)
        tokenizer = load_tokenizer(config.tokenizer)
        plan = build_plan(config, pm, world_size, tokenizer.vocab_size)
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


def _train(config, run_dir: Path, hooks: Hooks, tokenizer, device: torch.device, rank: int) -> None:
    training, plan = config.training, hooks.plan
    torch.manual_seed(training.seed)
    if training.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    mesh = ParallelMesh(plan.mesh_shape, device.type, plan.borrowed())
    set_collective_timeout(config.launch.init_timeout_s)

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
        init_weights(part, plan.model, training.seed)
    for name in hooks.order:
        model_parts = hooks.call(name, "after_init", model_parts=model_parts, mesh=mesh, config=config) or model_parts
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
    dataloader = hooks.first("build_dataloader", config=config, tokenizer=tokenizer, dp_rank=dp_rank,
                             dp_size=plan.dp_size)
    state = TrainState(model_parts, optimizer, lr_scheduler, dataloader)
    state.step = hooks.first("load_checkpoint", state=state, config=config, run_dir=run_dir) or 0

    metrics = MetricsLogger(config, run_dir, rank, plan.world_size, device,
                            plan.model.flops_per_token(training.seq_len), first_step=state.step)
    first_step = state.step + 1
    while state.step < training.steps:
        state.step += 1
        inputs, labels = next(dataloader)
        optimizer.zero_grad()
        losses = []
        for micro_inputs, micro_labels in zip(inputs.chunk(training.grad_accum_steps),
                                              labels.chunk(training.grad_accum_steps)):
            micro_inputs, micro_labels = micro_inputs.to(device), micro_labels.to(device)
            model_kwargs = ({"document_ids": document_ids(micro_inputs, tokenizer.bos_id)}
                            if training.attention_mask == "block_causal" else {})
            with contextlib.ExitStack() as contexts:
                for context in hooks.each("batch_context", inputs=micro_inputs, labels=micro_labels,
                                          model_kwargs=model_kwargs, model_parts=model_parts, mesh=mesh,
                                          config=config):
                    contexts.enter_context(context)
                loss = schedule.run(micro_inputs, micro_labels, model_kwargs)
            if loss is not None:
                losses.append(loss.full_tensor() if isinstance(loss, DTensor) else loss)
        loss = global_mean_loss(losses, device)
        grad_norm = clip_grad_norm_(model_parts, training.max_norm, mesh)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise FloatingPointError(f"loss is {loss} at step {state.step} (grad norm {grad_norm}): stopped before "
                                     "the optimizer step, so no checkpoint holds these weights; lower optimizer.lr "
                                     "or check the data")
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]  # what this step used, whoever set it
        lr_scheduler.step()
        hooks.each("after_optimizer_step", model_parts=model_parts, optimizer=optimizer, config=config,
                   step=state.step)
        extra = {}
        if metrics.logs(state.step):
            for answer in hooks.each("step_metrics", model_parts=model_parts, step=state.step, config=config):
                extra.update(answer)
        logged = metrics.step(state.step, loss, grad_norm, lr, extra)
        hooks.each("on_step_end", step=state.step, metrics=logged, config=config)
        if state.step == first_step:  # compiled and warmed up: from now on a long wait means a hung rank
            set_collective_timeout(config.launch.hang_timeout_s)
        if state.step < training.steps:
            hooks.first("save_checkpoint", state=state, step=state.step, config=config, final=False)
    hooks.first("save_checkpoint", state=state, step=state.step, config=config, final=True)
    metrics.close()
    log.info("finished step %d", state.step)
    hooks.each("on_train_end", state=state, config=config)
    if config.testing.save_final_weights:
        save_full_weights(model_parts, run_dir / "final_weights" / f"rank{rank}.pt")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def global_mean_loss(losses: list[torch.Tensor], device: torch.device) -> float:
    """Mean loss over every rank that computed one (pipeline stages other than the last compute none).

    Data- and context-parallel ranks see equal shares of the batch and tensor-parallel ranks the
    same loss, so the plain mean over the ranks holding a loss is the loss of the global batch.
    """
    local = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
    total = torch.stack([local.float(), torch.tensor(float(bool(losses)), device=device)])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def clip_grad_norm_(model_parts: list[torch.nn.Module], max_norm: float | None, mesh: ParallelMesh) -> float:
    """Total L2 norm of all gradients across every shard and pipeline stage; clips to ``max_norm``."""
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
    return norm.item()


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
