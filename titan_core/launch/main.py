"""``python -m titan_core.run [overrides]``: compose the config, check the plan, then train.

Everything that can be wrong with the input is found in the launching process and reported as one line
with exit code 2 before any worker starts. Then the job runs in this process (one rank, or each rank under
torchrun), or in ``world_size`` local workers started with torch's elastic launcher. SIGTERM or SIGINT makes
the workers finish their step and save (titan_core.preemption); the launcher then exits with 143 or 130.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import pkgutil
import sys
import time
from multiprocessing import resource_tracker
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from titan_core.data import reads_text
from titan_core.errors import EXIT_BAD_INPUT, EXIT_STORAGE, ConfigError
from titan_core.job.command_line import check_command_line, register_with_hydra
from titan_core.job.model_folder import apply_model_folder
from titan_core.job.run_dir import under_torchrun
from titan_core.launch.cluster import Nodes, job_nodes, workers_per_node
from titan_core.launch.prepare import prepare
from titan_core.launch.provenance import write_run_record
from titan_core.launch.summary import run_lines
from titan_core.launch.worker import native_crash, rank_log, train, worker_main
from titan_core.preemption import exit_code


# The dry run's estimate is the planner's, a room beside the core: named here, not imported, so that a training
# job never loads the planner.
DRY_RUN_ESTIMATE = "titan_core.planner.costs:estimate_here"


@hydra.main(config_path="pkg://titan_core.conf", config_name="config", version_base=None)
def hydra_main(config) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if under_torchrun() and os.environ["RANK"] != "0":
        # Rank 0 checks the job for every rank (what it reads is read once); if it refuses the job it exits
        # before the process group forms, and torchrun stops the others.
        if not config.launch.dry_run:
            apply_model_folder(config)
            _exit_if_stopped(train(OmegaConf.create(OmegaConf.to_container(config, resolve=True)), run_dir,
                                   own_crash_line=True))
        return
    try:
        nodes = job_nodes()
        plan = prepare(config, nodes)
    except ConfigError as error:
        print(f"titan-core: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    config = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    if nodes.index == 0:
        print(f"titan-core: run dir {run_dir.resolve()}", flush=True)
        print(plan.describe(), *run_lines(config, plan), sep="\n", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(config, run_dir / "config.yaml")
        write_run_record(run_dir, HydraConfig.get().overrides.task, plan, config.model.name, nodes.count)
    if config.launch.dry_run:
        if nodes.index == 0:
            print(pkgutil.resolve_name(DRY_RUN_ESTIMATE)(config, plan), flush=True)
        return
    if under_torchrun() or plan.world_size == 1:
        _exit_if_stopped(train(config, run_dir, own_crash_line=True))
    else:
        launch_workers(config, run_dir, plan.world_size, nodes)


def _exit_if_stopped(stopped) -> None:
    """A run stopped by a signal ends the process (and a sweep) with the shell's code for that signal; the
    workers' rank 0 has said where its state was saved."""
    if stopped is not None:
        sys.exit(exit_code(stopped))

# Modules a worker imports once it runs, whichever plugins it has (see _worker_imports).
WORKER_IMPORTS = ("torch._dynamo", "datasets")


