"""Fault tolerance across replica groups, on torchft: the groups train on when one dies, and a group that starts
late or again takes the live state from a peer instead of a checkpoint.

Each replica group is an ordinary titan-core job (its own ``python -m titan_core.run``, any plan inside it, the same
in every group); the groups meet at torchft's lighthouse. ``mode=sync``: each step starts a quorum (torchft's
manager, on a thread while forward runs), averages the gradients over the groups in it after backward (one
all-reduce per bucket, between the same rank of every group), and steps the optimizer only if every group commits
the step. A group that joins a quorum behind the others receives the state (weights, optimizer, schedule, data
position, step counter) from a peer as its first step commits; its own gradients of that step count for nothing.
``mode=local_sgd`` / ``diloco``: every group steps alone, and every ``sync_every`` steps the groups average their
weights (LocalSGD) or step an outer Nesterov optimizer on the averaged difference (DiLoCo), torchft's own classes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import urllib.parse
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # after titan_ft/__init__ quieted its logs
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.local_sgd import DiLoCo, LocalSGD

from titan_core import ConfigError, Declaration, TrainState, hookimpl, library_logs_at_debug
from titan_ft.agreement import check_agreement, check_paths, digests, shared_parts

# A recovery reads the peer's tensors from a bytes buffer, and torch warns that the buffer is read-only: they are
# copied into the training state at once.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

log = logging.getLogger("titan_core")
FIELD = "plugins.ft"
MODES = ("sync", "local_sgd", "diloco")
# The manager's own records (a line per quorum, per commit, "Unable to reset NCCL flight recorder" on CPU).
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
BUCKET_BYTES = 64 << 20  # gradients averaged per all-reduce: a bounded copy beside them, few calls


def lighthouse_address(plugin_config) -> str:
    """The lighthouse the groups meet at: the option, else $TORCHFT_LIGHTHOUSE (torchft's own variable)."""
    address = plugin_config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if address and not isinstance(address, str):
        raise ConfigError(f"{FIELD}.lighthouse", f"{address!r} is not http://<host>:<port>",
                          "give the address torchft_lighthouse prints")
    if not address:
        raise ConfigError(f"{FIELD}.lighthouse", "is not set and $TORCHFT_LIGHTHOUSE is empty",
                          "start one (torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000) and set "
                          "plugins.ft.lighthouse=http://<host>:<port>")
    return address


def lighthouse_unreachable(address: str, timeout: float) -> str | None:
    """Why nothing answers at ``address`` (a TCP connection, ``timeout`` seconds at most), or None."""
    parsed = urllib.parse.urlparse(address if "://" in address else f"http://{address}")
    if parsed.hostname is None or parsed.port is None:
        return "is not http://<host>:<port>"
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=timeout).close()
    except OSError as error:
        return f"nothing answers at {address} ({error.strerror or error})"
    return None


