"""The planner at full size: Llama 3 8B, 70B and 405B plans tracked on fake tensors, and what a GPU's caching
allocator reserves against a replay of the step's allocations (tests/allocator_replay.py)."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from titan_core.plugins import Registry, build_plan
from titan_core.planner.costs import estimate
from titan_core.planner.estimate import GIB, evaluated
from titan_core.planner.hardware import hardware_profile
from titan_core.testing import compose

# What the planner's tests share, loaded by path as tracked_rank.py is (tests/ is not on the path).
spec = importlib.util.spec_from_file_location("planner_cases", Path(__file__).with_name("planner_cases.py"))
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
CPU, allocator_replay, _tracked_step = cases.CPU, cases.allocator_replay, cases._tracked_step


def test_the_allocator_model_reuses_a_streams_freed_blocks_and_maps_pages_for_the_rest():
    """tests/allocator_replay.py's policy on a handful of requests (MiB): a freed block serves a smaller request
    of its stream, split; a request no free block fits maps 20 MiB pages behind the pool's last block; another
    stream maps its own, whatever the first stream has free."""
    mib = 2**20
    step = [("alloc", 0, 30 * mib, "compute"),  # maps 40
            ("alloc", 1, 10 * mib, "compute"),  # the rest of those 40
            ("free", 0),
            ("alloc", 2, 20 * mib, "compute"),  # in the freed 30, leaving 10 free
            ("alloc", 3, 40 * mib, "compute"),  # fits nothing free: maps 40 more
            ("alloc", 4, 10 * mib, "reduce-scatter")]  # the free 10 would fit: another stream's, so 20 more
    assert allocator_replay.replay([], step) == (80 * mib, 100 * mib, {"compute": 80 * mib, "reduce-scatter": 20 * mib})


@pytest.mark.slow
def test_llama_8b_on_8_gpus_matches_the_tracker_and_the_allocator_at_full_size():
    """The seeds' first job, Llama 3.1 8B under FSDP 8 at 2 x 8,192 tokens per rank in bf16 with TorchTitan's
    selective checkpointing, on fake tensors: what is allocated within 2% of the tracker, and what a GPU's caching
    allocator would reserve (``Estimate.reserved``) within 2% of the step's allocations replayed through a model
    of it (tests/allocator_replay.py; measured: 76.8 GiB planned, 77.4 replayed), which reserves a seventh more
    than is allocated (67.8 GiB): the all-gathers' and the reduce-scatters' streams keep their blocks, and the
    eager loss leaves the bf16 logits' room free."""
    config = compose("model=8B", "tokenizer.path=bytes", "launch.device=cpu", "training.seq_len=8192",
                     "training.global_batch_size=16", "+plugins=[fsdp,ac]", "plugins.fsdp.degree=8",
                     "plugins.fsdp.param_dtype=bfloat16", "plugins.ac.mode=selective_op",
                     "plugins.ac.matmuls=every_other")
    registry = Registry(config)
    plan = build_plan(config, registry, None, 256)
    result = dataclasses.replace(estimate(config, plan, registry, CPU), device_type="cuda")
    allocations = []
    measured = _tracked_step(config, registry, plan, fake_tensors=True, allocations=allocations)
    allocated, reserved, _ = allocator_replay.replay(*allocations)
    assert measured["Total"] > 60 * GIB
    assert allocated == pytest.approx(measured["Total"], rel=1e-3)  # the replay allocates what the tracker counts
    assert abs(sum(result.memory().values()) / measured["Total"] - 1) < 0.02
    assert reserved > 1.1 * allocated
    assert sum(result.memory().values()) < 0.9 * result.reserved()
    assert abs(result.reserved() / reserved - 1) < 0.02, (result.reserved() / GIB, reserved / GIB)


@pytest.mark.slow
def test_llama_70b_widths_under_fsdp_32_x_tp_8_match_the_tracker():
    """The seeds' 70B plan (FSDP 32 x TP 8, full checkpointing) at 70B's widths and vocabulary, two of its 80 blocks
    and 256 tokens a rank, rank 0 with real tensors (a fake process group for the other 255): within 5%. At this
    size tensor parallel's embedding backward, which makes the whole table's gradient, is most of the peak."""
    config = compose("model=70B", "model.n_layers=2", "tokenizer.path=bytes", "launch.device=cpu",
                     "training.seq_len=256", "training.global_batch_size=32", "+plugins=[fsdp,tp,ac]",
                     "plugins.fsdp.degree=32", "plugins.tp.degree=8", "plugins.ac.mode=full")
    registry = Registry(config)
    plan = build_plan(config, registry, None, 256)
    predicted = estimate(config, plan, registry, CPU).memory()
    measured = _tracked_step(config, registry, plan)
    assert measured["Total"] > 4 * GIB
    assert abs(sum(predicted.values()) / measured["Total"] - 1) < 0.05


