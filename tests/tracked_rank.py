"""Peak memory by torch's memory tracker over one real training step of a plan, on one rank.

Imported by tests/test_planner_*.py, which runs it in its own process under a fake process group (rank 0 of any
plan; the other ranks' collectives move nothing but make their results at full size). Run as a script, it
forks the N ranks of a real gloo world, each of which tracks its own step and writes ``<out>/rank<r>.json``: the
way to track plans whose ranks exchange what a fake group cannot make up (a pipeline's stages send each other
activations; on fake tensors a first stage runs alone, the harness making up what its neighbour sends). Forked,
the ranks share this process's imports (torchrun started each as a new interpreter, about 8 s of a core).

    python tests/tracked_rank.py N OUT [--calls] OVERRIDE...

With ``--calls`` each rank writes instead the collectives it issues in its second step (``{"calls": n}``): the
way to count the calls of collectives whose sizes come from another rank (expert parallel's all-to-all).
"""

import collections
import contextlib
import functools
import gc
import importlib
import itertools
import json
import os
import signal
import sys
import traceback
import types
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import _utils as pipeline_utils
from torch.distributed.pipelining import schedules as pipeline_schedules
from torch.distributed.pipelining import stage as pipeline_stage
from torch.distributed.tensor import DTensor, _sharding_prop
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.experimental._context_parallel import _attention as ring_attention
from torch.utils._python_dispatch import TorchDispatchMode

from titan_core import PP, attention, canonical_name, objective
from titan_core.mesh import ParallelMesh
from titan_core.moe.routing import ExpertRouting, rank_load
from titan_core.plugins import Hooks, Registry, build_plan
from titan_core.planner.facts import OperatorCounter
from titan_core.testing import compose
from titan_core.train import build_model_parts, build_training_step
from titan_pp.plugin import TracelessStage


class _ModTracker(ModTracker):
    """torch's module tracker, without its gradient hooks on a module's inputs. Under a backward split in two
    (zero-bubble pipeline schedules) those hooks keep each micro-batch's graph, and so its activations, alive
    until the step ends (a ZBV rank tracked at 6.2 MB peaks at 4.0 MB of the step's own allocations), and they
    refuse a stage's received activations, leaf tensors autograd.grad differentiates. The tracker then learns
    that backward left a module when the step's backward ends: its categories and totals are unchanged."""

    def _fw_pre_hook(self, module, inputs):
        super()._fw_pre_hook(module, ())


_NO_HOOK = types.SimpleNamespace(remove=lambda: None)


