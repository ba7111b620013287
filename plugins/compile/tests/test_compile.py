"""torch.compile per block: parity with eager alone and under FSDP, the options refused before launch, what a
compiled loss holds against what the planner counts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_core.planner.cli import job_estimate
from titan_core.testing import TINY, compare, error_line, run_job

# Inductor fuses and reorders fp32 arithmetic (RMSNorm, SwiGLU, softmax), so losses differ from eager by
# an ulp or two (measured 0 to 9.5e-7 at loss ~6, alone and with fsdp, tp, pp, ac); Adam's
# normalisation magnifies such differences in the parameters (measured <= 1.1e-6 after 5 steps at lr 1e-3).
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4


def _timings(result) -> str:
    times = [m["step_time_s"] for m in result.metrics]
    steady = sorted(times[1:])[len(times[1:]) // 2]
    return f"first step {times[0]:.1f} s (includes compiling), steady-state median {steady:.2f} s"


def assert_matches_eager(overrides: list[str], titan_reference, tmp_path):
    """Run the tiny model with ``overrides``, check it against eager on one process; returns the run."""
    result = run_job([*TINY, *overrides], tmp_path / "run")
    report = compare(result, titan_reference())
    print(f"{' '.join(overrides)}: {report}; {_timings(result)}")
    assert report.max_loss_diff <= LOSS_TOL
    assert report.max_param_diff <= PARAM_TOL
    assert_compiled(result)
    return result


def assert_compiled(result) -> None:
    """Dynamo's own counters, logged by the plugin: graphs were compiled, and whole (fullgraph)."""
    last = result.metrics[-1]
    assert last["compiled_graphs"] >= 1 and last["graph_breaks"] == 0, last


# Compile alone is a case of every model's conformance run (titan_core.testing.model_conformance).


def test_compile_composes_with_selective_checkpointing(titan_reference, tmp_path):
    """Compiling a block wrapped for per-op checkpointing: inductor honours the save/recompute policy."""
    assert_matches_eager(["+plugins=[ac,compile]", "plugins.ac.mode=selective_op"], titan_reference, tmp_path)


@pytest.mark.slow
def test_compile_composes_with_fsdp(titan_reference, tmp_path):
    """Blocks and the loss compiled, under FSDP 2."""
    result = assert_matches_eager(["+plugins=[fsdp,compile]", "plugins.fsdp.degree=2",
                                   "plugins.compile.compile_loss=true"], titan_reference, tmp_path)
    assert result.stdout.index("compile") < result.stdout.index("fsdp")  # plan order: stage 500 before 600


@pytest.mark.slow
def test_compile_composes_with_tp(titan_reference, tmp_path):
    """Under tensor parallel the attention and feed-forward are compiled separately (a whole
    parallelized block fails in backward in torch 2.13)."""
    assert_matches_eager(["+plugins=[tp,compile]", "plugins.tp.degree=2"], titan_reference, tmp_path)


@pytest.mark.slow
def test_compile_composes_with_pipeline_stages(titan_reference, tmp_path):
    assert_matches_eager(["+plugins=[pp,compile]", "plugins.pp.degree=2", "plugins.pp.schedule=1F1B"],
                         titan_reference, tmp_path)


@pytest.mark.parametrize("override, message", [
    ("plugins.compile.backend=nope", "plugins.compile.backend: unknown torch.compile backend 'nope'"),
    ("plugins.compile.mode=fastest", "plugins.compile.mode: unknown inductor mode 'fastest'"),
    ("plugins.compile.mode=reduce-overhead", "captures CUDA graphs and this machine has no CUDA device"),
])
def test_bad_options_fail_before_launch(tmp_path, override, message):
    result = run_job([*TINY, "+plugins=[compile]", override], tmp_path / "run", expect_success=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_loss_compile_is_refused_under_tensor_parallel(tmp_path):
    result = run_job([*TINY, "+plugins=[compile,tp]", "plugins.tp.degree=2", "plugins.compile.compile_loss=true",
                      "launch.dry_run=true"], tmp_path / "run", expect_success=False)
    assert "plugins.compile.compile_loss: the loss is not compiled under tensor parallel" in error_line(result)


@pytest.mark.slow
def test_a_compiled_loss_holds_what_the_planner_counts():
    """The core's loss, on bf16 logits, measured in a fresh interpreter (loss_memory.py): eager, it keeps their
    float32 log-probabilities (2x the logits' bytes) and its backward holds two float32 gradients (4x); compiled,
    it keeps the logits themselves (1x) and its backward holds their gradient (1x). The planner's facts, eager
    and with compile_loss (``ModelFacts.with_fused_loss``), count the same, within 5% (2 against 1 is what a
    planner counting the compiled loss as eager would be off by)."""
    script = Path(__file__).with_name("loss_memory.py")
    measuring = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert measuring.returncode == 0, measuring.stderr[-3000:]
    measured = json.loads(measuring.stdout.splitlines()[-1])
    _, estimate = job_estimate([*TINY, "+plugins=[compile]", "plugins.compile.compile_loss=true"])
    assert estimate.facts is estimate.facts_in(estimate.compute_dtype).with_fused_loss  # what the peak reads
    eager = estimate.facts_in(torch.bfloat16)
    for facts, holds in ((eager, measured["eager"]), (eager.with_fused_loss, measured["compiled"])):
        print(f"kept {holds['kept']:.3f} (planned {facts.outer_logits / facts.output:.3f}), backward "
              f"{holds['backward']:.3f} (planned {facts.loss_backward / facts.output:.3f}) x the logits")
        assert facts.outer_logits / facts.output == pytest.approx(holds["kept"], rel=0.05)
        assert facts.loss_backward / facts.output == pytest.approx(holds["backward"], rel=0.05)
