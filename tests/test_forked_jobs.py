"""The test jobs' server (titan_core.forked_jobs): a job forked from it trains, logs and prints as the same
command line in an interpreter of its own; one that overruns its time, or whose server is stopped, is killed
with its workers."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from titan_core import testing
from titan_core.forked_jobs import FRESH, ForkedJobs, fresh_interpreter
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


@pytest.mark.slow
@pytest.mark.skipif(fresh_interpreter() or not Path("/proc/self/stat").exists(),
                    reason="a server's jobs, listed through /proc")
def test_a_forked_job_that_overruns_is_killed_with_its_workers(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_job([*TINY, "+plugins=[fsdp]", "plugins.fsdp.degree=2", "training.steps=100000"], tmp_path, timeout=15)
    assert _descendants(testing._FORKED_JOBS._server.pid) == []
    assert len(run_job([*TINY, "training.steps=1"], tmp_path / "next").losses) == 1  # the server serves on


@pytest.mark.slow
def test_what_the_imports_print_opens_each_jobs_output_as_in_a_fresh_interpreter(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nprint('said at start')\nprint('warned at start', file=sys.stderr)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    arguments = [*TINY, "training.steps=1"]
    jobs = ForkedJobs()  # started under this environment
    forked = jobs.run([*arguments, f"hydra.run.dir={tmp_path / 'forked'}"], dict(os.environ), timeout=300)
    fresh = subprocess.run([sys.executable, "-m", "titan_core.run", *arguments, f"hydra.run.dir={tmp_path / 'fresh'}"],
                           capture_output=True, text=True, timeout=300)
    assert forked.returncode == fresh.returncode == 0
    assert forked.stderr == fresh.stderr == "warned at start\n"
    assert forked.stdout.startswith("said at start\n") and fresh.stdout.startswith("said at start\n")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="lists processes through /proc")
def test_a_stopped_server_stops_the_job_it_runs(tmp_path):
    jobs = ForkedJobs()
    jobs.run([*TINY, "training.steps=0", f"hydra.run.dir={tmp_path / 'warm'}"], dict(os.environ), timeout=300)
    long_job = threading.Thread(target=lambda: pytest.raises(RuntimeError, jobs.run, [
        *TINY, "+plugins=[fsdp]", "plugins.fsdp.degree=2", "training.steps=100000", f"hydra.run.dir={tmp_path}"],
        dict(os.environ), 300))
    long_job.start()
    while not (tmp_path / "logs" / "rank1.log").exists():  # its workers run
        time.sleep(0.2)
    job_processes = _descendants(jobs._server.pid)
    jobs._server.terminate()  # as Ctrl-C or a stopped CI run would
    long_job.join(60)
    assert len(job_processes) >= 3 and not long_job.is_alive()
    time.sleep(1)
    assert [pid for pid in job_processes if _running(pid)] == []


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a killed process waiting to be reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
