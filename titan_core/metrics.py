"""What a step reports: loss, grad norm, throughput, TFLOPS, MFU, memory, ETA.

Rank 0 prints a line every ``metrics.log_every`` steps and writes the same values to
``metrics.jsonl`` and TensorBoard (``tb/``) in the run dir. On an interactive terminal a progress bar
(tqdm) below the lines shows the step, loss, tokens/s per device and the time left.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections import deque
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from titan_core.description import ModelDescription
from titan_core.devices import datasheet_by_device_name

log = logging.getLogger("titan_core")


def peak_tflops(configured: float | None, device: torch.device) -> tuple[float | None, str]:
    """Peak TFLOPS of one device and where the figure comes from: the user's, or an accelerator's datasheet
    (titan_core.devices). Never measured: a peak measured while other work shares the device makes
    MFU read high (85-93% on this CPU), so a CPU has none unless the user gives it."""
    if configured:
        return float(configured), "configured" + (" for this CPU" if device.type == "cpu" else "")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        profile = datasheet_by_device_name(name)
        if profile is None:
            return None, f"unknown accelerator '{name}', so no MFU: set metrics.peak_tflops to its dense bf16 peak"
        return profile.bf16_tflops, f"{name}: {profile.name} dense bf16 datasheet"
    return None, "a CPU has no datasheet peak here, so no MFU: set metrics.peak_tflops to this CPU's to see it"


def trained_flops_per_token(model: nn.Module, description: ModelDescription, seq_len: int) -> tuple[float | None, str]:
    """The model's training FLOPs per token (``description.flops_per_token``) less what the converted ``model``'s
    frozen weights never compute, and how they were counted: a frozen weight's gradient, 2 FLOPs per element and
    token of a linear's, an expert's for its share of the tokens. None when that share is unknown (frozen experts of
    a model whose ``ExpertsLayout`` gives no ``routed``)."""
    frozen = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad)
    layout, frozen_experts = description.experts, 0
    if layout is not None and description.blocks is not None:
        frozen_experts = sum(getattr(experts, stack).numel() for block in description.blocks_of(model).values()
                             if (experts := description.experts_of(block)) is not None for stack in layout.linears
                             if not getattr(experts, stack).requires_grad)
    if frozen_experts and (layout is None or layout.routed is None):
        return None, (f"model '{description.family}' does not say how many experts a token goes to "
                      "(ExpertsLayout.routed), so with frozen experts no TFLOPS or MFU")
    if layout is not None and layout.routed is not None:
        frozen += frozen_experts * layout.routed / layout.count
    counted = description.flops_per_token(seq_len) - 2 * frozen
    return counted, "frozen weights' gradients not counted" if frozen else "every weight trains"


def cut_log_after(path: Path, step: int) -> None:
    """Cut a ``metrics.jsonl`` after its last line of ``step`` or an earlier one (a torn last line goes too), so that
    a run resumed after ``step`` logs each step once. Reads back from the end only as far as that line: the steps
    since the checkpoint, whatever the run's length."""
    if not path.is_file():
        return
    with open(path, "r+b") as file:
        end = start = file.seek(0, os.SEEK_END)
        while start > 0:
            start = max(0, start - LOG_CHUNK)
            file.seek(start)
            lines = file.read(end - start).split(b"\n")
            whole = lines if start == 0 else lines[1:]  # the first may begin before this chunk
            line_end = end - sum(len(line) + 1 for line in whole) + 1  # where the first whole line starts
            ends = []
            for line in whole:
                line_end += len(line) + 1
                ends.append((min(line_end, end), line))
            kept = next((line_end for line_end, line in reversed(ends)
                         if (logged := _logged_step(line)) is not None and logged <= step), None)
            if kept is not None:
                file.truncate(kept)
                return
        file.truncate(0)


def _logged_step(line: bytes) -> int | None:
    try:
        return json.loads(line).get("step")
    except ValueError:
        return None


def global_means(values: list[torch.Tensor | None], device: torch.device) -> list[float]:
    """Each value's mean over the ranks that hold it (None: this rank holds none), in one all-reduce.

    Data- and context-parallel ranks see equal shares of the batch and tensor-parallel ranks the same
    loss, so the plain mean over the ranks holding a loss is the loss of the global batch (pipeline stages
    other than the last hold none).
    """
    zero, one = torch.zeros((), device=device), torch.ones((), device=device)
    totals = torch.stack([torch.stack([zero if v is None else v for v in values]),
                          torch.stack([zero if v is None else one for v in values])])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).tolist()


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated CUDA memory, or resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