class Tracker(MemTracker):
    """torch's tracker, letting a whole model part run forward several times in a step (once per micro-batch:
    accumulation, a pipeline stage), which it refuses as a second iteration: the part's own record starts
    again, the peak by category stays."""

    def __init__(self):
        super().__init__()
        self._mod_tracker = _ModTracker()

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        # torch's tracker hooks every parameter's gradient, and a frozen one (LoRA's base) refuses a hook: it makes
        # no gradient to count.
        for parameter in module.parameters():
            if not parameter.requires_grad:
                self._param_to_grad_hook_handles.setdefault(parameter, (_NO_HOOK, _NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _pre_fw_hook(self, module, inputs):
        modules = self._mod_tracker
        if not modules.is_bw and set(modules.parents) - {modules.get_known_fqn(module)} == {"Global"}:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)


COMPUTE = "compute"


class RecordingTracker(Tracker):
    """torch's tracker, also writing down each allocation and free as it counts them: ``events`` holds
    ``("alloc", key, bytes, stream)`` and ``("free", key)``; ``stream`` is the name of the FSDP2 stream current
    when it was made (``COMPUTE`` outside them)."""

    def __init__(self, streams: dict[int, str]):
        super().__init__()
        self.events: list[tuple] = []
        self._keys: dict[int, int] = {}
        self._streams = streams
        self._current = [COMPUTE]

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
        # A resized storage (FSDP2 frees and refills its gathered weights so) is a free and a new allocation.
        if u_type in (_UpdateType.DEL, _UpdateType.SIZE) and id(winfo) in self._keys:
            self.events.append(("free", self._keys.pop(id(winfo))))
        if u_type in (_UpdateType.ADD, _UpdateType.SIZE) and winfo.mem_consumed:
            self._keys[id(winfo)] = len(self.events)
            self.events.append(("alloc", len(self.events), winfo.mem_consumed, self._current[-1]))
        return super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    @contextlib.contextmanager
    def streams_named(self):
        """FSDP2 makes its streams current with the device module's ``stream`` context (a no-op on a CPU): while
        one of ``streams`` is, what is allocated is allocated on it."""
        original = torch.cpu.stream

        @contextlib.contextmanager
        def named(stream):
            self._current.append(self._streams.get(id(stream), COMPUTE))
            try:
                with original(stream):
                    yield
            finally:
                self._current.pop()
        torch.cpu.stream = named
        try:
            yield self
        finally:
            torch.cpu.stream = original


def fsdp_streams(parts) -> dict[int, str]:
    """FSDP2's own streams in these model parts, by identity: its all-gathers' and its reductions'."""
    names = {"all_gather_copy_in_stream": "all-gather", "all_gather_stream": "all-gather",
             "reduce_scatter_stream": "reduce-scatter", "all_reduce_stream": "reduce-scatter"}
    streams = {}
    for part in parts:
        for module in part.modules():
            state = getattr(module, "_get_fsdp_state", lambda: None)()
            context = getattr(state, "_comm_ctx", None)
            for attribute, name in names.items():
                if hasattr(context, attribute):
                    streams[id(getattr(context, attribute))] = name
    return streams


def tracked_step(config, registry, plan, fake_tensors: bool = False, allocations: list | None = None) -> dict:
    """Peak bytes by category over the second training step of this rank (the optimizer's states exist from the
    first on), the core's schedule and the plugins' transforms run as in a worker, in the process group already
    initialized. Every tensor the plan's build and first step left alive is counted, not only the model's and
    the optimizer's (a pipeline stage's receive buffers are made in its first step and kept). With
    ``fake_tensors`` no tensor holds memory (a GPU-sized model on this machine): the tracker counts their sizes
    all the same. ``expert_load``: the rows this rank's experts computed per copy it routed in that step (what
    the plan command's ``--expert-load`` takes; 0 without the core's MoE layer), ``expert_load_peak``: the same
    over that step's busiest micro-batch, as the model plugin's object measured it (``--expert-load-peak``).
    ``allocations``, when given, receives the allocations alive before the step and the step's own events, as
    :class:`RecordingTracker` writes them (what ``allocator_replay.replay`` takes)."""
    attention._positions_mask.cache_clear()  # as in a job's process: its masks are made by its first step
    before = _alive_tensors()
    fake = FakeTensorMode(allow_non_fake_inputs=True) if fake_tensors else contextlib.nullcontext()
    with _as_in_a_real_run(plan) if fake_tensors else contextlib.nullcontext():
        parts, optimizer, step = _training_step(config, registry, plan, fake)
        with fake:
            step()
            rank_load(parts)  # the first step's, left out
            for routing in _routing(registry):
                routing.micro_batch_loads.peak = 0.0
            recording = allocations is not None
            tracker = RecordingTracker(fsdp_streams(parts)) if recording else Tracker()
            kept = [t for i, t in _alive_tensors().items() if i not in before]
            tracker.track_external(*kept, *parts, optimizer)  # the parts and optimizer name the categories they know
            del kept  # the tracker holds weak references: the step frees what it frees (last step's gradients)
            if recording:
                laid = len(tracker.events)
            with tracker, tracker.streams_named() if recording else contextlib.nullcontext():
                step()
            if recording:
                allocations += [tracker.events[:laid], tracker.events[laid:]]
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    converted = sum("Float8" in type(m).__name__ for part in parts for m in part.modules())
    return {getattr(kind, "name", kind): nbytes for kind, nbytes in peak.items()} | {
        "float8_linears": converted, "expert_load": rank_load(parts),
        "expert_load_peak": max((r.micro_batch_loads.peak for r in _routing(registry)), default=0.0)}


@contextlib.contextmanager
def _as_in_a_real_run(plan):
    """Under fake tensors, what torch does on the side made as in a real step. A device mesh computes its
    coordinates on real tensors (``nonzero`` on its rank map has no fake result); DTensor's sharding propagation
    makes its tensors of the global shape in a fake mode of its own, as it does when none is active (in the
    step's, the tracker would count them: five float32 tensors of 70B's whole-vocabulary logits under loss
    parallel, 18 GiB tracked where a real step of two blocks allocates 5). A pipeline's first stage, alone on a
    fake process group, makes up what its neighbour would send it: the schedule's warm-up vote runs on real
    tensors (it reads the vote), the gradients' metadata the next stage sends are this stage's outputs' (the next
    stage's inputs), and the stage does not compare its buffers after shape inference (fake ones hold no values)."""
    init = DeviceMesh.__init__
    warmup = pipeline_schedules._PipelineSchedule._warmup_p2p
    infer_backward = pipeline_stage.PipelineStage._backward_metadata_inference

    def init_on_real_tensors(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def warmup_on_real_tensors(self, *args, **kwargs):
        with unset_fake_temporarily():
            return warmup(self, *args, **kwargs)

    def infer_backward_from_outputs(self, *args, **kwargs):
        self.outputs_for_meta = self._fwd_outputs_for_bwd_meta
        return infer_backward(self, *args, **kwargs)

    def outputs_gradient_meta(self, stage):
        return pipeline_utils._StageBackwardMeta(pipeline_utils._derive_grad_metas(
            pipeline_utils.extract_tensor_metas(tuple(self.outputs_for_meta))))
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(DeviceMesh, "__init__", init_on_real_tensors))
        patches.enter_context(mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args: None))
        if PP in plan.mesh_shape:
            patches.enter_context(mock.patch.object(pipeline_schedules._PipelineSchedule, "_warmup_p2p",
                                                    warmup_on_real_tensors))
            patches.enter_context(mock.patch.object(pipeline_stage.PipelineStage, "_backward_metadata_inference",
                                                    infer_backward_from_outputs))
            patches.enter_context(mock.patch.object(pipeline_stage.PipelineStage, "_recv_meta",
                                                    outputs_gradient_meta))
            patches.enter_context(mock.patch.object(TracelessStage, "_buffers_kept",
                                                    lambda self: contextlib.nullcontext()))
        yield