def launch_workers(config, run_dir: Path, world_size: int, nodes: Nodes) -> None:
    """Start this node's share of ``world_size`` workers with torch's elastic agent.

    On one machine the rendezvous listens on a free port chosen by the OS (a fixed port collides with
    any other job on the machine); the agents of a multi-node job meet on its first node. On SIGTERM or SIGINT
    the agent passes the signal on to the workers, which finish their step and save, and kills those still
    running after ``launch.stop_timeout_s``.

    A spawned interpreter imports torch and the training loop anew (~3 s of a core each), so workers are forked
    from a server process that imported them once and runs nothing else. Never from this launcher: its agent
    runs threads (the rendezvous store's among them), and a child forked while one of them held a libc lock
    hangs at its first use of that lock (measured: a worker stuck in getaddrinfo's resolver lock as it
    connected to the store, in 1 of 65 four-rank jobs run two at a time). This launcher may also have asked
    CUDA about its devices, which a forked child cannot then use.
    """
    elastic = run_dir / "elastic" / (f"node{nodes.index}" if nodes.count > 1 else "")
    launch_config = LaunchConfig(
        min_nodes=nodes.count, max_nodes=nodes.count, nproc_per_node=workers_per_node(world_size, nodes),
        run_id=nodes.run_id, rdzv_backend="c10d", rdzv_endpoint=nodes.rendezvous,
        max_restarts=config.launch.max_restarts, start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=str(elastic)), shutdown_timeout=int(config.launch.stop_timeout_s))
    _agent_logs_to(elastic / "agent.log")
    preload = [worker_main.__module__, *_worker_imports(config)]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    _start_quiet_resource_tracker()
    started = time.time()
    try:
        # The config goes as text: the other nodes' workers must not wait for the first node's config.yaml.
        elastic_launch(launch_config, worker_main)(OmegaConf.to_yaml(config), str(run_dir))
    except SignalException as stop:
        sys.exit(exit_code(stop.sigval))
    except ChildFailedError as error:
        sys.exit(_report_failures(error, run_dir, launch_config.nproc_per_node, started))


def _start_quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker, which the forkserver would start, with its warnings off: a
    worker that crashed leaves the semaphores it made (tqdm's lock among them) to the tracker, which frees them
    and warns of the leak on this launcher's console, where nothing can be done about it."""
    inherited = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [inherited, _TRACKER_QUIET]))
    try:
        resource_tracker.ensure_running()  # the tracker's interpreter reads its warning filters from the environment
    finally:
        if inherited is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = inherited


_TRACKER_QUIET = "ignore::UserWarning:multiprocessing.resource_tracker"


def _report_failures(error: ChildFailedError, run_dir: Path, local_workers: int, started: float) -> int:
    """One line for the worker the elastic agent saw fail, and one for each of this node's workers that died of a
    native crash: the agent reports the first worker it finds dead, often one that failed only because a crashed
    peer closed its connections, and a crashed worker cannot print its own line. A worker that exited for bad input
    or a storage fault has printed its own line, whose exit code the job's is; any other failure's is 1."""
    failures = sorted(error.failures.items())
    first_local = failures[0][0] - failures[0][1].local_rank
    crashes = {rank: crash for rank in range(first_local, first_local + local_workers)
               if (crash := native_crash(run_dir, rank, started))}
    said = {failure.exitcode for _, failure in failures} & {EXIT_BAD_INPUT, EXIT_STORAGE}
    if not crashes and len(said) == len({failure.exitcode for _, failure in failures}) == 1:
        return said.pop()
    for rank, failure in failures:
        if rank not in crashes:
            # The agent's own message is the signal again, or a pointer to its docs on error files.
            how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            print(f"titan-core: worker rank {rank} failed ({how}); see {rank_log(run_dir, rank)}", file=sys.stderr)
    for crashed, crash in crashes.items():
        print(f"titan-core: worker rank {crashed} crashed ({crash}); its stack is in {rank_log(run_dir, crashed)}",
              file=sys.stderr)
    return 1


def _worker_imports(config) -> list[str]:
    """What each worker would import by itself once started, imported once before the workers fork from it:
    torch's compiler, which torch imports at the first initialisation of a parameter (1.8 s of a core per
    worker, measured), and the datasets library when the job reads documents as text (2.6 s)."""
    compiler, text_reader = WORKER_IMPORTS
    return [compiler, *([text_reader] if reads_text(config) else [])]


def _agent_logs_to(path: Path) -> None:
    """torch's elastic agent logs each failure as a traceback of its own polling and each stop of a worker;
    the failing rank's one line and ours below say what to act on, so the agent's records go to a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [handler], False


def main() -> None:
    """Train: compose the config from the overrides, check the plan, then run its workers."""
    try:
        check_command_line(sys.argv[1:])
    except ConfigError as error:
        print(f"titan-core: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        # One rank writes Hydra's own files; the others would race on them.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=disabled"]
    register_with_hydra()
    hydra_main()
    gc.freeze()  # as worker_main does: the exit skips freeing torch's objects one by one
