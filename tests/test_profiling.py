"""``metrics.profile_steps``: a trace and a memory record per rank, of the window's steps only."""

import json
import re

import pytest

from titan_core.testing import TINY, run_job


@pytest.mark.slow
def test_a_window_of_steps_gives_each_rank_a_trace_and_a_memory_record(tmp_path):
    job = run_job([*TINY, "+plugins=[fsdp]", "plugins.fsdp.degree=2", "metrics.profile_steps=[2,3]"], tmp_path)
    assert "profiler_st" not in job.stdout + job.stderr  # kineto's lines at each start and stop: noise to a user
    for rank in (0, 1):
        trace = json.loads((tmp_path / "profile" / f"rank{rank}.trace.json").read_text())
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names  # the window only
        assert "aten::mm" in names or "aten::addmm" in names  # the model's matmuls
        assert any("all_gather" in name for name in names)  # FSDP's collectives
        records = [json.loads(line) for line in (tmp_path / "profile" / f"rank{rank}.memory.jsonl").open()]
        assert [r["step"] for r in records] == [2, 3]
        held = re.search(r"([\d.]+)M parameters held locally", (tmp_path / "logs" / f"rank{rank}.log").read_text())
        for record in records:
            # This rank's half of the fp32 weights and as many gradients; AdamW's two states of the same size.
            assert record["parameters_gib"] == pytest.approx(float(held[1]) * 1e6 * 4 / 2**30, rel=0.01)
            assert record["gradients_gib"] == pytest.approx(record["parameters_gib"], rel=0.01)
            assert record["optimizer_state_gib"] == pytest.approx(2 * record["parameters_gib"], rel=0.01)
            assert 0.1 < record["rss_gib"] < 2 * record["peak_rss_gib"]
