"""Expert parallel on Qwen3-MoE: the dispatch order, training and routing metrics equal to one process (with
FSDP over the ranks ep leaves, pipeline stages, selective AC and compile, and DeepSeek-V3's routing), a
checkpoint that resumes without ep and exports to Hugging Face, and the one-line refusals."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from titan_core.testing import LOSS_TOL, PARAM_TOL, TINY, compare, error_line, run_job
from titan_ep.plugin import by_expert

MOE = ("model=qwen3_moe_tiny", "training.steps=10")
# DeepSeek-V3's routing: the bias each step moves from the global counts must be the same on every rank, or
# ranks choose different experts than one process would.
DEEPSEEK = (*MOE, "model.score_function=sigmoid", "model.num_shared_experts=1", "model.router_bias_update_rate=1e-2")
# The logged gradient norm is the clearest sign of a wrong gradient scale: experts' gradients averaged over
# ep_rest instead of every data-parallel rank are 2x too large, and the norm moves by ~1e-2 relative, while
# Adam hides the scale from the weights (measured: params off by only 1.7e-4, losses by 5e-6 over 5 steps).
GRAD_NORM_RTOL = 1e-5


def test_arrivals_are_grouped_by_expert_in_the_order_of_their_source_ranks():
    # Two source ranks, three local experts: rank 0 sent (2, 0, 1) copies, rank 1 sent (1, 2, 0).
    received = torch.tensor([[2, 0, 1], [1, 2, 0]])
    # Arrival order: r0e0 r0e0 r0e2 | r1e0 r1e1 r1e1 -> expert 0 (r0, r0, r1), expert 1 (r1, r1), expert 2 (r0).
    assert by_expert(received).tolist() == [0, 1, 3, 4, 5, 2]
    assert by_expert(torch.zeros(2, 3, dtype=torch.long)).tolist() == []


def _assert_trains_like(result, reference):
    report = compare(result, reference)
    print(f"ep parity: {report}")
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report
    for ours, theirs in zip(result.metrics, reference.metrics, strict=True):
        assert abs(ours["grad_norm"] - theirs["grad_norm"]) <= GRAD_NORM_RTOL * theirs["grad_norm"], (ours, theirs)
        # The routers' load, summed over every rank and stage, is the one process's: the same tokens, routed alike
        # (a pipeline's too: torch's shape-inference forward on its first step leaves no count).
        for key in ("expert_load_min", "expert_load_max", "idle_experts"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), (key, ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("model, stack", [
    (DEEPSEEK, ("+plugins=[fsdp,ep,compile]", "plugins.fsdp.degree=2", "plugins.ep.degree=2")),
    # With DeepSeek-V3's routing bias: torch's shape-inference forward on a pipeline's first step must not count.
    (DEEPSEEK, ("+plugins=[fsdp,ep,pp,ac]", "plugins.fsdp.degree=2", "plugins.ep.degree=2", "plugins.pp.degree=2",
           "plugins.ac.mode=selective_op")),
    # ep borrows tp's ranks: each tp rank routes its share of the sequence and sends it to the experts.
    # Compiled (the experts' layer one region with graph breaks) and with selective AC replaying its all-to-all.
    (MOE, ("+plugins=[fsdp,tp,ep,compile,ac]", "plugins.fsdp.degree=1", "plugins.tp.degree=2", "plugins.ep.degree=2",
           "plugins.tp.sequence_parallel=true", "plugins.ac.mode=selective_op")),
    # The experts' gradients are divided like the dense ones', by every rank averaging its loss (cp's too).
    (MOE, ("+plugins=[fsdp,cp,ep]", "plugins.fsdp.degree=1", "plugins.cp.degree=2", "plugins.ep.degree=2")),
], ids=["ep2-compile-deepseek-routing", "pp2-ep2-ac", "tp2-sp-ep2", "cp2-ep2"])
def test_expert_parallel_trains_like_one_process(model, stack, titan_reference, tmp_path):
    result = run_job([*TINY, *model, *stack], tmp_path / "run")
    assert "ep 2 within dp_shard" in result.stdout
    logs = [(result.run_dir / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    assert "holds experts 0-3 of 8 in each of" in logs[0] and "holds experts 4-7 of 8 in each of" in logs[1]
    _assert_trains_like(result, titan_reference(model))
    if "compile" in stack[0]:  # dynamo's counters: compiled, with breaks around the experts' all-to-all
        assert result.metrics[-1]["compiled_graphs"] >= 1 and result.metrics[-1]["graph_breaks"] >= 1, result.metrics[-1]


@pytest.mark.slow
def test_saved_under_ep_resumes_without_it_and_exports_to_hugging_face(titan_reference, tmp_path):
    # 4 ranks: ep 2 inside fsdp 4, so the experts' FSDP shards over ep_rest 2 and divides by all 4 ranks.
    saved = run_job([*TINY, *MOE, "+plugins=[fsdp,ep,checkpoint]", "plugins.fsdp.degree=4", "plugins.ep.degree=2",
                     "plugins.checkpoint.interval=3", "plugins.checkpoint.export_hf=true"], tmp_path / "ep")
    assert "world 4 = dp_shard 4; ep 2 within dp_shard" in saved.stdout
    reference = titan_reference(MOE)
    _assert_trains_like(saved, reference)

    resumed = run_job([*TINY, *MOE, "+plugins=[fsdp,checkpoint]", "plugins.fsdp.degree=2",
                       f"plugins.checkpoint.load_path={saved.run_dir / 'checkpoints' / 'step-6'}"], tmp_path / "fsdp")
    assert [m["step"] for m in resumed.metrics] == list(range(7, 11))
    _assert_trains_like(resumed, dataclasses.replace(reference, after_step=6))

    files = sorted((saved.run_dir / "checkpoints" / "hf-step-10").glob("*.safetensors"))  # a file per rank
    hf = {name: tensor for file in files for name, tensor in load_file(file).items()}
    weights = saved.final_weights()
    experts = weights["layers.1.mlp.experts.gate_up_proj"]
    assert experts.shape[0] == 8
    torch.testing.assert_close(hf["model.layers.1.mlp.experts.gate_up_proj"], experts, rtol=0, atol=0)
    assert len(hf) == len(weights)


@pytest.mark.parametrize("overrides, message", [
    (("+plugins=[fsdp,ep]", "plugins.fsdp.degree=2"),
     "plugins.ep: model 'llama3' does not describe experts, which expert parallel needs"),
    (("model=qwen3_moe_tiny", "+plugins=[simplefsdp,ep]", "plugins.simplefsdp.degree=2"),
     "plugins.ep: requires 'partial_data_parallel', which no enabled plugin provides"),
    (("model=qwen3_moe_tiny", "+plugins=[fsdp,ep]", "plugins.fsdp.degree=3", "plugins.ep.degree=3"),
     "plugins.ep.degree: 3 does not divide the model's 8 experts"),
    (("model=qwen3_moe_tiny", "+plugins=[fsdp,ep]", "plugins.fsdp.degree=2", "plugins.ep.degree=4"),
     "plugins.ep.degree: ep degree 4 does not divide the 2 rank(s) of dp_shard x cp x tp it borrows"),
])
def test_refused_before_launch(overrides, message, tmp_path):
    line = error_line(run_job([*TINY, *overrides], tmp_path / "run", expect_success=False))
    assert message in line, line
