"""Preemption: SIGTERM (a cluster taking its nodes back) or SIGINT (Ctrl-C) to the launcher stops the run after a
step every rank agrees on, saves the training state, and exits with one line and the shell's code for the signal;
the same command run again resumes there and ends equal to a run that was never interrupted."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_core.testing import TINY, compare, merged, run_job

STEPS = 30


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, read from /proc."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found |= {int(child), *descendants(int(child))}
    return found


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def survivors(pids: set[int], seconds: float = 10) -> list[int]:
    """The processes of ``pids`` still running after ``seconds`` (multiprocessing's resource tracker leaves once
    it sees its launcher gone, a moment later)."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def signalled_run(overrides: list[str], run_dir: Path, number: signal.Signals, after_step: int, cwd: Path | None = None):
    """Start the job, send ``number`` to the launcher once ``after_step`` is logged; the finished process and the
    processes it had started. With ``cwd``, the command names no run dir: ``run_dir`` is where it goes by default."""
    command = [sys.executable, "-m", "titan_core.run", *merged(overrides),
               *([] if cwd else [f"hydra.run.dir={run_dir}"])]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_step):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    started = descendants(process.pid)
    process.send_signal(number)
    stdout, stderr = process.communicate(timeout=300)
    return process, stdout, stderr, started


@pytest.mark.slow
@pytest.mark.parametrize("number, plugins, options", [
    (signal.SIGINT, "checkpoint", []), (signal.SIGTERM, "fsdp,checkpoint", ["plugins.fsdp.degree=2"])],
    ids=["ctrl-c-one-process", "sigterm-fsdp2"])
def test_a_signal_saves_and_the_same_command_resumes_equal(tmp_path, number, plugins, options):
    # interval=0: the only save before the end is the one the signal asks for.
    job = [*TINY, f"training.steps={STEPS}", f"+plugins=[{plugins}]", "plugins.checkpoint.interval=0", *options]
    reference = run_job(job, tmp_path / "whole")
    run_dir = tmp_path / "run"
    process, stdout, stderr, started = signalled_run(job, run_dir, number, after_step=3)
    assert process.returncode == 128 + number
    lines = [line for line in stderr.splitlines() if line.startswith("titan-core:")]
    assert len(lines) == 1 and lines[0].startswith(f"titan-core: stopped by {number.name} after step "), stderr
    stopped = int(lines[0].split("after step ")[1].split()[0])
    assert 3 <= stopped < STEPS
    assert f"saved {run_dir / 'checkpoints' / f'step-{stopped}'}; run the same command again to resume" in lines[0]
    assert "Traceback" not in stderr and "stopped by" not in stdout  # one line on the console
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step-{stopped}"]  # no .partial left
    assert survivors(started) == []  # no worker outlives the launcher

    resumed = run_job(job, run_dir)  # the same command, the same run dir
    assert f"continuing after step {stopped}" in resumed.stdout
    report = compare(resumed, reference)
    assert [m["step"] for m in resumed.metrics] == list(range(1, STEPS + 1))
    assert report.max_loss_diff == 0 and report.max_param_diff == 0, report


@pytest.mark.slow
def test_ctrl_c_then_the_literal_same_command_resumes_and_another_option_starts_anew(tmp_path):
    """No run dir on the command line: the run dir is named by the job's overrides (but training.steps), so the
    literal same command finds the saved step and resumes; a changed option is another run, in a folder of its own."""
    job = [*TINY, f"training.steps={STEPS}", "+plugins=[checkpoint]", "plugins.checkpoint.interval=0"]
    named = [line for line in subprocess.run([sys.executable, "-m", "titan_core.run", *merged(job),
                                              "launch.dry_run=true"], capture_output=True, text=True, cwd=tmp_path,
                                             timeout=300).stdout.splitlines() if line.startswith("titan-core: run dir")]
    default = Path(named[0].removeprefix("titan-core: run dir "))
    assert default.parent == tmp_path / "outputs" and default.name.startswith("+plugins=_checkpoint_"), default
    process, stdout, stderr, _ = signalled_run(job, default, signal.SIGINT, after_step=3, cwd=tmp_path)
    assert process.returncode == 130 and f"titan-core: run dir {default}" in stdout, stdout + stderr
    stopped = int(stderr.split("after step ")[1].split()[0])
    again = subprocess.run([sys.executable, "-m", "titan_core.run", *merged(job)], capture_output=True, text=True,
                           cwd=tmp_path, timeout=300)
    assert again.returncode == 0 and f"titan-core: run dir {default}" in again.stdout
    assert f"continuing after step {stopped}" in again.stdout
    other = subprocess.run([sys.executable, "-m", "titan_core.run", *merged(job), "optimizer.lr=2e-3",
                            "training.steps=2"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert other.returncode == 0 and "continuing after step" not in other.stdout
    assert f"titan-core: run dir {default}" not in other.stdout


def test_without_a_checkpoint_plugin_the_line_says_nothing_was_saved(tmp_path):
    process, _, stderr, _ = signalled_run([*TINY, f"training.steps={STEPS}"], tmp_path / "run", signal.SIGTERM,
                                          after_step=2)
    assert process.returncode == 143
    assert "nothing saved (no checkpoint plugin): the same command starts again from step 1" in stderr
    assert "Traceback" not in stderr and "to resume" not in stderr
    assert os.path.exists(tmp_path / "run" / "metrics.jsonl")