def _routing(registry) -> list[ExpertRouting]:
    return [plugin for plugin in registry.stateful().values() if isinstance(plugin, ExpertRouting)]


def _collective(operator) -> bool:  # waits and autograd's wrappers are not calls
    return (operator.namespace in ("c10d", "_c10d_functional")
            and operator.__name__.split(".")[0] not in ("wait_tensor", "_wrap_tensor_autograd"))


def forget_meshes() -> None:
    """Forget the device meshes DTensor cached, once their world is destroyed. A mesh equals another of the same
    ranks and names whatever its process groups, so a later world in this process would find the sharding
    propagation's cached results, with the earlier mesh in them, whose group names now point at that world's other
    groups (a reduce-scatter over a one-rank group: tp's stream left whole after an fsdp 2 x tp 2 world)."""
    _clear_sharding_prop_cache()


def collective_calls(config, registry, plan) -> int:
    """Collectives this rank issues in its second training step, context parallel's ring exchanges included."""
    operators, ring = OperatorCounter(_collective), _RingExchanges()
    _counted(config, registry, plan, operators, ring)
    return operators.calls + ring.calls


class _RingExchanges:
    """Counts the exchanges of torch's ring attention, which it issues inside DTensor's dispatch, out of a dispatch
    mode's sight: the calls of functional collectives from its module."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        self._patch = mock.patch.object(ring_attention, "ft_c", _CountedCalls(ring_attention.ft_c, self))
        self._patch.start()
        return self

    def __exit__(self, *exc):
        self._patch.stop()


class _CountedCalls:
    """A module whose functions add each call to ``counter.calls``."""

    def __init__(self, module, counter):
        self._module, self._counter = module, counter

    def __getattr__(self, name):
        found = getattr(self._module, name)
        if not isinstance(found, types.FunctionType):
            return found

        def counted(*args, **kwargs):
            self._counter.calls += 1
            return found(*args, **kwargs)
        return counted


class _CollectiveBytes(TorchDispatchMode):
    """The bytes each collective's input holds, by the collective and its dtype (a float8 tensor's by its data)."""

    def __init__(self):
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _collective(func):
            for tensor in args[0] if isinstance(args[0], (list, tuple)) else [args[0]]:
                data = getattr(tensor, "_data", tensor)
                self.bytes[f"{func.__name__.split('.')[0]} {str(data.dtype).removeprefix('torch.')}"] += (
                    data.numel() * data.element_size())
        return func(*args, **(kwargs or {}))


def collective_bytes(config, registry, plan) -> dict[str, int]:
    """Bytes of the inputs of the collectives this rank issues in its second training step, by ``"<collective>
    <dtype>"``."""
    counter = _CollectiveBytes()
    _counted(config, registry, plan, counter)
    return dict(counter.bytes)


