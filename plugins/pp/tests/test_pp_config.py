"""Stage layouts, and the errors the launcher gives before any worker starts."""

import importlib.util

import pytest
from omegaconf import OmegaConf

from titan_core import ConfigError
from titan_core.testing import TINY, error_line, run_job
from titan_pp.layout import stage_layout

DEFAULTS = OmegaConf.load(importlib.util.find_spec("titan_pp.conf").submodule_search_locations[0]
                          + "/plugins/pp.yaml").pp


def layout(n_layers=8, degree=2, **options):
    return stage_layout(OmegaConf.merge(DEFAULTS, options), n_layers, degree)


def test_even_split_one_stage_per_rank():
    got = layout(schedule="1F1B")
    assert got.blocks == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert [got.stages_of(r) for r in range(2)] == [[0], [1]]
    assert got.microbatches == 2


def test_looped_placement_wraps_around_the_ranks():
    got = layout(n_layers=12, degree=3, schedule="Interleaved1F1B")
    assert got.blocks == ((0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11))
    assert [got.stages_of(r) for r in range(3)] == [[0, 3], [1, 4], [2, 5]]


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "DualPipeV"])
def test_v_placement_puts_first_and_last_stage_on_rank_0(schedule):
    got = layout(degree=4, schedule=schedule)
    assert [got.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert got.microbatches == 8


def test_fewer_layers_on_first_and_last_stage():
    got = layout(n_layers=10, schedule="1F1B", degree=4, first_stage_fewer_layers=1, last_stage_fewer_layers=1)
    assert got.blocks == ((0, 1), (2, 3, 4), (5, 6, 7), (8, 9))


def test_layers_per_stage_sets_the_stage_count():
    got = layout(n_layers=8, schedule="LoopedBFS", layers_per_stage=1)
    assert got.stages_per_rank == 4 and len(got.blocks) == 8


@pytest.mark.parametrize("options, message", [
    (dict(schedule="Zigzag"), "plugins.pp.schedule: unknown schedule 'Zigzag'"),
    (dict(n_layers=6, schedule="Interleaved1F1B"), "6 blocks (+0 first, +0 last) do not split evenly into 4 stages"),
    (dict(schedule="1F1B", stages_per_rank=2), "1F1B runs one stage per rank, got 2"),
    (dict(schedule="DualPipeV", stages_per_rank=3), "DualPipeV needs exactly 2 stages per rank, got 3"),
    (dict(schedule="1F1B", microbatches=1), "1F1B needs at least as many micro-batches as stages (2), got 1"),
    (dict(schedule="DualPipeV", microbatches=3), "DualPipeV needs at least as many micro-batches as stages"),
    (dict(schedule="Interleaved1F1B", microbatches=5), "5 is not a multiple of 2 rounds"),
    (dict(schedule="Interleaved1F1B", placement="v"), "Interleaved1F1B runs stages in a 'loop' placement, not 'v'"),
    (dict(schedule="ZBVZeroBubble", placement="loop"), "ZBVZeroBubble runs stages in a 'v' placement, not 'loop'"),
    (dict(schedule="1F1B", first_stage_fewer_layers=10), "first/last_stage_fewer_layers take more blocks"),
    (dict(schedule="LoopedBFS", layers_per_stage=3), "plugins.pp.layers_per_stage: 8 block slots in stages of 3"),
    (dict(schedule="LoopedBFS", layers_per_stage=2, stages_per_rank=4), "4 disagrees with layers_per_stage=2"),
])
def test_bad_layouts_are_refused(options, message):
    with pytest.raises(ConfigError) as error:
        layout(**options)
    assert message in str(error.value)


@pytest.mark.parametrize("overrides, message", [
    (["plugins.pp.schedule=Interleaved1F1B", "model.n_layers=6"],
     "plugins.pp: 6 blocks (+0 first, +0 last) do not split evenly into 4 stages (2 ranks x 2)"),
    (["plugins.pp.schedule=DualPipeV", "plugins.pp.microbatches=2"],
     "plugins.pp.microbatches: DualPipeV needs at least as many micro-batches as stages (4), got 2"),
    (["plugins.pp.schedule=ZBVZeroBubble", "plugins.pp.placement=loop"],
     "plugins.pp.placement: ZBVZeroBubble runs stages in a 'v' placement, not 'loop'"),
    (["plugins.pp.microbatches=3"],
     "plugins.pp.microbatches: 8 sequences per pipeline step (global batch / data-parallel ranks / "
     "grad_accum_steps) do not split into 3 micro-batches"),
], ids=["layers", "microbatches", "placement", "batch"])
def test_launcher_refuses_bad_pipeline_before_start(tmp_path, overrides, message):
    result = run_job([*TINY, "launch.dry_run=true", "+plugins=[pp]", *overrides], tmp_path, expect_success=False)
    assert message in error_line(result)


@pytest.mark.skipif(importlib.util.find_spec("titan_compile") is None, reason="plugin compile is not installed")
def test_zero_bubble_with_compile_is_refused(tmp_path):
    result = run_job([*TINY, "launch.dry_run=true", "+plugins=[pp,compile]", "plugins.pp.schedule=ZBVZeroBubble"],
                     tmp_path, expect_success=False)
    assert "plugins.pp.schedule: ZBVZeroBubble splits backward into input and weight halves" in error_line(result)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_zero_bubble_refuses_any_plugin_providing_compile(schedule):
    from titan_core import Declaration, Plan, PlannedPlugin
    from titan_llama3.model import LlamaArgs
    from titan_llama3.plugin import describe
    from titan_pp import plugin

    config = OmegaConf.create({"model": {"n_layers": 4}, "plugins": {"pp": dict(DEFAULTS, schedule=schedule)},
                               "training": {"global_batch_size": 8, "grad_accum_steps": 1}})
    plan = Plan((PlannedPlugin("pp", "titan-pp", plugin.declare(config.plugins.pp)),
                 PlannedPlugin("my_jit", "third-party", Declaration(stage=500, provides=frozenset({"compile"})))),
                {"pp": 2}, 2, describe(LlamaArgs(n_layers=4)))
    with pytest.raises(ConfigError, match=f"{schedule} splits backward into input and weight halves"):
        plugin.validate(config=config, plugin_config=config.plugins.pp, plan=plan)
