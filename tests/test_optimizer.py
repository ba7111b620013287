"""The default optimizer's implementations: torch's AdamW kernels train alike, and their state is
checkpointed and resharded like any other."""

import dataclasses

import pytest

from titan_core.testing import TINY, compare, run_job

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
