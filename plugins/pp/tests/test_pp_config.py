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


# 1F1B at pp 2 over 4 micro-batches, as its rows run (an empty cell is an idle slot).
ONE_F_ONE_B = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"


def schedule_file(tmp_path, text: str) -> str:
    path = tmp_path / "schedule.csv"
    path.write_text(text)
    return str(path)


def test_a_schedule_file_sets_the_stages_and_the_planners_bubble(tmp_path):
    """A file of 1F1B's actions makes 1F1B's layout (2 stages, 4 micro-batches) and, run action by action, its
    bubble: (degree - 1) / (micro-batches + degree - 1) of the step. A file of 4 stages in a loop makes 2 stages a
    rank; one ordering its forwards first (GPipe-like) idles longer than 1F1B's."""
    from titan_pp.csv_schedule import bubble, read_schedule

    one_f_one_b = schedule_file(tmp_path, ONE_F_ONE_B)
    built = layout(n_layers=4, schedule_csv=one_f_one_b, microbatches=4)
    assert (built.num_stages, built.stages_per_rank, built.microbatches) == (2, 1, 4)
    assert bubble(read_schedule(one_f_one_b)) == pytest.approx(1 / 5)
    looped = tmp_path / "looped.csv"
    looped.write_text("0F0,0F1,2F0,2F1,2B0,2B1,0B0,0B1\n1F0,1F1,3F0,3F1,3B0,3B1,1B0,1B1\n")
    built = layout(n_layers=4, schedule_csv=str(looped), microbatches=2)
    assert (built.num_stages, built.stages_per_rank, built.stages_of(1)) == (4, 2, [1, 3])
    everything_first = tmp_path / "gpipe.csv"
    everything_first.write_text("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n")
    assert bubble(read_schedule(str(everything_first))) == pytest.approx(1 / 5)  # the same idle share, more kept
    late = tmp_path / "late.csv"
    late.write_text("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1F1,1F2,1F3,1B3,1B2,1B1,1B0\n")
    assert bubble(read_schedule(str(late))) > 1 / 5


@pytest.mark.parametrize("text, options, message", [
    (None, {}, "is not a file"),
    ("0F0,0B0\n", {"microbatches": 1}, "has 1 rows (pipeline ranks) for pp degree 2; fix: set plugins.pp.degree=1"),
    ("0F0,0X0\n1F0,1B0\n", {}, "row 1, column 2: '0X0' is not a compute action"),
    ("0F0,0SEND_F0\n1F0,1B0\n", {}, "row 1, column 2: '0SEND_F0' is not a compute action"),
    ("0F0,1F0,0B0\n1B0\n", {"microbatches": 1}, "stage 1 runs on rank 0 and on rank 1"),
    ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", {}, "stage 0 runs micro-batch 1 forward 1 time(s) and backward 0 time(s) "
                                           "whole, 0 and 0 in halves"),
    ("0F0,0F0,0B0\n1F0,1B0\n", {"microbatches": 1}, "stage 0 runs micro-batch 0 forward 2 time(s)"),
    ("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n", {}, "the ranks would wait on each other for ever: rank 0 at 0B0, rank 1 "
                                              "at 1F1"),
    ("0B0,0F0\n1F0,1B0\n", {"microbatches": 1}, "the ranks would wait on each other for ever: rank 0 at 0B0"),
    (ONE_F_ONE_B, {"microbatches": 2}, "runs 4 micro-batches and the options make 2; fix: set "
                                       "plugins.pp.microbatches=4"),
    ("0F0,1F0,2F0,3F0,3B0,2B0,1B0,0B0\n\n", {"microbatches": 1}, "runs stages [0, 1, 2, 3] on rank 0, where the "
                                                                 "V placement puts [0, 3]"),
    ("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n", {"microbatches": 1}, "runs stages [0, 1] on rank 0, where the loop "
                                                                "placement puts [0, 2]"),
], ids=["missing", "rows", "cell", "comms", "two-ranks", "no-backward", "twice", "deadlock", "own-order",
        "microbatches", "empty-row", "placement"])
def test_a_schedule_file_that_cannot_run_is_one_line(tmp_path, text, options, message):
    """Each found before launch, from the file alone and the options (torch's own check raises a page-long
    assertion, or hangs the ranks)."""
    path = str(tmp_path / "missing.csv") if text is None else schedule_file(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        layout(n_layers=4, schedule_csv=path, **options)
    assert error.value.field == "plugins.pp.schedule_csv" and message in str(error.value), str(error.value)


def test_a_schedule_named_beside_a_schedule_file_is_refused(tmp_path):
    result = run_job([*TINY, "launch.dry_run=true", "+plugins=[pp]", "plugins.pp.schedule=GPipe",
                      "plugins.pp.microbatches=4", f"plugins.pp.schedule_csv={schedule_file(tmp_path, ONE_F_ONE_B)}"],
                     tmp_path / "run", expect_success=False)
    assert "plugins.pp.schedule: GPipe does nothing unless plugins.pp.schedule_csv=null" in error_line(result)
