"""A Hydra sweep over a world of one runs its jobs one after another in one process: nothing a job leaves behind
may reach the next. A dense family, an outsider's and one with experts (whose model plugin object keeps the routing
state every MoE family shares), with the plugins that run in one process stacked (compile on one of them), sweep
a shape-changing option A, B, A: the third job must train exactly as the first, which ran in a fresh process."""

import subprocess
import sys

import pytest

from titan_core.testing import TINY, JobResult, compare, merged

PLUGINS = "fsdp,tp,pp,cp,ac,chunked_loss,checkpoint,float8"
DEGREES = ["plugins.fsdp.degree=1", "plugins.tp.degree=1", "plugins.pp.degree=1", "plugins.cp.degree=1"]
# family: its preset, the plugins only it takes, the option swept and its values. compile (whose state, dynamo's
# caches and counters, belongs to the process whatever the model) on one family: each compile costs seconds.
FAMILIES = {
    "llama3": ("tiny", "", "model.dim", "64,32,64"),
    "qwen3_moe": ("qwen3_moe_tiny", ",compile,ep", "model.num_experts", "8,4,8"),
    "gpt2": ("gpt2_tiny", "", "model.n_embd", "64,32,64"),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_sweep_in_one_process_starts_every_job_afresh(tmp_path, family):
    preset, own, option, values = FAMILIES[family]
    degrees = [*DEGREES, *(["plugins.ep.degree=1"] if "ep" in own else [])]
    overrides = merged(TINY, ["training.steps=3", f"model={preset}", f"+plugins=[{PLUGINS}{own}]", *degrees])
    command = [sys.executable, "-m", "titan_core.run", "-m", *overrides, f"{option}={values}",
               f"hydra.sweep.dir={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    first, other, again = (JobResult(tmp_path / str(job), 0, "", "") for job in range(3))
    assert len(first.losses) == len(other.losses) == len(again.losses) == 3
    assert first.losses != other.losses  # the second job is another model
    report = compare(again, first)
    assert report.max_loss_diff == 0 and report.max_param_diff == 0, report
    for name in ("compiled_graphs", "graph_breaks", "idle_experts", "expert_load_max"):  # the plugins' own counts
        assert [m.get(name) for m in again.metrics] == [m.get(name) for m in first.metrics], name
    assert all((tmp_path / str(job) / "checkpoints" / "step-3").is_dir() for job in range(3))