def check_options(plugin_config) -> None:
    """Every option a user can get wrong, named with its fix (the lighthouse's reachability aside)."""
    for name in ("group_count", "min_replicas", "sync_every"):
        value = plugin_config[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{FIELD}.{name}", f"{value!r} is not a positive integer", "set a positive integer")
    group, count = plugin_config.replica_group, plugin_config.group_count
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < count:
        raise ConfigError(f"{FIELD}.replica_group", f"{group!r} is not a group index below group_count={count}",
                          f"number the groups 0 to {count - 1}, one per job")
    if plugin_config.min_replicas > count:
        raise ConfigError(f"{FIELD}.min_replicas", f"{plugin_config.min_replicas} groups can never meet: "
                          f"group_count is {count}", f"set at most {count}")
    if plugin_config.mode not in MODES:
        raise ConfigError(f"{FIELD}.mode", f"{plugin_config.mode!r} is not a mode", f"use one of {', '.join(MODES)}")
    for name in ("outer_lr", "quorum_timeout_s", "timeout_s", "connect_timeout_s"):
        value = plugin_config[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"{FIELD}.{name}", f"{value!r} is not a positive number", "set a positive number")
    momentum = plugin_config.outer_momentum
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ConfigError(f"{FIELD}.outer_momentum", f"{momentum!r} is not in [0, 1)", "set a momentum below 1")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (a view), a tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def localized(value: Any) -> Any:
    """``value`` (dicts and lists of tensors and numbers) with every DTensor as this rank's shard: what a peer's same
    rank holds of it, since every group runs the same plan."""
    if isinstance(value, dict):
        return {key: localized(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(localized(item) for item in value)
    return local(value) if isinstance(value, torch.Tensor) else value


def like(template: Any, received: Any) -> Any:
    """``received`` (from :func:`localized`) as DTensors where ``template`` holds them, placed as they are."""
    if isinstance(template, DTensor) and isinstance(received, torch.Tensor):
        return DTensor.from_local(received.to(template.device), template.device_mesh, template.placements,
                                  run_check=False, shape=template.shape, stride=template.stride())
    if isinstance(template, dict) and isinstance(received, dict):
        return {key: like(template.get(key), item) for key, item in received.items()}
    return received


def average_across_groups(manager: Manager, tensors: list[torch.Tensor]) -> None:
    """Average ``tensors`` in place over the groups in the quorum, in buckets of one dtype (one all-reduce each). A
    group the quorum does not count yet (recovering) contributes zeros."""
    buckets: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for tensor in tensors:
        same = buckets.setdefault(tensor.dtype, [[]])
        if same[-1] and sum(t.numel() for t in same[-1]) * tensor.element_size() >= BUCKET_BYTES:
            same.append([])
        same[-1].append(tensor)
    for bucket in (b for same in buckets.values() for b in same):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        manager.allreduce(flat).wait()
        offset = 0
        for tensor in bucket:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def quiet_http_transport(timeout: timedelta) -> HTTPTransport:
    """torchft's HTTP checkpoint transport (its default), with the line its server prints on stderr for every request
    sent to the debug log instead."""
    transport: HTTPTransport = HTTPTransport(timeout=timeout, num_chunks=0)
    transport._server.RequestHandlerClass.log_message = (  # the handler class torchft made for this server
        lambda handler, form, *args: log.debug("torchft checkpoint server: " + form, *args))
    return transport


class CommittedSteps:
    """The optimizer as the training step calls it: a quorum as each step starts, the update only when every group
    commits (the weights are not read for a peer while they change)."""

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer):
        self.manager, self.optimizer, self.skipped = manager, optimizer, 0

    def zero_grad(self) -> None:
        self.manager.start_quorum()
        self.optimizer.zero_grad()

    def step(self) -> None:
        if not self.manager.should_commit():
            self.skipped += 1
            return
        self.manager.disallow_state_dict_read()
        try:
            self.optimizer.step()
        finally:
            self.manager.allow_state_dict_read()


def group_store() -> tuple[dist.TCPStore | None, str, int]:
    """A store for this group's manager, hosted by rank 0 and new with every start of the group (the launcher's
    store outlives a restart of the workers, and a restarted rank would read the dead manager's address there)."""
    store: dist.TCPStore | None = None
    address: list = [None]  # rank 0's (host, port), as the broadcast leaves it on every rank
    if dist.get_rank() == 0:
        store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
        address = [(socket.gethostname(), store.port)]
    dist.broadcast_object_list(address, src=0)
    host, port = address[0]
    return store, host, port


class FaultTolerance:
    """The ft plugin's object in each worker: its group's torchft manager, and the state it serves and restores."""

    def __init__(self) -> None:
        self.manager: Manager | None = None
        self.state: TrainState | None = None
        self.steps: CommittedSteps | None = None
        self.restored: dict[str, int] | None = None  # the manager's counters from a checkpoint, until it exists
        # Each part's state_dict taken once, before training: a peer's request is served on torchft's threads while
        # this rank runs forward, when FSDP's state_dict hook would swap the parameters under it. The tensors are the
        # parameters themselves (FSDP keeps its sharded DTensors' identity), so they are always the current ones.
        self.weights: list[dict[str, torch.Tensor]] = []
        self.store: dist.TCPStore | None = None  # rank 0's: the group's manager meets there
        self.digests: list[int] = []  # this group's parts, compared with every group's at each quorum
        self.warned: set[int] = set()  # groups already said to differ from this one
        self.exits = contextlib.ExitStack()

    @hookimpl
    def declare(self, config, plugin_config):
        """ft: this job's replica group and the groups' count, which split the data."""
        check_options(plugin_config)
        check_paths(config, plugin_config.may_differ)
        semi_synchronous = ("plugins.ft.mode=local_sgd or diloco", lambda options, _: options.mode != "sync")
        return Declaration(replica_group=(plugin_config.replica_group, plugin_config.group_count),
                           acts_only={"sync_every": semi_synchronous,
                                      "outer_lr": ("plugins.ft.mode=diloco", lambda options, _: options.mode == "diloco"),
                                      "outer_momentum": ("plugins.ft.mode=diloco",
                                                         lambda options, _: options.mode == "diloco")})

    @hookimpl
    def validate(self, plugin_config):
        """ft: the lighthouse answers, within the connect timeout (else one line before any worker starts)."""
        address = lighthouse_address(plugin_config)
        reason = lighthouse_unreachable(address, min(plugin_config.connect_timeout_s, 5.0))
        if reason is not None:
            raise ConfigError(f"{FIELD}.lighthouse", reason, "start the lighthouse first (torchft_lighthouse "
                              "--min_replicas 1 --join_timeout_ms 10000), or point plugins.ft.lighthouse at it")

    @hookimpl
    def wrap_optimizer(self, optimizer, state, mesh, config, plugin_config, plan):
        """ft: this group's manager joins the lighthouse; sync steps commit through it, local_sgd and diloco
        synchronize from the optimizer's step."""
        self.state, mode = state, plugin_config.mode
        self.digests = digests(shared_parts(config, plan, list(plugin_config.may_differ)))
        self.weights = [dict(part.state_dict()) for part in state.model_parts]
        self.exits.enter_context(library_logs_at_debug(*TORCHFT_LOGGERS))
        timeout, quorum_timeout, connect_timeout = (timedelta(seconds=float(plugin_config[name]))
                                                    for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"))
        self.store, host, port = group_store()
        self.manager = Manager(
            pg=ProcessGroupNCCL() if mesh.device_type == "cuda" else ProcessGroupGloo(timeout=timeout),
            load_state_dict=self.load_peer_state, state_dict=self.peer_state,
            min_replica_size=plugin_config.min_replicas, use_async_quorum=mode == "sync",
            timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=connect_timeout, rank=dist.get_rank(), world_size=dist.get_world_size(),
            store_addr=host, store_port=port, lighthouse_addr=lighthouse_address(plugin_config),
            replica_id=f"titan_group_{plugin_config.replica_group}", init_sync=False,
            checkpoint_transport=quiet_http_transport(timeout))
        if self.restored is not None:
            self.manager.load_state_dict(self.restored)
        if mode == "sync":
            self.steps = CommittedSteps(self.manager, optimizer)
            return self.steps
        # LocalSGD and DiLoCo start each synchronization's quorum themselves: the groups compare their parts there,
        # as the quorum is formed, before the weights' all-reduces.
        start_quorum = self.manager.start_quorum

        def start_quorum_and_agree(*args, **kwargs):
            start_quorum(*args, **kwargs)
            self.agree(plugin_config)
        self.manager.start_quorum = start_quorum_and_agree  # type: ignore[method-assign]
        model = nn.ModuleList(state.model_parts)
        if mode == "local_sgd":
            self.exits.enter_context(LocalSGD(self.manager, model, state.optimizer, plugin_config.sync_every))
        else:
            outer = torch.optim.SGD(model.parameters(), lr=plugin_config.outer_lr,
                                    momentum=plugin_config.outer_momentum, nesterov=True)
            self.exits.enter_context(DiLoCo(self.manager, [model], state.optimizer, outer, plugin_config.sync_every))
        return None

    @hookimpl
    def after_backward(self, model_parts, plugin_config):
        """ft (sync): the groups' parts compared, then the gradients averaged over the groups in the quorum."""
        if plugin_config.mode == "sync":
            self.agree(plugin_config)
            average_across_groups(self.manager, [local(p.grad) for part in model_parts for p in part.parameters()
                                                 if p.grad is not None])

    def agree(self, plugin_config) -> None:
        """The groups in the quorum run the same job, or this one stops in one line (:mod:`titan_ft.agreement`)."""
        assert self.manager is not None  # called once wrap_optimizer made it
        check_agreement(self.manager, self.digests, plugin_config.replica_group, plugin_config.group_count, self.warned)

    @hookimpl
    def step_metrics(self):
        """ft: the groups in the last quorum; what the groups committed (steps under sync, synchronizations under
        local_sgd and diloco); the steps no quorum committed (sync)."""
        manager = self.manager
        assert manager is not None  # wrap_optimizer made it before the first step
        return {"ft_groups": float(manager.num_participants()), "ft_commits": float(manager.current_step()),
                "ft_skipped_steps": float(self.steps.skipped if self.steps else 0)}

    @hookimpl
    def on_train_end(self):
        """ft: the manager leaves the quorum (its servers stop) and torchft's records go back to their loggers."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        self.exits.close()

    def state_dict(self) -> dict[str, int]:
        """The manager's counters (steps committed, batches), checkpointed with the run."""
        if self.manager is not None:
            return self.manager.state_dict()
        return dict(self.restored or {"step": 0, "batches_committed": 0})

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.restored = {key: int(value) for key, value in state.items()}

    def peer_state(self) -> dict[str, Any]:
        """What a recovering group's same rank loads: this rank's shards of the whole training state."""
        state = self.state
        assert state is not None  # torchft calls it only once wrap_optimizer has handed it the state
        return {"model": [localized(weights) for weights in self.weights],
                "optimizer": localized(state.optimizer.state_dict()),
                "lr_scheduler": state.lr_scheduler.state_dict(), "dataloader": state.dataloader.state_dict(),
                "plugins": {name: localized(plugin.state_dict()) for name, plugin in state.plugins.items()},
                "step": state.step, "rng": torch.get_rng_state()}

    def load_peer_state(self, received: dict[str, Any]) -> None:
        """A peer's state in place (torchft calls it as this group's first step commits)."""
        state = self.state
        assert state is not None  # torchft calls it only once wrap_optimizer has handed it the state
        for weights, peers in zip(self.weights, received["model"]):
            for name, tensor in weights.items():
                local(tensor).copy_(peers[name])
        params = [p for group in state.optimizer.param_groups for p in group["params"]]
        optimizer = received["optimizer"]
        optimizer["state"] = {index: {key: like(params[index], value) if getattr(value, "shape", None) == local(params[index]).shape
                                      else value for key, value in slots.items()}
                              for index, slots in optimizer["state"].items()}
        state.optimizer.load_state_dict(optimizer)
        state.lr_scheduler.load_state_dict(received["lr_scheduler"])
        state.dataloader.load_state_dict(received["dataloader"])
        for name, plugin in state.plugins.items():
            if name in received["plugins"]:
                plugin.load_state_dict(like(plugin.state_dict(), received["plugins"][name]))
        state.step = int(received["step"])
        torch.set_rng_state(received["rng"])