def reduce_scatters(config, registry, plan) -> int:
    """Reduce-scatters this rank issues in its second training step."""
    counter = OperatorCounter(lambda operator: "reduce_scatter" in operator.__name__)
    _counted(config, registry, plan, counter)
    return counter.calls


def operators(config, registry, plan) -> tuple[int, int]:
    """Aten operators this rank runs in its second training step, and those of them its optimizer's step runs."""
    _, optimizer, step = _training_step(config, registry, plan)
    step()
    optimizer_step, in_optimizer = optimizer.step, OperatorCounter()

    def counted_step(*args, **kwargs):
        with in_optimizer:
            return optimizer_step(*args, **kwargs)
    optimizer.step = counted_step
    with OperatorCounter() as every:
        step()
    return every.calls, in_optimizer.calls


def linear_elements(config, registry, plan) -> dict[tuple[int, str], tuple[int, int]]:
    """Elements of the input and of the result each linear of this rank's blocks computes on in one forward, by the
    block's index and the linear's path within it (a DTensor's local ones)."""
    parts, _, step = _training_step(config, registry, plan)
    seen = {}

    def local(tensor) -> int:
        return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()

    def record(key, module, args, result):
        seen[key] = (local(args[0]), local(result))
    for part in parts:
        for index, block in plan.model.blocks_of(part).items():
            for name, module in block.named_modules():
                if isinstance(module, torch.nn.Linear):
                    # Before the hooks of tensor parallel, which redistribute the result (a row-wise one's partial sum).
                    module.register_forward_hook(functools.partial(record, (int(index), canonical_name(name))),
                                                 prepend=True)
    step()
    return seen


def _counted(config, registry, plan, *counters) -> None:
    """A first training step, then a second one under ``counters``."""
    _, _, step = _training_step(config, registry, plan)
    step()
    with contextlib.ExitStack() as counting:
        for counter in counters:
            counting.enter_context(counter)
        step()


def _training_step(config, registry, plan, tensors=contextlib.nullcontext()):
    """This rank's model parts and optimizer, built as a worker builds them (their tensors made in the
    ``tensors`` mode), and a function running one step of the worker's own ``TrainingStep`` (the loss as the
    plugins wrap it, their micro-batch contexts, the gradient event, clipping, the optimizer and its hooks)."""
    torch.manual_seed(0)
    hooks = Hooks(registry, plan, config)
    mesh = ParallelMesh(plan.mesh_shape, "cpu", plan.borrowed())
    training = config.training
    with tensors:
        parts = build_model_parts(hooks, mesh, config, torch.device("cpu"))
        training_step = build_training_step(hooks, mesh, config, parts, torch.device("cpu"), bos_id=0)
        tokens = torch.randint(0, 256, (training.global_batch_size // plan.dp_size, training.seq_len))
    steps = itertools.count(1)

    def step():
        with objective.loss_weight(1 / training_step.forwards):
            training_step(next(steps), tokens, tokens.clone())

    return parts, training_step.optimizer, step


def _alive_tensors() -> dict[int, torch.Tensor]:
    gc.collect()
    return {id(o): o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}


def main(out: Path, overrides: list[str], rank: int, world_size: int) -> None:
    calls = overrides[:1] == ["--calls"]
    overrides = overrides[calls:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(out / "store"), world_size), rank=rank,
                            world_size=world_size)
    try:
        config = compose(*overrides)
        registry = Registry(config)
        plan = build_plan(config, registry, dist.get_world_size(), 256)
        measured = ({"calls": collective_calls(config, registry, plan)} if calls
                    else tracked_step(config, registry, plan))
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(measured))
    finally:
        dist.destroy_process_group()


def fork_ranks(world_size: int, out: Path, overrides: list[str]) -> int:
    """Run ``main`` in ``world_size`` forked ranks; the exit code: 1 if any rank failed (the others, which would
    wait for it in a collective, are then stopped)."""
    importlib.import_module("torch._dynamo")  # imported at a model's first initialisation: once, for every rank
    out.mkdir(parents=True, exist_ok=True)  # the ranks' store is a file there: without the folder they wait forever
    children = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
            code = 0
            try:
                main(out, overrides, rank, world_size)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # the parent's atexit handlers are not this rank's
        children.append(pid)
    while children:
        pid, status = os.wait()
        children.remove(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            for other in children:
                os.kill(other, signal.SIGKILL)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(fork_ranks(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]))
