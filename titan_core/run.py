"""``python -m titan_core.run [overrides]``: compose the config, check the plan, then train.

Everything that can be wrong with the input is found here, in the launching process, and reported as
one line with exit code 2 before any worker starts. Then the job runs in this process (one rank, or
each rank under torchrun), or in ``world_size`` local workers started with torch's elastic launcher.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import sys
from datetime import datetime
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from omegaconf import OmegaConf

from titan_core.attention import MASKS
from titan_core.cluster import Nodes, allocated_world_size, job_nodes, workers_per_node
from titan_core.data import check_data, load_tokenizer
from titan_core.defaults import ADAMW_IMPLEMENTATIONS
from titan_core.description import CORE_ATTENTION
from titan_core.errors import ConfigError
from titan_core.mesh import device_kind
from titan_core.plan import Plan, build_plan, check_plugin_names, config_options, plugin_manager
from titan_core.provenance import write_run_record
from titan_core.schema import CORE_SECTIONS, check_config_kinds, check_key, default_preset
from titan_core.searchpath import PluginConfigSearchPath

EXIT_BAD_INPUT = 2


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def default_run_dir() -> str:
    """Where a run writes. Every torchrun rank must agree, so it derives from the rendezvous there."""
    if under_torchrun():
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        if run_id == "none":  # torchrun without --rdzv-id
            run_id = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
        return f"outputs/torchrun-{run_id}"
    return datetime.now().strftime("outputs/%Y-%m-%d/%H-%M-%S")


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
    split = plan.dp_size * training.grad_accum_steps
    if training.global_batch_size % split:
        raise ConfigError("training.global_batch_size",
                          f"{training.global_batch_size} sequences do not split over {plan.dp_size} data-parallel "
                          f"rank(s) x {training.grad_accum_steps} micro-batch(es)",
                          f"use a multiple of {split}")
    check_optimizer(config.optimizer)
    check_attention_mask(training.attention_mask, plan)
    if config.lr_scheduler.decay not in ("cosine", "linear", "none"):
        raise ConfigError("lr_scheduler.decay", f"unknown decay '{config.lr_scheduler.decay}'",
                          "use cosine, linear or none")
    check_data(config)


def check_devices(launch, local_ranks: int) -> None:
    """The device kind exists here and each local rank gets a GPU of its own."""
    if launch.device not in (None, "cpu", "cuda"):
        raise ConfigError("launch.device", f"unknown device '{launch.device}'", "use cpu, cuda or null")
    kind = device_kind(launch.device)
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("launch.device", "this machine has no CUDA device", "set launch.device=cpu (or null)")
    if kind == "cpu" and launch.backend == "nccl":
        raise ConfigError("launch.backend", "nccl needs CUDA devices and this job runs on the CPU",
                          "set launch.backend=gloo (or null)")
    local_ranks = int(os.environ["LOCAL_WORLD_SIZE"]) if under_torchrun() else local_ranks
    if kind == "cuda" and local_ranks > torch.cuda.device_count():
        raise ConfigError("launch.world_size", f"{local_ranks} ranks on this machine but {torch.cuda.device_count()} "
                          "GPU(s): two ranks would share one", "start at most one rank per GPU (torchrun "
                          "--nproc-per-node, launch.world_size, the degrees), or set launch.device=cpu")


def check_attention_mask(mask: str, plan: Plan) -> None:
    if mask not in MASKS:
        raise ConfigError("training.attention_mask", f"unknown mask '{mask}'", f"use one of {', '.join(MASKS)}")
    if mask == "block_causal" and plan.model.attention != CORE_ATTENTION:
        raise ConfigError("training.attention_mask", f"model '{plan.model.family}' attends through "
                          f"'{plan.model.attention}', which cannot mask documents (block_causal needs "
                          f"ModelDescription.attention = '{CORE_ATTENTION}')", "set training.attention_mask=causal")


def check_optimizer(optimizer) -> None:
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


def prepare(config, nodes: Nodes) -> Plan:
    """Validate everything and return the plan; raises ConfigError on bad input."""
    check_config_kinds(config)
    world_size = (int(os.environ["WORLD_SIZE"]) if under_torchrun() else
                  allocated_world_size(nodes, config.launch.device))
    vocab_size = load_tokenizer(config.tokenizer).vocab_size
    plan = build_plan(config, plugin_manager(config), world_size, vocab_size)
    check_job(config, plan)
    check_devices(config.launch, workers_per_node(plan.world_size, nodes))
    return plan


@hydra.main(config_path="pkg://titan_core.conf", config_name="config", version_base=None)
def hydra_main(config) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    from titan_core import train

    if under_torchrun() and os.environ["RANK"] != "0":
        # Rank 0 checks the job for every rank (what it reads is read once); if it refuses the job it exits
        # before the process group forms, and torchrun stops the others.
        if not config.launch.dry_run:
            train.train(OmegaConf.create(OmegaConf.to_container(config, resolve=True)), run_dir)
        return
    try:
        nodes = job_nodes()
        plan = prepare(config, nodes)
    except ConfigError as error:
        print(f"titan-core: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    config = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    if nodes.index == 0:
        print(plan.describe(), flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(config, run_dir / "config.yaml")
        write_run_record(run_dir, HydraConfig.get().overrides.task, plan, config.model.name, nodes.count)
    if config.launch.dry_run:
        if nodes.index == 0:
            from titan_core.planning.costs import estimate_here

            print(estimate_here(config, plan), flush=True)
        return
    if under_torchrun() or plan.world_size == 1:
        train.train(config, run_dir)
    else:
        launch_workers(config, run_dir, plan.world_size, nodes)


def launch_workers(config, run_dir: Path, world_size: int, nodes: Nodes) -> None:
    """Start this node's share of ``world_size`` workers with torch's elastic agent.

    On one machine the rendezvous listens on a free port chosen by the OS (a fixed port collides with
    any other job on the machine); the agents of a multi-node job meet on its first node.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from titan_core.train import worker_main

    elastic = run_dir / "elastic" / (f"node{nodes.index}" if nodes.count > 1 else "")
    launch_config = LaunchConfig(
        min_nodes=nodes.count, max_nodes=nodes.count, nproc_per_node=workers_per_node(world_size, nodes),
        run_id=nodes.run_id, rdzv_backend="c10d", rdzv_endpoint=nodes.rendezvous,
        max_restarts=config.launch.max_restarts, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(elastic)))
    _agent_logs_to(elastic / "agent.log")
    try:
        # The config goes as text: the other nodes' workers must not wait for the first node's config.yaml.
        elastic_launch(launch_config, worker_main)(OmegaConf.to_yaml(config), str(run_dir))
    except ChildFailedError as error:
        for rank, failure in sorted(error.failures.items()):
            print(f"titan-core: worker rank {rank} failed (exit code {failure.exitcode}); "
                  f"see {run_dir / 'logs' / f'rank{rank}.log'}", file=sys.stderr)
            if failure.message:
                print(f"  {str(failure.message).strip().splitlines()[-1]}", file=sys.stderr)
        sys.exit(1)


