"""The command line end to end: a real short training, its run dir, multirun, torchrun, an installed
third-party plugin and a non-editable install."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from titan_core.initialization import init_weights
from titan_llama3.model import Transformer
from titan_llama3.plugin import llama_args, describe
from titan_core.testing import TINY, install_plugins, run_job

ROOT = Path(__file__).resolve().parents[1]


def test_debug_model_learns_on_the_builtin_corpus(tmp_path):
    # The default job (debug model, builtin corpus and tokenizer), shortened.
    result = run_job(["training.steps=30", "metrics.log_every=10"], tmp_path)
    losses = [m["loss_avg"] for m in result.metrics]  # over 10 steps each: the trend, not one batch
    assert len(losses) == 3
    assert losses[-1] < losses[1] < losses[0] and losses[-1] < losses[0] - 0.5, losses  # measured: 7.55, 7.11, 6.47
    assert "titan-core plan: world 1 = single process" in result.stdout
    # No MFU on a CPU without a peak the user gives: a peak measured while other work shares the cores read 85-93%.
    assert "| MFU " not in result.stdout and "| eta " in result.stdout and "so no MFU" in result.stdout
    first = result.metrics[0]
    assert {"loss", "loss_avg", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
            "memory_gib"} <= first.keys() and "mfu" not in first
    assert "tok/s/device (" in result.stdout

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss_avg")] == pytest.approx(losses)
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([m["loss"] for m in result.metrics])
    assert OmegaConf.load(tmp_path / "config.yaml").training.steps == 30
    assert (tmp_path / ".hydra" / "overrides.yaml").exists()
    assert "step 30/30" in (tmp_path / "logs" / "rank0.log").read_text()
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["overrides"] == ["training.steps=30", "metrics.log_every=10"]  # hydra.* are Hydra's own
    assert record["versions"]["torch"] == torch.__version__
    assert {"titan-trainer", "titan-llama3"} <= record["versions"].keys()
    assert record["world"] == {"size": 1, "nodes": 1, "mesh": {}, "plugins": [], "model": "llama3"}
    assert record["git"] is None or len(record["git"]["commit"]) == 40


def test_a_terminal_gets_a_progress_bar_and_a_pipe_plain_lines(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns of a terminal
    command = [sys.executable, "-m", "titan_core.run", *TINY, "training.steps=6", "metrics.log_every=3",
               f"hydra.run.dir={tmp_path}"]
    job = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    output = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the job closed the terminal
            break
        if not chunk:
            break
        output += chunk
    assert job.wait(timeout=300) == 0, output.decode(errors="replace")[-3000:]
    screen = output.decode(errors="replace")
    assert "6/6 [" in screen and "loss " in screen and "tok/s/device]" in screen  # step, loss, speed, ETA
    assert "step 6/6 | loss" in screen  # the log lines still print, above the bar
    piped = (tmp_path / "logs" / "rank0.log").read_text()
    assert "step 3/6" in piped and "6/6 [" not in piped


@pytest.mark.slow
def test_self_launch_writes_per_rank_logs(tmp_path):
    run_job([*TINY, "+plugins=[fsdp]", "plugins.fsdp.degree=2"], tmp_path)
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert f"[rank{rank}]" in log
    assert "step 5/5" in (tmp_path / "logs" / "rank0.log").read_text()


# Records, once the model is built, whether the worker's SIGHUP and SIGQUIT handlers are the defaults.
SIGNALS = """
import json
import os
import signal

from titan_core import hookimpl


@hookimpl
def after_init(plugin_config):
    with open(plugin_config.out + os.environ["RANK"], "w") as file:
        json.dump([signal.getsignal(s) == signal.SIG_DFL for s in (signal.SIGHUP, signal.SIGQUIT)], file)
"""


@pytest.mark.slow
def test_a_worker_forked_from_the_launcher_starts_from_the_default_signal_handlers(tmp_path):
    """The elastic agent's handlers raise its SignalException: inherited, a SIGHUP would end a worker as a
    traceback instead of the signal's own exit."""
    env = install_plugins(tmp_path / "site", {"signals": (SIGNALS, "out: null\n")}, distribution="signals")
    run_job([*TINY, "+plugins=[fsdp,signals]", "plugins.fsdp.degree=2", "training.steps=1",
             f"plugins.signals.out={tmp_path / 'defaults'}"], tmp_path / "run", env=env)
    assert [json.loads((tmp_path / f"defaults{rank}").read_text()) for rank in (0, 1)] == [[True, True]] * 2


