"""A rank of the job: its device, its log, its process group; then the training loop, and one line for each way
it can end (finished, stopped by a signal, failed).

Runs in the launching process itself for a single-process job, in each worker the launcher starts
(``worker_main``), or in each rank of a torchrun job.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import re
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from titan_core.data import shared_tokenizer
from titan_core.errors import EXIT_BAD_INPUT, EXIT_STORAGE, ConfigError, StorageError
from titan_core.launch.crash_line import start_crash_line
from titan_core.launch.provenance import read_run_record
from titan_core.mesh import cpu_threads, device_for_rank
from titan_core.launch.summary import optimizer_line
from titan_core.plugins import CORE, Hooks, Registry, build_plan
from titan_core.preemption import StopSignals, exit_code
from titan_core.train import Trainer

log = logging.getLogger("titan_core")


def worker_main(config_yaml: str, run_dir: str) -> None:
    """Entry point of a launched worker (module-level so that spawned interpreters can import it)."""
    # A worker forked from the launcher inherits the elastic agent's handlers, which raise its SignalException
    # (a SIGHUP would end as a traceback): it starts from Python's defaults, as a spawned one does; StopSignals
    # takes SIGTERM and SIGINT over once the process group forms.
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stopped = train(OmegaConf.create(config_yaml), Path(run_dir))
    # At exit the interpreter collects and frees every object torch made (~1 s a process here); frozen ones
    # are left to the OS.
    gc.freeze()
    if stopped is not None:
        raise SystemExit(exit_code(stopped))


def train(config, run_dir: Path, own_crash_line: bool = False) -> signal.Signals | None:
    """This rank's share of the job; returns the signal that stopped it before its last step, or None.
    ``own_crash_line``: no launcher of ours watches this process (the user started it), so a native crash is
    reported by a process beside it."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = device_for_rank(int(os.environ.get("LOCAL_RANK", 0)), config.launch.device)
    _configure_logging(run_dir, rank, own_crash_line)
    if device.type == "cpu" and (threads := cpu_threads(config.launch, world_size)):
        torch.set_num_threads(threads)
    backend = config.launch.backend or ("nccl" if device.type == "cuda" else "gloo")
    store = _rendezvous_store(rank, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None,
                            timeout=timedelta(seconds=config.launch.init_timeout_s))
    hooks, trainer = None, None
    try:
        with StopSignals(world_size) as stop:
            registry = Registry(config)
            tokenizer = shared_tokenizer(config.tokenizer)
            plan = build_plan(config, registry, world_size, tokenizer.vocab_size, validate=False)  # checked before
            hooks = Hooks(registry, plan, config)
            trainer = Trainer(config, run_dir, hooks, tokenizer, device, rank)
            builder = hooks.registry.owner("build_optimizer")
            log.info(optimizer_line(trainer.step.optimizer, "the core's" if builder == CORE else f"plugin {builder}"))
            if rank == 0:
                hooks.each("start_tracking", run_dir=run_dir, run=read_run_record(run_dir),
                           first_step=trainer.state.step + 1, config=config)
            return trainer.run(stop)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:  # a library's own BaseException too (DCP's CheckpointException)
        said = f"{type(error).__name__}: {_last_line(error)}"
        first = first_failure(store, f"rank {rank}: {said}")
        if hooks is not None:
            _tell_plugins(hooks, error if first is None else reached(error, first),
                          trainer.state.step if trainer is not None else 0, config)
        # Ranks that read the same bad shard fail alike: the first one's line says it for all.
        echoed = first is not None and first.endswith(f": {said}")
        raise SystemExit(_one_line(error, rank, run_dir, config, echoed)) from None
    finally:
        dist.destroy_process_group()


def _tell_plugins(hooks: Hooks, error: BaseException, step: int, config) -> None:
    """The ``on_error`` event, every plugin's answer given its chance whatever another's raises. The elastic agent
    sends SIGTERM to this rank as soon as a failed peer has exited: the answers (a tracker rewriting its run's
    record) finish first, or a record is left half written; the agent kills after ``launch.stop_timeout_s``."""
    terminate = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        for name in hooks.implementing("on_error"):
            try:
                hooks.call(name, "on_error", error=error, step=step, config=config)
            except Exception:
                log.exception("the on_error hook of %s failed too", name)
    finally:
        signal.signal(signal.SIGTERM, terminate)


class RankFailed(RuntimeError):
    """Another rank's failure as it reached this one: its message is that rank's line."""


FAILURES, FIRST_FAILURE = "failures", "first-failure"  # keys of the attempt's rendezvous store
FAILURE_WAIT_S = 2.0  # how long a rank another's failure reached waits for that rank's line