def _agent_logs_to(path: Path) -> None:
    """torch's elastic agent logs each failure as a traceback of its own polling and each stop of a worker;
    the failing rank's one line and ours below say what to act on, so the agent's records go to a file."""
    import logging

    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [handler], False


# Hydra's flags that take a value, which may follow as the next argument (``--cfg job``).
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
               "-cd", "--info", "-i", "--experimental-rerun")


def override_args(argv: list[str]) -> list[str]:
    """The overrides of a command line: its arguments that are neither flags nor a flag's value."""
    return [arg for before, arg in zip([None, *argv], argv) if not arg.startswith("-") and before not in VALUE_FLAGS]


def _overrides(argv: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create().parse_overrides(override_args(argv))
    except OverrideParseException as error:
        raise ConfigError("command line", _first_line(error), "see docs/config.md; Hydra's override grammar: "
                          "https://hydra.cc/docs/advanced/override_grammar/basic") from None


def _first_line(error: Exception) -> str:
    return next(line.strip() for line in f"{error}\n{type(error).__name__}".splitlines() if line.strip())


def check_composes(argv: list[str]) -> None:
    """Whatever else Hydra would refuse to compose (appending a key that exists, overriding the plugin list
    without ``+``, an unknown ``hydra.*`` key), in one line with Hydra's own hint."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_module("titan_core.conf", version_base=None):
            compose("config", overrides=override_args(argv))
    except (HydraException, OmegaConfBaseException) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        hint = next((line for line in lines[1:] if line.startswith("To ")), None)
        fix = (hint[0].lower() + hint[1:] if hint else "drop the '+' to change an option that exists"
               if "already at" in str(error) else "see docs/config.md")
        raise ConfigError("command line", lines[0] if lines else type(error).__name__, fix) from None


def _names(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value if isinstance(value, list) else getattr(value, "list", [])
    return [n for item in items for n in _names(item)]


def requested_plugins(argv: list[str]) -> list[str]:
    """Plugin names in ``plugins=`` overrides of the command line, sweeps included."""
    return [n for o in _overrides(argv) if o.key_or_group == "plugins" for n in _names(o.value())]


# Flags that bring a config of the user's own, which may enable plugins or add presets the command line does not show.
OWN_CONFIG_FLAGS = ("--config-name", "-cn", "--config-dir", "-cd", "--config-path", "-cp")


def check_command_line(argv: list[str]) -> None:
    """What Hydra would refuse with a multi-line dump, refused in one line before it composes anything: an
    option of a plugin that is not enabled, a model preset that does not exist, a plugin not installed, a
    misspelled key (with the nearest real one)."""
    plugins = requested_plugins(argv)
    check_plugin_names(plugins)
    if any(arg.split("=")[0] in OWN_CONFIG_FLAGS for arg in argv):
        return
    presets = [p for o in _overrides(argv) if o.key_or_group == "model" for p in _names(o.value())]
    for override in _overrides(argv):
        key = override.key_or_group
        changes = not (override.is_add() or override.is_force_add() or override.is_delete())
        if override.is_delete() and key.split(".")[0] in CORE_SECTIONS:
            raise ConfigError(key, "is the core's and cannot be removed", f"set it instead ({key}=...)")
        if key.startswith("plugins.") and changes and key.split(".")[1] not in plugins:
            name = key.split(".")[1]
            raise ConfigError(f"plugins.{name}", "is set but the plugin is not enabled",
                              f"enable it with +plugins=[{name}] (or remove the override)")
        if key == "model" and changes:
            known = config_options("model")
            for preset in _names(override.value()):
                if preset not in known:
                    raise ConfigError("model", f"no model preset is named '{preset}' (presets: "
                                      f"{', '.join(sorted(known))})", "pick one of them, or install the model "
                                      "plugin that ships it")
        if changes and "." in key:
            for preset in presets or [default_preset()]:
                check_key(key, preset)
    multirun = any(arg in ("-m", "--multirun") for arg in argv)
    check_launcher(argv, multirun)
    if not multirun:  # a sweep's values compose one job at a time
        check_composes(argv)


def check_launcher(argv: list[str], multirun: bool) -> None:
    """A Hydra launcher (SLURM through submitit) is installed and gets the jobs: only a multirun has it run them."""
    launcher = next((o for o in _overrides(argv) if o.key_or_group == "hydra/launcher"), None)
    if launcher is None:
        return
    if not multirun and not any(arg.split("=")[0] in ("--cfg", "-c") for arg in argv):
        raise ConfigError("hydra/launcher", "Hydra hands the jobs of a multirun to a launcher; without -m this job "
                          "would run here", "add -m")
    if str(launcher.value()) in ("slurm", "submitit_slurm", "submitit_local") and \
            importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        raise ConfigError("hydra/launcher", "SLURM jobs go through Hydra's submitit launcher, which is not "
                          "installed", "pip install 'titan-core[slurm]'")


def main() -> None:
    try:
        check_command_line(sys.argv[1:])
    except ConfigError as error:
        print(f"titan-core: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        # One rank writes Hydra's own files; the others would race on them.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    hydra_main()
    gc.freeze()  # as worker_main does: the exit skips freeing torch's objects one by one


OmegaConf.register_new_resolver("titan_run_dir", default_run_dir, replace=True)
Plugins.instance().register(PluginConfigSearchPath)

if __name__ == "__main__":
    main()
