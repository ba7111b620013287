"""Put runs side by side: ``python -m titan_core.compare RUN_DIR_OR_MULTIRUN_DIR... [--plot F.png]``.

A run dir is what ``python -m titan_core.run`` writes (``metrics.jsonl``, ``config.yaml``, ``run.json``); a
Hydra multirun folder (``multirun.yaml`` and one numbered run dir per job) counts as its jobs. The table
gives each run's steps, final and lowest loss, last validation loss, median tokens/s per device (the first
logged step, which includes start-up and compilation, left out), MFU, peak memory, its plan, and what differs:
the settings the runs' command lines name whose values are not the same in every run (read from each run's
resolved config, so an override to the default value differs from nothing), then the package versions and git
commit that are not the same in every run.

    --plot F.png      the loss (mean of each logged window), the validation loss and tokens/s per device (from
                      zero) against the step, a panel each (--metrics picks others), a line per run labelled by
                      the overrides that set it apart (needs matplotlib)
    --assert-equal    every run's loss curve equals the first's within --tol on the steps they share; exit 1
                      otherwise (a regression check: a refactor must not move the loss)
    --json            the rows as JSON, for scripts
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from titan_core.errors import EXIT_BAD_INPUT, ConfigError


_ABSENT = object()  # a key a run's config does not have


@dataclass
class Run:
    path: str
    losses: dict[int, float] = field(default_factory=dict)  # the last record of each logged step wins (resumes)
    records: list[dict] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    plan: str = ""
    versions: dict = field(default_factory=dict)
    code: list[str] = field(default_factory=list)  # versions and git commit, as "name==version" and "git <sha>"
    config: dict | None = None  # the resolved config.yaml

    def setting(self, key: str) -> str | None:
        """The value of setting ``key`` (an override's, ``+plugins`` as ``plugins``) in this run, as text: from its
        resolved config where it has one, else its override's text; None where the run has neither."""
        if self.config is not None:
            if key == "plugins":
                return f"[{','.join(self.config.get('plugins') or {})}]"
            value: Any = self.config
            for part in key.split("."):
                value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
            if value is not _ABSENT:
                return json.dumps(value, separators=(",", ":"))
        return next((o.partition("=")[2] for o in self.overrides if o.partition("=")[0].lstrip("+~") == key), None)

    def said(self, key: str) -> str:
        """How this run's command line sets ``key``, or its value there when it does not set it."""
        return next((o.lstrip("+~") for o in self.overrides if o.partition("=")[0].lstrip("+~") == key),
                    f"{key}={self.setting(key)}")

    def row(self) -> dict:
        speeds = [r["tokens_per_s_per_device"] for r in self.records[1:] if "tokens_per_s_per_device" in r]
        mfus = [r["mfu"] for r in self.records[1:] if "mfu" in r]
        validation = [r["validation_loss"] for r in self.records if "validation_loss" in r]
        last = max(self.losses) if self.losses else None
        return {"run": self.path, "steps": last, "final_loss": None if last is None else self.losses[last],
                "min_loss": min(self.losses.values()) if self.losses else None,
                "validation_loss": validation[-1] if validation else None,
                "tokens_per_s_per_device": statistics.median(speeds) if speeds else None,
                "mfu": statistics.median(mfus) if mfus else None,
                "memory_gib": max((r["memory_gib"] for r in self.records if "memory_gib" in r), default=None),
                "plan": self.plan}


def read_run(folder: Path) -> Run:
    run = Run(str(folder))
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        run.records = read_metrics(metrics)
        run.losses = {r["step"]: r["loss"] for r in run.records if "loss" in r}
    record = folder / "run.json"
    if record.is_file():
        facts = json.loads(record.read_text())
        run.overrides, run.versions = facts.get("overrides", []), facts.get("versions", {})
        if (folder / "config.yaml").is_file():
            run.config = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"))
        git = facts.get("git") or {}
        run.code = [f"{name}=={version}" for name, version in run.versions.items()] + (
            [f"git {git['commit'][:10]}{' (dirty)' if git.get('dirty') else ''}"] if git else [])
        world = facts.get("world", {})
        mesh = " x ".join(f"{dim} {n}" for dim, n in world.get("mesh", {}).items()) or "single process"
        run.plan = f"world {world.get('size', '?')}: {mesh}"
    elif (folder / ".hydra" / "overrides.yaml").is_file():  # a run from before run.json
        run.overrides = list(OmegaConf.load(folder / ".hydra" / "overrides.yaml"))
    return run


def read_metrics(file: Path) -> list[dict]:
    """The records of a metrics.jsonl; a last line cut short (a run killed while writing it) is left out with a
    warning naming the file, any other line that is not JSON refuses the file."""
    lines = [line for line in file.read_text(errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ConfigError(str(file), f"line {number} is not a JSON record", "compare the other runs, or "
                                  "delete the line (metrics.jsonl holds one JSON object per line)") from None
            print(f"titan-core: warning: {file}: its last line is cut short (the run stopped while writing it); "
                  "compared without it", file=sys.stderr)
    return records


def runs_of(paths: list[Path]) -> list[Run]:
    """The runs the command line names: run dirs, and the jobs of multirun folders in job order."""
    runs = []
    for path in paths:
        if (path / "multirun.yaml").is_file():
            jobs = sorted((p for p in path.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
            runs += [read_run(job) for job in jobs]
        elif (path / "metrics.jsonl").is_file() or (path / "config.yaml").is_file():
            runs.append(read_run(path))
        else:
            raise ConfigError(str(path), "is neither a run dir (metrics.jsonl, config.yaml) nor a multirun folder "
                              "(multirun.yaml)", "name the folder python -m titan_core.run wrote (its run dir, or a "
                              "sweep's multirun folder)")
    return runs


def differing(runs: list[Run]) -> list[str]:
    """For each run, the settings some command line names whose values differ between the runs (as the run's own
    command line wrote them), then its versions and commit that not every run shares."""
    keys = dict.fromkeys(o.partition("=")[0].lstrip("+~") for run in runs for o in run.overrides)
    varying = [key for key in keys if len({run.setting(key) for run in runs}) > 1]
    shared = set.intersection(*(set(run.code) for run in runs)) if runs else set()
    return [" ".join([*(run.said(key) for key in varying if run.setting(key) is not None),
                      *(fact for fact in run.code if fact not in shared)]) for run in runs]


def table(runs: list[Run]) -> str:
    columns = ("run", "steps", "final loss", "min loss", "val loss", "tok/s/device", "MFU", "mem GiB", "plan",
               "differs")
    lines = []
    for run, differs in zip(runs, differing(runs)):
        r = run.row()
        if not run.losses:
            lines.append((r["run"], "no metrics", *[""] * 7, differs))
            continue
        lines.append((r["run"], str(r["steps"]), f"{r['final_loss']:.4f}", f"{r['min_loss']:.4f}",
                      _number(r["validation_loss"], ".4f"), _number(r["tokens_per_s_per_device"], ".0f"),
                      _number(r["mfu"], ".1%"), _number(r["memory_gib"], ".2f"), r["plan"], differs))
    widths = [max(len(row[i]) for row in (columns, *lines)) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                     for row in (columns, *lines))


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def largest_difference(run: Run, reference: Run, tol: float) -> tuple[int, float, bool] | None:
    """The step where ``run``'s loss differs most from ``reference``'s, by how much, and whether that is within
    ``tol`` (relative to the loss, absolute below 1); None when they share no step."""
    shared = sorted(run.losses.keys() & reference.losses.keys())
    if not shared:
        return None
    step = max(shared, key=lambda s: abs(run.losses[s] - reference.losses[s]))
    difference = abs(run.losses[step] - reference.losses[step])
    return step, difference, difference <= tol * max(1.0, abs(reference.losses[step]))


# What a plotted metric is drawn from: the training loss as the mean over each logged window (one batch's loss
# zig-zags), the rest as logged.
PLOTTED_FROM = {"loss": "loss_avg"}
LOSSES = ("loss", "validation_loss")  # the other metrics are amounts, drawn from zero


def plot(runs: list[Run], file: Path, metrics: list[str]):
    """One panel per metric against the step, a line per run labelled by what sets it apart from the others."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot", "needs matplotlib, which is not installed",
                          "pip install matplotlib (or titan-trainer[plots])") from None
    matplotlib.use("Agg")  # a file, never a window
    from matplotlib import pyplot
    from matplotlib.ticker import MaxNLocator

    drawn = [m for m in metrics if any(PLOTTED_FROM.get(m, m) in r or m in r for run in runs for r in run.records)]
    if not drawn:
        raise ConfigError("--metrics", f"no run logged any of {', '.join(metrics)}",
                          "name keys of the runs' metrics.jsonl, e.g. --metrics loss,tokens_per_s_per_device")
    figure, panels = pyplot.subplots(1, len(drawn), figsize=(6 * len(drawn), 4.5), squeeze=False, layout="constrained")
    labels = [differs or Path(run.path).name for run, differs in zip(runs, differing(runs))]
    for metric, axes in zip(drawn, panels[0]):
        for run, label in zip(runs, labels):
            key = PLOTTED_FROM.get(metric, metric)
            points = [(r["step"], r.get(key, r.get(metric))) for r in run.records if key in r or metric in r]
            axes.plot(*zip(*points) if points else ([], []), marker="." if metric == "validation_loss" else None,
                      label=label)
        axes.set(xlabel="step", title=f"{metric} (mean over each logged window)" if metric in PLOTTED_FROM else metric)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        if metric not in LOSSES:
            axes.set_ylim(bottom=0)
    # Below the panels, never over a curve.
    figure.legend(*panels[0][0].get_legend_handles_labels(), loc="outside lower center", fontsize="small",
                  ncols=min(len(runs), 3))
    figure.savefig(file)
    return figure


def main(argv: list[str] | None = None) -> None:
    """Compare runs or a sweep side by side: losses, speed, what differs; --plot, --assert-equal."""
    parser = argparse.ArgumentParser(prog="python -m titan_core.compare", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run dirs or Hydra multirun folders")
    parser.add_argument("--plot", type=Path, help="write the metrics' curves to this PNG file, a panel each")
    parser.add_argument("--metrics", default="loss,validation_loss,tokens_per_s_per_device",
                        help="with --plot: the metrics to draw, comma-separated (any key of metrics.jsonl)")
    parser.add_argument("--assert-equal", action="store_true", help="exit 1 unless every loss curve equals the first's")
    parser.add_argument("--tol", type=float, default=1e-5, help="with --assert-equal (default 1e-5)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    try:
        runs = runs_of(args.runs)
        if args.plot:
            plot(runs, args.plot, [m for m in args.metrics.split(",") if m])
    except ConfigError as error:
        print(f"titan-core: error: {error}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if args.json:
        print(json.dumps([{**r.row(), "differs": d, "versions": r.versions} for r, d in zip(runs, differing(runs))],
                         indent=2))
    else:
        print(table(runs))
    if args.plot:
        print(f"wrote {args.plot}")
    if args.assert_equal:
        sys.exit(check_equal(runs, args.tol))


def check_equal(runs: list[Run], tol: float) -> int:
    """Print how far each run's loss curve is from the first's; 1 if any is further than ``tol``."""
    failed = False
    for run in runs[1:]:
        found = largest_difference(run, runs[0], tol)
        if found is None:
            print(f"{run.path}: shares no logged step with {runs[0].path}")
            failed = True
            continue
        step, difference, within = found
        print(f"{run.path}: largest loss difference {difference:.3g} at step {step} "
              f"({'within' if within else 'beyond'} --tol {tol:g})")
        failed |= not within
    return int(failed)
