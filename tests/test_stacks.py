"""Stacks of three or more plugins a user would type, each against one process."""

import pytest

from titan_core.testing import TINY, compare, run_job

LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # the parity harness's bounds (see titan_core.testing)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    # TorchTitan's every-other-matmul policy here, all matmuls below: both count their matmuls alike in forward and
    # in a compiled region's recomputation.
    ["+plugins=[tp,compile,ac]", "plugins.tp.degree=2", "plugins.ac.mode=selective_op",
     "plugins.ac.matmuls=every_other"],
    ["+plugins=[fsdp,tp,compile,ac]", "plugins.fsdp.degree=2", "plugins.tp.degree=2", "plugins.ac.mode=selective_op"],
    # Under a pipeline too (62 s on two cores): its parts are test_attention's pp2-tp2-ac-compile and
    # test_pp_parity's pp2 x fsdp2 x tp2 x cp2, which keep the suite under 45 minutes.
], ids=["tp2-compile-sac-every-other-matmul", "fsdp2-tp2-compile-sac"])
def test_tp_compile_selective_ac(titan_reference, tmp_path, overrides):
    # Crashed in backward before: SAC saved inductor's reused mm.out buffers inside the compiled regions.
    result = run_job([*TINY, *overrides], tmp_path / "run")
    report = compare(result, titan_reference())
    print(f"parity {' '.join(overrides)}: {report}")
    assert report.max_loss_diff <= LOSS_TOL, report
    assert report.max_param_diff <= PARAM_TOL, report
    # dynamo's counters: the attention and feed-forward regions compiled whole
    assert result.metrics[-1]["compiled_graphs"] >= 2 and result.metrics[-1]["graph_breaks"] == 0, result.metrics[-1]
