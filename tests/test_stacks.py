"""Stacks of three or more plugins a user would type, each against one process."""

import pytest

from titan_core.testing import TINY, compare, run_job

LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # the parity harness's bounds (see titan_core.testing)
# Float8 rounds every operand to 3 mantissa bits, so an ulp of difference in a sum can move a rounding, which Adam
# magnifies: one float8 process against tp 2, 4.6e-4 after 5 steps (measured); a wrong gradient moves a weight by
# about lr (1e-3 in TINY) a step.
FLOAT8_PARAM_TOL = 2e-3


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


@pytest.mark.slow
@pytest.mark.parametrize("plugins, overrides, reference", [
    ("float8,tp", (), ("+plugins=[float8]",)),
    ("float8,tp,compile,ac", ("plugins.ac.mode=selective_op",), ("+plugins=[float8]",)),
    # Each data-parallel rank scales its own rows: the reference has the same two.
    ("float8,fsdp,tp", ("plugins.fsdp.degree=2",), ("+plugins=[float8,fsdp]", "plugins.fsdp.degree=2")),
    ("lora,float8,tp", (), ("+plugins=[lora,float8]",)),
], ids=["tp2", "tp2-compile-sac", "fsdp2-tp2", "lora-tp2"])
def test_float8_under_tensor_parallel_computes_as_float8_without_it(titan_reference, tmp_path, plugins, overrides,
                                                                    reference):
    """Tensor parallel gathers float8's tensorwise inputs and gradients in float8, cast on the shards with the whole
    tensor's scale (tests/test_planner_speed.py counts those bytes): the numbers of the same plan without tp, where a
    rank's own scale, or a cast dropped, moves the loss by 1e-4 and more. LoRA's adapters read their linears'
    inputs and add to their outputs: those gathers stay in the stream's precision (a float8 input failed in the
    adapter before)."""
    result = run_job([*TINY, f"+plugins=[{plugins}]", "plugins.tp.degree=2", *overrides], tmp_path / "run")
    report = compare(result, titan_reference(reference))
    print(f"parity {plugins} {' '.join(overrides)} against {' '.join(reference)}: {report}")
    assert report.max_loss_diff <= LOSS_TOL, report
    assert report.max_param_diff <= FLOAT8_PARAM_TOL, report
