"""The default optimizer's implementations: torch's AdamW kernels train alike, and their state is
checkpointed and resharded like any other."""

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from titan_core.adamw import AdamWNarrowStates
from titan_core.testing import TINY, compare, error_line, run_job

LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # the parity harness's bounds


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["optimizer.implementation=for_loop"],
    ["optimizer.implementation=fused", "+plugins=[fsdp]", "plugins.fsdp.degree=2"],
], ids=["for-loop", "fused-fsdp2"])
def test_implementations_train_alike(titan_parity, overrides):
    report = titan_parity(overrides)  # the reference uses the default, foreach
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report


@pytest.mark.slow
def test_fused_state_resumes_resharded_under_another_implementation(tmp_path, titan_reference):
    run_job([*TINY, "optimizer.implementation=fused", "+plugins=[fsdp,checkpoint]", "plugins.fsdp.degree=2",
             "plugins.checkpoint.interval=3"], tmp_path / "fused")
    resumed = run_job([*TINY, "optimizer.implementation=for_loop", "+plugins=[checkpoint]",
                       f"plugins.checkpoint.load_path={tmp_path / 'fused' / 'checkpoints' / 'step-3'}"],
                      tmp_path / "resumed")
    report = compare(resumed, dataclasses.replace(titan_reference(), after_step=3))
    assert len(report.losses) == 2 and report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report


def _adamw_trajectories(optimizer_class, steps=4, **kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    optimizer = optimizer_class(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kwargs)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return params, optimizer


def test_narrow_state_adamw_is_torch_adamw_in_float32():
    """The bf16-state optimizer's update is torch's AdamW: with float32 states the two agree to the ulp."""
    ours, _ = _adamw_trajectories(AdamWNarrowStates, state_dtype=torch.float32)
    torch_params, _ = _adamw_trajectories(torch.optim.AdamW, foreach=False)
    for a, b in zip(ours, torch_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_narrow_state_adamw_keeps_bfloat16_moments():
    ours, optimizer = _adamw_trajectories(AdamWNarrowStates, state_dtype=torch.bfloat16)
    wide, _ = _adamw_trajectories(torch.optim.AdamW, foreach=False)
    states = [optimizer.state[p] for p in ours]
    assert {s[k].dtype for s in states for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    assert all(s["step"].item() == 4 for s in states)
    # Rounding the moments moves the weights by much less than one update (lr 1e-2), but it moves them.
    drift = max((a - b).abs().max().item() for a, b in zip(ours, wide))
    assert 0 < drift < 1e-3


def test_bfloat16_states_are_refused_with_float32_kernels(tmp_path):
    result = run_job([*TINY, "optimizer.state_dtype=bfloat16", "optimizer.implementation=fused",
                      "launch.dry_run=true"], tmp_path / "run", expect_success=False)
    assert error_line(result) == ("titan-core: error: optimizer.implementation: 'fused' keeps float32 states, but "
                                  "optimizer.state_dtype=bfloat16 updates one parameter at a time; fix: set "
                                  "optimizer.implementation=null (or for_loop)")


@pytest.mark.slow
def test_bfloat16_states_checkpoint_and_resume_resharded(tmp_path):
    """bf16 moments saved under FSDP 2 are read back as bf16 and resume on one process where the sharded
    run went on."""
    sharded = run_job([*TINY, "optimizer.state_dtype=bfloat16", "+plugins=[fsdp,checkpoint]",
                       "plugins.fsdp.degree=2", "plugins.checkpoint.interval=3"], tmp_path / "sharded")
    step_3 = tmp_path / "sharded" / "checkpoints" / "step-3"
    saved = FileSystemReader(str(step_3)).read_metadata().state_dict_metadata
    moments = {k: v.properties.dtype for k, v in saved.items() if k.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq")}
    assert moments and set(moments.values()) == {torch.bfloat16}
    resumed = run_job([*TINY, "optimizer.state_dtype=bfloat16", "+plugins=[checkpoint]",
                       f"plugins.checkpoint.load_path={step_3}"], tmp_path / "resumed")
    report = compare(resumed, dataclasses.replace(sharded, after_step=3))
    assert len(report.losses) == 2 and report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report
