"""The launcher's preparation of a job: its world on these nodes and devices, its plan, every check passed."""

from __future__ import annotations

import os

import torch

from titan_core.data import load_tokenizer
from titan_core.errors import ConfigError
from titan_core.job.checks import (check_conversions, check_job, check_memory, check_optimizer_options,
                                   check_options_that_act)
from titan_core.job.model_folder import apply_model_folder, check_weights_loader
from titan_core.job.run_dir import under_torchrun
from titan_core.job.schema import check_config_kinds
from titan_core.launch.cluster import Nodes, allocated_world_size, workers_per_node
from titan_core.mesh import device_kind
from titan_core.plan import Plan
from titan_core.plugins import Registry, build_plan


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


def prepare(config, nodes: Nodes) -> Plan:
    """Validate everything and return the plan; raises ConfigError on bad input. A job starting from a Hugging
    Face folder (``model.path``) has its model and tokenizer filled from it in ``config``."""
    apply_model_folder(config)
    check_config_kinds(config)
    world_size = (int(os.environ["WORLD_SIZE"]) if under_torchrun() else
                  allocated_world_size(nodes, config.launch.device))
    vocab_size = load_tokenizer(config.tokenizer).vocab_size
    registry = Registry(config)
    plan = build_plan(config, registry, world_size, vocab_size)
    check_weights_loader(config, registry)
    check_job(config, plan)
    check_memory(config, plan, registry)
    check_optimizer_options(config, plan, registry)
    check_options_that_act(config, plan)
    check_devices(config.launch, workers_per_node(plan.world_size, nodes))
    check_conversions(config, plan, registry)  # last: it builds the model and runs every plugin's conversion
    return plan
