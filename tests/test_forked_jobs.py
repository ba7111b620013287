"""The test jobs' server (titan_core.forked_jobs): a job forked from it trains, logs and prints as the same
command line in an interpreter of its own, and one that overruns its time is killed with its workers."""

import subprocess
from pathlib import Path

import pytest
import torch

from titan_core.forked_jobs import FRESH, fresh_interpreter
from titan_core.testing import TINY, run_job


def _descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while listed
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found, todo = found + below, todo + below
    return found


@pytest.mark.slow
def test_a_forked_job_trains_and_prints_as_in_its_own_interpreter(tmp_path, monkeypatch):
    job = [*TINY, "+plugins=[fsdp]", "plugins.fsdp.degree=2"]
    forked = run_job(job, tmp_path / "forked")
    monkeypatch.setenv(FRESH, "1")
    fresh = run_job(job, tmp_path / "fresh")
    assert forked.losses == fresh.losses and len(forked.losses) == 5
    for name, tensor in fresh.final_weights().items():
        assert torch.equal(forked.final_weights()[name], tensor), name
    # The same lines, but for the clock and the run dir.
    def lines(result):
        return [line.split("]", 1)[-1].replace(str(result.run_dir), "RUN") for line in result.stdout.splitlines()
                if "tok/s" not in line]
    assert lines(forked) == lines(fresh) and forked.stderr == fresh.stderr == ""


@pytest.mark.skipif(fresh_interpreter() or not Path("/proc/self/stat").exists(),
                    reason="a server's jobs, listed through /proc")
def test_a_forked_job_that_overruns_is_killed_with_its_workers(tmp_path):
    from titan_core import testing
    with pytest.raises(subprocess.TimeoutExpired):
        run_job([*TINY, "+plugins=[fsdp]", "plugins.fsdp.degree=2", "training.steps=100000"], tmp_path, timeout=15)
    assert _descendants(testing._FORKED_JOBS._server.pid) == []
    assert len(run_job([*TINY, "training.steps=1"], tmp_path / "next").losses) == 1  # the server serves on