VALIDATION = frozenset({"validation_loss", "validation_perplexity"})
LOG_CHUNK = 1 << 16  # bytes read back at a time from the end of metrics.jsonl
ETA_WINDOW = 5  # logged intervals the time left is estimated from
CORE_METRICS = frozenset({"step", "loss", "loss_avg", "grad_norm", "lr", "step_time_s", "tokens_per_s",
                          "tokens_per_s_per_device", "tflops_per_device", "memory_gib", "mfu"})


class MetricsLogger:
    def __init__(self, config, run_dir: Path, rank: int, world_size: int, device: torch.device,
                 flops: tuple[float | None, str], first_step: int):
        """``flops``: the training FLOPs per token and how they were counted (:func:`trained_flops_per_token`)."""
        self.every = config.metrics.log_every
        self.progress_every_s = config.metrics.progress_every_s
        self.validate_every = config.validation.every
        self.steps = config.training.steps
        self.tokens_per_step = config.training.global_batch_size * config.training.seq_len
        self.world_size = world_size
        self.device = device
        self.flops_per_token, counted = flops
        self.writes = rank == 0
        self.peak, source = peak_tflops(config.metrics.peak_tflops, device)
        if self.writes:
            log.info("peak %s TFLOPS per device (%s); %s training FLOPs per token (%s)",
                     f"{self.peak:.3g}" if self.peak else "unknown", source,
                     "unknown" if self.flops_per_token is None else f"{self.flops_per_token:.3g}", counted)
        if self.writes:  # a resumed run logs again what its stopped attempt logged past the checkpoint
            cut_log_after(run_dir / "metrics.jsonl", first_step)
        self.jsonl = open(run_dir / "metrics.jsonl", "a") if self.writes else None
        self.tensorboard = None
        if self.writes and config.metrics.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(str(run_dir / "tb"), purge_step=first_step + 1)
        self.first_step = first_step
        self.last = time.perf_counter()
        self.last_step = first_step
        self.last_line = self.last  # when rank 0 last printed a line of progress
        self.aside = {"validation": 0.0, "checkpoint": 0.0}  # seconds since the last log spent off the steps
        self.recent: deque[tuple[int, float]] = deque(maxlen=ETA_WINDOW)  # (steps, seconds) of the last logs
        self.window: dict[int, torch.Tensor | None] = {}  # each step's mean loss on this rank, since the last log
        self.console = ExitStack()
        self.bar = self._progress_bar() if self.writes and sys.stdout.isatty() else None

    def _progress_bar(self):
        """A bar at the bottom of the terminal, the log lines printed above it; CI and cluster logs (not a
        terminal) get the plain lines only."""
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.console.enter_context(logging_redirect_tqdm([log]))
        return self.console.enter_context(tqdm(total=self.steps, initial=self.first_step, unit="step",
                                               dynamic_ncols=True, file=sys.stdout))

    def logs(self, step: int) -> bool:
        """Whether ``step`` is one that is logged: every ``log_every``, the last, and those validated."""
        return step % self.every == 0 or step == self.steps or self.validates(step)

    def validates(self, step: int) -> bool:
        """Whether the model is evaluated on the validation batches after ``step``."""
        return bool(self.validate_every) and (step % self.validate_every == 0 or step == self.steps)

    def spent(self, kind: str, seconds: float) -> None:
        """Time spent on ``kind`` (validation, checkpoint) beside the steps: left out of the throughput and
        reported on its own at the next log."""
        self.aside[kind] += seconds

    def record(self, step: int, loss: torch.Tensor | None) -> None:
        """Keep ``step``'s mean loss on this rank (None on pipeline stages without the loss), on the device:
        reading it waits for the step, which only a logged step does."""
        self.window[step] = loss
        if self.bar is not None:
            self.bar.update(1)
        elif self.writes and time.perf_counter() - self.last_line >= self.progress_every_s and not self.logs(step):
            # Nobody watches a terminal: say where the run is between logged steps that are far apart.
            log.info("step %d/%d | eta %s", step, self.steps, self._eta(step, time.perf_counter()))
            self.last_line = time.perf_counter()

    def log(self, step: int, grad_norm: float, lr: float, extra: dict) -> dict:
        """Log ``step`` (called on every rank: the losses are reduced over the ranks); returns the values.

        ``loss`` is this step's own loss, so a resumed or restarted run logs exactly what the
        uninterrupted one did. ``loss_avg``, the mean over the steps since the last multiple of ``log_every``, shows
        the trend where one batch shows noise; it is left out when this process did not see the whole
        window (the first log line after a resume).
        """
        losses = dict(zip(self.window, global_means(list(self.window.values()), self.device)))
        average = None
        if step % self.every == 0 or step == self.steps:  # a step logged only for validation leaves the window open
            window = range((step - 1) // self.every * self.every + 1, step + 1)  # since the last multiple of every
            seen = all(s in losses for s in window)
            average = sum(losses[s] for s in window) / len(window) if seen else None
            self.window = {}
        now = time.perf_counter()
        training = max(now - self.last - sum(self.aside.values()), 1e-9)  # the steps' own time
        step_time = training / (step - self.last_step)
        self.recent.append((step - self.last_step, training))
        tokens_per_s = self.tokens_per_step / step_time
        metrics = {"step": step, "loss": losses[step], **({"loss_avg": average} if average is not None else {}),
                   "grad_norm": grad_norm, "lr": lr, "step_time_s": step_time,
                   "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / self.world_size,
                   "memory_gib": memory_gib(self.device),
                   **{f"{kind}_time_s": seconds for kind, seconds in self.aside.items() if seconds}, **extra}
        if self.flops_per_token is not None:
            metrics["tflops_per_device"] = self.flops_per_token * tokens_per_s / self.world_size / 1e12
            if self.peak:
                metrics["mfu"] = metrics["tflops_per_device"] / self.peak
        self.last, self.last_step = now, step
        self.aside = dict.fromkeys(self.aside, 0.0)
        if self.writes:
            self._write(metrics, eta=self._eta(step, now))
            self.last_line = time.perf_counter()
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {metrics['loss']:.4f} | {metrics['tokens_per_s_per_device']:.0f} "
                                     "tok/s/device")
        return metrics

    def _eta(self, step: int, now: float) -> str:
        """The time left at the recent steps' pace, and its basis: the last logged intervals (the first steps'
        compilation and warm-up, or a load that came and went, weigh only while recent), and the steps since."""
        steps = sum(count for count, _ in self.recent) + step - self.last_step
        seconds = sum(seconds for _, seconds in self.recent) + max(now - self.last - sum(self.aside.values()), 0.0)
        if steps <= 0:
            return "unknown yet"
        return f"{_duration(seconds / steps * (self.steps - step))} (at the last {steps} steps' pace)"

    def _write(self, m: dict, eta: str) -> None:
        tflops = f" | {m['tflops_per_device']:.3g} TFLOPS/device" if "tflops_per_device" in m else ""
        mfu = f" | MFU {m['mfu']:.1%}" if "mfu" in m else ""
        # Per device first, as published tables quote it (TPS/GPU); the job's total beside it.
        average = f" (avg {m['loss_avg']:.4f})" if "loss_avg" in m else ""
        extra = "".join(f" | {key} {m[key]:.3g}" for key in m if key not in CORE_METRICS and key not in VALIDATION)
        if "validation_loss" in m:
            extra += f" | validation loss {m['validation_loss']:.4f} (perplexity {m['validation_perplexity']:.1f})"
        log.info("step %d/%d | loss %.4f%s | grad_norm %.3f | lr %.2e | %.0f tok/s/device (%.0f total)%s%s | "
                 "mem %.2f GiB%s | eta %s",
                 m["step"], self.steps, m["loss"], average, m["grad_norm"], m["lr"], m["tokens_per_s_per_device"],
                 m["tokens_per_s"], tflops, mfu, m["memory_gib"], extra, eta)
        assert self.jsonl is not None, "only the rank that writes logs, and it opened metrics.jsonl"
        self.jsonl.write(json.dumps(m) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in m.items():
                if key != "step":
                    self.tensorboard.add_scalar(key, value, m["step"])

    def close(self) -> None:
        self.console.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"