@pytest.mark.slow
def test_multirun_runs_each_job_as_its_own_world(tmp_path):
    # The first job trains in the sweep's process (one rank), leaving it an OpenMP pool of two threads; workers of
    # two threads forked from that process hang, so the second job's must come from a fresh server process.
    command = [sys.executable, "-m", "titan_core.run", "-m", *TINY, "+plugins=[fsdp]", "plugins.fsdp.degree=1,2",
               "launch.cpu_threads_per_worker=2", f"hydra.sweep.dir={tmp_path}"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir() and p.name.isdigit())
    assert [OmegaConf.load(r / "config.yaml").plugins.fsdp.degree for r in runs] == [1, 2]
    losses = [[json.loads(line)["loss"] for line in (r / "metrics.jsonl").read_text().splitlines()] for r in runs]
    assert len(losses[1]) == 5 and max(abs(a - b) for a, b in zip(*losses)) <= 1e-5  # two ranks train as one
    assert [(r / "logs" / "rank1.log").exists() for r in runs] == [False, True]
    # The sweep side by side: a row per job, the swept option as what differs.
    table = subprocess.run([sys.executable, "-m", "titan_core.compare", str(tmp_path), "--json"], capture_output=True,
                           text=True, timeout=120)
    rows = json.loads(table.stdout)
    assert [(row["run"], row["final_loss"], row["differs"], row["plan"]) for row in rows] == [
        (str(runs[0]), losses[0][-1], "plugins.fsdp.degree=1", "world 1: dp_shard 1"),
        (str(runs[1]), losses[1][-1], "plugins.fsdp.degree=2", "world 2: dp_shard 2")]


@pytest.mark.slow
def test_under_torchrun_every_rank_agrees_on_the_run_dir(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=agree", "-m", "titan_core.run", *TINY,
               "+plugins=[fsdp]", "plugins.fsdp.degree=-1"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "torchrun-agree"
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert "world 2 = dp_shard 2" in completed.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 5
    assert (run_dir / ".hydra" / "config.yaml").exists()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["world"]["mesh"] == {"dp_shard": 2} and record["world"]["plugins"] == ["fsdp"]
    assert "titan-fsdp" in record["versions"]


def install(sources: list[Path], target: Path) -> dict:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), *map(str, sources)], check=True, capture_output=True, timeout=600)
    return {"PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_third_party_plugin_installs_and_trains(tmp_path):
    env = install([ROOT / "examples" / "freeze-plugin"], tmp_path / "site")
    result = run_job([*TINY, "+plugins=[freeze]", "plugins.freeze.blocks=[0]", "plugins.freeze.inputs=true"],
                     tmp_path / "run", env=env)
    assert "     -  freeze       titan-freeze-example" in result.stdout
    weights = result.final_weights()

    args = llama_args(OmegaConf.load(ROOT / "plugins" / "llama3" / "titan_llama3" / "conf" / "model" / "tiny.yaml"),
                      264, 32)
    initial = Transformer(args)
    init_weights(initial, describe(initial.args), 0)
    for name, value in initial.state_dict().items():
        frozen = name.startswith(("tok_embeddings.", "layers.0."))
        assert torch.equal(weights[name], value) == frozen, name


@pytest.mark.slow
def test_non_editable_install_runs_with_its_packaged_configs(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "outputs", "multirun", "*.egg-info",
                                                                 "__pycache__", "build"), symlinks=True)
    env = install([source, source / "plugins" / "llama3", source / "plugins" / "fsdp"], tmp_path / "site")
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    completed = subprocess.run([sys.executable, "-c", "import titan_core, sys; print(titan_core.__file__)"],
                               capture_output=True, text=True, env={**os.environ, **env}, cwd=workdir)
    assert completed.stdout.startswith(str(tmp_path / "site")), completed.stdout + completed.stderr
    result = run_job([*TINY, "training.steps=2", "+plugins=[fsdp]", "plugins.fsdp.degree=2"], workdir / "run", env=env)
    assert len(result.losses) == 2


def test_the_first_lines_say_what_is_on(tmp_path):
    """The precision and who decides it, the schedule, the optimizer and its groups; a warm-up longer than the run and
    a one-step wsd decay are each a warning with the fix, which applied silences it."""
    result = run_job([*TINY, "training.steps=4", "lr_scheduler.warmup_steps=6", "lr_scheduler.decay=wsd",
                      "lr_scheduler.decay_steps=1"], tmp_path / "run")
    lines = result.stdout.splitlines()
    assert "titan-core: precision: float32, no autocast (training.compute_dtype=null: the device's default)" in lines
    assert ("titan-core: schedule: warm-up 6 steps to 0.001, then stable until step 3, then a linear decay over the "
            "last 1 to 0.0001 (lr_scheduler.*)") in lines
    warnings = [line for line in lines if line.startswith("titan-core: warning:")]
    assert warnings == [
        "titan-core: warning: lr_scheduler.warmup_steps=6 is longer than the run's 4 steps: the learning rate never "
        "reaches optimizer.lr; fix: set lr_scheduler.warmup_steps=4 or less",
        "titan-core: warning: the wsd decay lasts 1 step of 4: the rate drops to its floor at once; fix: set "
        "lr_scheduler.decay_steps to a fifth or so of training.steps"]
    optimizer = next(line for line in lines if "optimizer: " in line)
    assert "optimizer: AdamW (the core's): matrix (" in optimizer and "lr 0.001, weight decay 0)" in optimizer
    fixed = run_job([*TINY, "training.steps=4", "lr_scheduler.warmup_steps=4", "lr_scheduler.decay=wsd",
                     "lr_scheduler.decay_steps=2", "training.compute_dtype=bfloat16"], tmp_path / "fixed")
    assert not [line for line in fixed.stdout.splitlines() if "warning:" in line]
    assert "titan-core: precision: bfloat16 autocast over float32 weights (training.compute_dtype)" in fixed.stdout
