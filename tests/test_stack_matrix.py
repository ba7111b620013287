"""The generated stack matrix: every feasible pair of option values is in some stack, and a covering subset
of it trains right or is refused before launch (bench/stack_matrix.py runs all of it)."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("stack_matrix", Path(__file__).resolve().parents[1] / "bench" /
                                              "stack_matrix.py")
matrix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(matrix)
ROWS = matrix.stacks()
# The CI subset: the stacks of at most 4 ranks (the 8-rank ones run in the bench) with some plugin (a bare
# model is the reference run itself), but for those compiling a pipeline, which pay compile once per stage
# and schedule (70-90 s each; compile x pp stays in CI through tests/test_stacks.py and the compile plugin's
# tests), and for those of context parallel and a pipeline schedule alone (cp's rotate methods x the
# schedules: the pp and cp plugins' own tests cover both sides, the bench every pair), and for those saving and
# resuming under a pipeline (two runs each, 30-37 s: resuming across pipeline plans is the checkpoint plugin's own
# test, tests/test_preemption.py resumes after a signal, the bench runs every schedule with save-resume).
SMALL = [row for row in ROWS if matrix.world(row) <= 4 and any(plugins for _, _, plugins in row[1:])
         and not {"compile", "pp"} <= (plugins := {label.split("-")[0] for label, _, _ in row[2:] if label != "-"})
         and plugins != {"cp", "pp"} and not {"save", "pp"} <= plugins]


def test_every_feasible_pair_is_in_some_stack():
    assert not matrix.uncovered_pairs(ROWS)
    assert all(matrix.world(row) <= matrix.MAX_RANKS for row in ROWS)
    labels = {label for row in ROWS for label, _, _ in row}
    assert {"pp-DualPipeV", "hsdp", "simplefsdp", "cp-alltoall", "float8-rowwise", "qwen3", "deepseek-v3", "gpt-oss",
            "chunked-loss", "block-causal", "save-resume", "ep"} <= labels
    # Expert parallel only beside a model with experts: elsewhere its refusal would hide the other plugins.
    for labels in ({label for label, _, _ in row} for row in ROWS):
        assert "ep" not in labels or labels & matrix.MODELS_WITH_EXPERTS, labels


@pytest.mark.slow
@pytest.mark.parametrize("row", SMALL, ids=[" ".join(label for label, _, _ in row if label != "-") for row in SMALL])
def test_stack_trains_right_or_is_refused_before_launch(row, tmp_path, titan_reference):
    verdict, diff = matrix.run_stack(row, tmp_path, titan_reference)
    print(f"{verdict} (max loss diff {diff})")
    assert verdict == "passed" or verdict.startswith("refused: "), verdict