@pytest.mark.slow
def test_llama_70b_under_fsdp_32_x_tp_8_matches_the_tracker_and_the_allocator_at_its_batch():
    """The seeds' table 4 job (70B, FSDP 32 x TP 8 with sequence and loss parallel, full checkpointing, 16 x 8,192
    tokens a rank) at 8 of its 80 blocks, on fake tensors: what is allocated within 2% of the tracker, and what a
    GPU's caching allocator would reserve within 4% of the replay (measured: 43.6 GiB planned, 44.8 replayed, 37.2
    allocated; without tp's term for the gathered input's room, 7% under). Its loss makes the peak, so the other
    72 blocks add their inputs alike (80 blocks, 5 minutes: 57.8 planned, 58.0 tracked; 65.2 and 66.3 reserved)."""
    config = compose("model=70B", "model.n_layers=8", "tokenizer.path=bytes", "launch.device=cpu",
                     "training.seq_len=8192", "training.global_batch_size=512", "+plugins=[fsdp,tp,ac]",
                     "plugins.fsdp.degree=32", "plugins.tp.degree=8", "plugins.fsdp.param_dtype=bfloat16",
                     "plugins.ac.mode=full")
    registry = Registry(config)
    plan = build_plan(config, registry, None, 256)
    result = estimate(config, plan, registry, hardware_profile("h100_sxm"))
    allocations = []
    measured = _tracked_step(config, registry, plan, fake_tensors=True, allocations=allocations)
    allocated, reserved, _ = allocator_replay.replay(*allocations)
    assert measured["Total"] > 30 * GIB
    assert abs(sum(result.memory().values()) / measured["Total"] - 1) < 0.02
    assert reserved > 1.15 * allocated
    assert abs(result.reserved() / reserved - 1) < 0.04, (result.reserved() / GIB, reserved / GIB)


@pytest.mark.slow
def test_a_405b_pipelines_first_stage_matches_the_tracker_at_its_widths():
    """Tables 5 and 6's 405B plan (FSDP 8 x TP 8 x PP 8, full checkpointing, 8 micro-batches of 4 x 8,192 tokens)
    at 16 of its 126 blocks, two a stage: the first stage alone on fake tensors (the harness makes up what the
    next stage would send it), within 5% of the tracker (measured: 24.0 GiB planned, 24.8 tracked). Its
    embedding's gradient, whole under tp, accumulates in float32 over the micro-batches: 7.8 GiB, without which it
    was planned 31% under. Replayed through the allocator's model, its reduce-scatters' stream reserves the
    gradient shards (0.51 GiB replayed, 0.49 planned; counted as nothing before, the step's gradients standing for
    them). At all 126 blocks (15 on this stage, 2 minutes): 71.6 GiB planned, 74.2 tracked; 75.7 and 81.6
    reserved."""
    config = compose("model=405B", "model.n_layers=16", "tokenizer.path=bytes", "launch.device=cpu",
                     "training.seq_len=8192", "training.global_batch_size=256", "+plugins=[fsdp,tp,pp,ac]",
                     "plugins.fsdp.degree=8", "plugins.tp.degree=8", "plugins.pp.degree=8", "plugins.pp.microbatches=8",
                     "plugins.fsdp.param_dtype=bfloat16", "plugins.ac.mode=full")
    registry = Registry(config)
    plan = build_plan(config, registry, None, 256)
    first = estimate(config, plan, registry, hardware_profile("h100_sxm")).each_rank()[0]
    allocations = []
    measured = _tracked_step(config, registry, plan, fake_tensors=True, allocations=allocations)
    assert measured["Total"] > 20 * GIB
    assert abs(sum(first.memory().values()) / measured["Total"] - 1) < 0.05
    # Reduced once a step, every gradient shard is made on the reduce-scatters' stream after the peak.
    shards = next(evaluated(nbytes, first) for _, what, nbytes, _, _ in first.memory_terms
                  if what.startswith("the reduce-scatters' stream"))
    assert shards == pytest.approx(4 * first.sharded_params())
    assert abs(allocator_replay.replay(*allocations)[2]["reduce-scatter"] / shards - 1) < 0.05