def first_failure(store: dist.Store, line: str) -> str | None:
    """The line of the rank that failed first, when another did: this rank's ``line`` is published when it is the
    first (then None). The first's is in the store before its process ends, and so before its peers' collectives
    break; a store gone with the rank that held it leaves each rank its own error."""
    try:
        if store.add(FAILURES, 1) == 1:
            store.set(FIRST_FAILURE, line)
            return None
        deadline = time.monotonic() + FAILURE_WAIT_S
        while not store.check([FIRST_FAILURE]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return store.get(FIRST_FAILURE).decode()
    except (RuntimeError, OSError):  # torch's store errors are RuntimeErrors (DistStoreError, DistNetworkError)
        return None


def reached(error: BaseException, first: str) -> RankFailed:
    """What ``on_error`` receives on a rank the first failure reached: that failure, caused here by ``error``."""
    failed = RankFailed(first)
    failed.__cause__ = error
    return failed


def _last_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[-1]


def _one_line(error: BaseException, rank: int, run_dir: Path, config, echoed: bool = False) -> int:
    """Print the one line a user sees for ``error`` (its traceback goes to this rank's log), unless ``echoed``: the
    same bad input or storage fault another rank has printed first. Returns the exit code."""
    if isinstance(error, StorageError):
        log.exception("rank %d: storage fault", rank)
        if not echoed:
            print(f"titan-core: storage: rank {rank}: {error}", file=sys.stderr, flush=True)
        return EXIT_STORAGE
    if isinstance(error, (ConfigError, FloatingPointError)):
        # Bad input found only once the model exists, or a diverged run.
        kind, code = ("error", EXIT_BAD_INPUT) if isinstance(error, ConfigError) else ("stopped", 1)
        log.error("%s", error)
        if not echoed:
            print(f"titan-core: {kind}: {error}", file=sys.stderr, flush=True)
        return code
    log.exception("rank %d failed", rank)
    message = str(error).lower()
    hint = (f" (a collective waited past its timeout, launch.hang_timeout_s={config.launch.hang_timeout_s}: "
            "another rank stopped responding, or died)" if "timed out" in message else
            " (another rank ended first: its own line says why)"
            if "connection closed" in message or "connection reset" in message else "")
    print(f"titan-core: rank {rank} failed: {type(error).__name__}: {_last_line(error)}{hint}; "
          f"traceback in {rank_log(run_dir, rank)}", file=sys.stderr, flush=True)
    return 1


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


def native_crash(run_dir: Path, rank: int, since: float) -> str | None:
    """The fatal error rank ``rank``'s log ends with ("Fatal Python error: Aborted"): the stack faulthandler wrote
    as the worker died (see :func:`_configure_logging`); None when the log ends with a record of its own, or
    was last written before ``since`` (a crash of an earlier run in the same run dir)."""
    log = rank_log(run_dir, rank)
    try:
        if log.stat().st_mtime < since:
            return None
        with log.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - _CRASH_TAIL_BYTES))
            tail = file.read().decode(errors="replace")
    except OSError:
        return None
    _, marker, dump = tail.rpartition(_FATAL)
    return None if not marker or _RECORD.search(dump) else _FATAL + dump.splitlines()[0]


# faulthandler's first line, and the start of this module's log records: a crash is its log's last words.
_FATAL = "Fatal Python error: "
_RECORD = re.compile(r"^\d\d:\d\d:\d\d \[rank\d+\] ", re.MULTILINE)
_CRASH_TAIL_BYTES = 256 * 1024  # every thread's stack, and the extension modules faulthandler lists


def rank_log(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` logs: its records, the traceback it failed with, or the stacks of a native crash."""
    return run_dir / "logs" / f"rank{rank}.log"


class _RankLog(logging.FileHandler):
    """The rank's log file, with the process that reports the rank's native crash when it has one (see
    :mod:`titan_core.launch.crash_line`), which closing the log ends."""

    def __init__(self, path: Path, rank: int, crash_line: bool):
        super().__init__(path)
        self.crash_line = start_crash_line(path, rank) if crash_line else None

    def close(self) -> None:
        if self.crash_line is not None:
            assert self.crash_line.stdin is not None, "the process reads a pipe (stdin=PIPE)"
            self.crash_line.stdin.close()
            self.crash_line.wait()
            self.crash_line = None
        super().close()


def _configure_logging(run_dir: Path, rank: int, crash_line: bool) -> None:
    """Every rank logs to logs/rank<r>.log in the run dir; rank 0 also to the console."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("titan_core")
    logger.setLevel(logging.INFO)
    logger.propagate, logger.disabled = False, False  # whatever a logging config applied before left it
    faulthandler.disable()  # it writes into the log being closed
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(message)s", "%H:%M:%S")
    rank_file = _RankLog(rank_log(run_dir, rank), rank, crash_line)
    handlers: list[logging.Handler] = [rank_file]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
        # Tracebacks stay in the file, and so do records the console gets a line of its own for.
        handlers[-1].addFilter(lambda record: not record.exc_info and getattr(record, "console", True))
    for handler in handlers:
        handler.setFormatter(fmt)
        logger.addHandler(handler)
    # A native crash (an abort in a library, a segfault) writes every thread's Python stack into the log, where
    # the launcher's line for the dead worker (or the crash line's process) points, rather than pages of frames on
    # the console (torch's elastic wrapper sends them to stderr). An in-process sweep's next job closes this
    # handler and enables its own.
    crash_process = rank_file.crash_line
    fatal = crash_process.stdin if crash_process else rank_file.stream
    assert fatal is not None, "the crash line's pipe (stdin=PIPE) or the log file (opened at once)"
    faulthandler.enable(fatal, all_threads=True)
