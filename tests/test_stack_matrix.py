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
# model is the reference run itself), but for those compiling a
# pipeline, which pay compile once per stage and schedule (70-90 s each); compile x pp stays in CI through
# tests/test_stacks.py and the compile plugin's tests.
SMALL = [row for row in ROWS if matrix.world(row) <= 4 and any(plugins for _, _, plugins in row[1:])
         and not {"compile", "pp"} <= {label.split("-")[0] for label, _, _ in row}]


def test_every_feasible_pair_is_in_some_stack():
    assert not matrix.uncovered_pairs(ROWS)
    assert all(matrix.world(row) <= matrix.MAX_RANKS for row in ROWS)
    labels = {label for row in ROWS for label, _, _ in row}
    assert {"pp-DualPipeV", "hsdp", "simplefsdp", "cp-alltoall", "float8-rowwise", "qwen3", "chunked-loss", "block-causal",
            "save-resume"} <= labels


@pytest.mark.slow
@pytest.mark.parametrize("row", SMALL, ids=[" ".join(label for label, _, _ in row if label != "-") for row in SMALL])
def test_stack_trains_right_or_is_refused_before_launch(row, tmp_path, titan_reference):
    verdict, diff = matrix.run_stack(row, tmp_path, titan_reference)
    print(f"{verdict} (max loss diff {diff})")
    assert verdict == "passed" or verdict.startswith("refused: "), verdict
