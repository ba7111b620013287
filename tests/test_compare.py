"""``python -m titan_core.compare``: real runs side by side, a regression check, plots, bad folders."""

import json
import subprocess
import sys

import pytest

from titan_core.testing import TINY, run_job


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three tiny runs: ``same`` differs from ``base`` in an option that leaves the losses alone, ``faster``
    in the learning rate."""
    folder = tmp_path_factory.mktemp("runs")
    overrides = {"base": [], "same": ["metrics.tensorboard=true"], "faster": ["optimizer.lr=3e-3"]}
    return {name: run_job([*TINY, *extra], folder / name) for name, extra in overrides.items()}


def compare(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_core.compare", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_the_table_has_each_runs_numbers_and_what_differs(runs):
    completed = compare(runs["base"].run_dir, runs["faster"].run_dir, "--json")
    assert completed.returncode == 0, completed.stderr
    rows = json.loads(completed.stdout)
    for row, name in zip(rows, ("base", "faster")):
        assert row["final_loss"] == runs[name].losses[-1] and row["min_loss"] == min(runs[name].losses)
        assert row["steps"] == 5 and row["plan"] == "world 1: single process"
        assert row["versions"]["torch"]
    assert [row["differs"] for row in rows] == ["optimizer.lr=1e-3", "optimizer.lr=3e-3"]
    text = compare(runs["base"].run_dir, runs["faster"].run_dir).stdout
    assert text.splitlines()[0].split()[:3] == ["run", "steps", "final"]
    assert f"{runs['faster'].losses[-1]:.4f}" in text and "optimizer.lr=3e-3" in text


def test_assert_equal_passes_equal_curves_and_fails_others(runs):
    equal = compare(runs["base"].run_dir, runs["same"].run_dir, "--assert-equal")
    assert equal.returncode == 0 and "largest loss difference 0 at step" in equal.stdout, equal.stdout
    moved = compare(runs["base"].run_dir, runs["faster"].run_dir, "--assert-equal", "--tol", "1e-6")
    assert moved.returncode == 1 and "beyond --tol 1e-06" in moved.stdout, moved.stdout
    difference = max(abs(a - b) for a, b in zip(runs["base"].losses, runs["faster"].losses))
    assert f"largest loss difference {difference:.3g}" in moved.stdout
    loose = compare(runs["base"].run_dir, runs["faster"].run_dir, "--assert-equal", "--tol", "1")
    assert loose.returncode == 0, loose.stdout


def test_a_plot_is_written(runs, tmp_path):
    completed = compare(runs["base"].run_dir, runs["faster"].run_dir, "--plot", tmp_path / "curves.png")
    assert completed.returncode == 0, completed.stderr
    png = (tmp_path / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_the_plot_draws_the_mean_loss_labelled_by_what_differs_and_amounts_from_zero(runs, tmp_path):
    from titan_core.tools.compare import plot, read_run

    figure = plot([read_run(runs[name].run_dir) for name in ("base", "faster")], tmp_path / "curves.png",
                  ["loss", "validation_loss", "tokens_per_s_per_device"])
    loss, speed = figure.axes  # no empty panel for the validation loss neither run logged
    assert [line.get_label() for line in loss.get_lines()] == ["optimizer.lr=1e-3", "optimizer.lr=3e-3"]
    assert list(loss.get_lines()[1].get_ydata()) == [m["loss_avg"] for m in runs["faster"].metrics]
    assert speed.get_ylim()[0] == 0
    # The legend below the panels (not over a curve), the steps whole numbers.
    assert loss.get_legend() is None and [t.get_text() for t in figure.legends[0].get_texts()] == [
        "optimizer.lr=1e-3", "optimizer.lr=3e-3"]
    assert all(float(tick).is_integer() for tick in loss.get_xticks())


def test_what_is_not_a_run_is_one_line(tmp_path):
    completed = compare(tmp_path)
    assert completed.returncode == 2
    assert completed.stderr.strip().startswith(f"titan-core: error: {tmp_path}: is neither a run dir (metrics.jsonl, "
                                               "config.yaml) nor a multirun folder (multirun.yaml); fix: name the ")


def test_what_differs_is_what_the_runs_set_to_other_values():
    """An override to the value another run takes by default differs from nothing (read from the resolved configs);
    the plugins a run enables, and settings whose values differ, are listed as the run's own command line wrote
    them, or with its value where it left them."""
    from titan_core.tools.compare import Run, differing

    config = {"model": {"name": "llama3"}, "optimizer": {"lr": 0.001}, "plugins": {}}
    default = Run("a", overrides=["model=tiny"], config=config)
    explicit = Run("b", overrides=["model=tiny", "optimizer.lr=1e-3"], config=config)
    assert differing([default, explicit]) == ["", ""]
    sharded = Run("c", overrides=["model=tiny", "+plugins=[fsdp]", "optimizer.lr=3e-3"],
                  config={**config, "optimizer": {"lr": 0.003}, "plugins": {"fsdp": {"degree": -1}}})
    assert differing([default, sharded]) == ["plugins=[] optimizer.lr=0.001", "plugins=[fsdp] optimizer.lr=3e-3"]


def test_versions_and_commits_that_differ_are_shown():
    from titan_core.tools.compare import Run, differing

    before = Run("a", overrides=["model=tiny"], code=["torch==2.13.0", "titan-fsdp==0.1.0", "git 0123456789"])
    after = Run("b", overrides=["model=tiny"], code=["torch==2.13.0", "titan-fsdp==0.2.0", "git 0123456789 (dirty)"])
    assert differing([before, after]) == ["titan-fsdp==0.1.0 git 0123456789",
                                          "titan-fsdp==0.2.0 git 0123456789 (dirty)"]
