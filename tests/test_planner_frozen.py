"""The planner on frozen weights and autocast: LoRA's trained share, its adapters under tp and pp, selective
checkpointing of a frozen model, the core's autocast traced with float32 weights and CUDA's float32 ops."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_core.plugins import Registry, build_meta_model, build_plan
from titan_core.planner.costs import estimate
from titan_core.planner.hardware import hardware_profile
from titan_core.testing import compose

# What the planner's tests share, loaded by path as tracked_rank.py is (tests/ is not on the path).
spec = importlib.util.spec_from_file_location("planner_cases", Path(__file__).with_name("planner_cases.py"))
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
CPU, SMALL, _estimate = cases.CPU, cases.SMALL, cases._estimate
_plan_command, _printed_bytes = cases._plan_command, cases._printed_bytes
_tracked_step, _term = cases._tracked_step, cases._term


def test_what_trains_is_counted_from_the_converted_models_requires_grad():
    """LoRA rank 4 on the 7 linears of each of qwen3_tiny's 4 blocks trains 4 x (128 + 96 + 96 + 128 + 192 + 192 +
    192) x 4 = 16,384 values: AdamW keeps its 8 bytes for those alone (the core counts them on the model lora's
    trace conversion makes; lora sets no share)."""
    config = compose("model=qwen3_tiny", "tokenizer.path=bytes", "training.seq_len=64", "+plugins=[lora]",
                     "plugins.lora.rank=4")
    registry = Registry(config)
    plan = build_plan(config, registry, None, 256)
    adapted = estimate(config, plan, registry, CPU)
    assert adapted.memory()["optimizer"] == pytest.approx(8 * 16_384)
    unconverted = dataclasses.replace(adapted, trace_conversions={})  # the whole model trained, as without lora
    assert unconverted.trained_share == 1.0 and unconverted.memory()["optimizer"] > 8 * 16_384 * 10
    narrow = compose("model=qwen3_tiny", "tokenizer.path=bytes", "training.seq_len=64", "+plugins=[lora]",
                     "plugins.lora.rank=4", "plugins.lora.base_dtype=bfloat16", "training.compute_dtype=bfloat16")
    model = build_meta_model(narrow, plan.model)
    linears = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    halved = estimate(narrow, build_plan(narrow, Registry(narrow), None, 256), Registry(narrow), CPU)
    # The base linears at 2 bytes, not 4: the embeddings and norms stay float32.
    assert adapted.memory()["parameters"] - halved.memory()["parameters"] == pytest.approx(2 * linears)
    # On experts: qwen3_moe_tiny's 3 sparse blocks x 8 experts x rank 4 x ((64 + 64) + (64 + 32)), for the stacks
    # gate_up (64 x 64) and down (64 x 32), beside rank 4 on the 4 attention linears of its 4 blocks.
    experts = compose("model=qwen3_moe_tiny", "tokenizer.path=bytes", "training.seq_len=64", "+plugins=[lora]",
                      "plugins.lora.rank=4", "plugins.lora.targets=[attention,experts]")
    registry = Registry(experts)
    adapted_experts = estimate(experts, build_plan(experts, registry, None, 256), registry, CPU)
    adapters = 3 * 8 * 4 * (128 + 96) + 4 * 4 * (128 + 96 + 96 + 128)
    assert adapted_experts.trained_params() == adapters
    # Traced as converted: the model's facts count the adapters among its parameters.
    assert adapted.facts.params - adapted.facts_in(adapted.compute_dtype, {}).params == 16_384


def test_a_pipeline_stage_of_frozen_blocks_trains_nothing_and_the_other_all():
    """Each pipeline rank counts what its own blocks train: with the first stage's inputs and blocks frozen (a
    conversion as a freezing plugin registers it), that rank keeps no gradient and no optimizer state, and the last
    stage a float32 gradient and AdamW's 8 bytes for every parameter it holds (one share for the whole model, as
    plugins set it until 2026-12-07, gave both ranks the same half)."""
    *_, result = _estimate("+plugins=[pp]", "plugins.pp.degree=2", "plugins.pp.microbatches=4")
    first_blocks = result.ranks[0]["blocks"]

    def freeze_first_stage(model):
        for index in first_blocks:
            model.layers[str(index)].requires_grad_(False)
        model.tok_embeddings.requires_grad_(False)

    frozen = dataclasses.replace(result, trace_conversions={"freeze the first stage": freeze_first_stage})
    first, last = frozen.each_rank()
    assert first.trained_share == 0 and first.step_peak()["optimizer"] == 0 and first.step_peak()["gradients"] == 0
    assert last.trained_share == 1 and last.step_peak()["gradients"] == pytest.approx(4 * last.sharded_params())
    assert last.step_peak()["optimizer"] >= 8 * last.sharded_params()


@pytest.mark.parametrize("overrides, within, over", [
    (("training.seq_len=256",), 0.01, 0.05), (("model=qwen3_moe_tiny", "training.seq_len=256"), 0.03, 0.2),
    (("training.seq_len=256", "+plugins=[ac]", "plugins.ac.mode=full"), 0.01, 0.02),
    (("model=qwen3_tiny", "model.vocab_size=16384", "+plugins=[chunked_loss]", "plugins.chunked_loss.chunk_tokens=128"),
     0.01, 0.1),
    (("training.seq_len=256", "+plugins=[fsdp]", "plugins.fsdp.degree=2"), 0.01, 0.05),
], ids=["alone", "qwen3-moe", "ac-full", "chunked_loss", "fsdp2"])
def test_a_lora_job_is_traced_frozen_with_its_adapters(overrides, within, over):
    """LoRA's estimate traces the model as lora converts it (``Estimate.trace_conversions``): a frozen weight's
    matmul keeps no input for its gradient, a frozen norm no normalized input, the adapters keep theirs; a frozen
    output layer sums no gradient over a chunked loss's chunks. Against torch's tracker (which now tracks frozen
    weights): within 1% (measured -0.6% to 0.0%), Qwen3-MoE within 3% (-2.5%); traced unconverted, +7.3% to +30.3%
    over (under full checkpointing, which keeps only the blocks' inputs either way, +2.5%)."""
    config, registry, plan, result = _estimate("launch.device=cpu", "+plugins=[lora]", *overrides)
    measured = _tracked_step(config, registry, plan)["Total"]
    unconverted = dataclasses.replace(result, trace_conversions={})
    assert abs(sum(result.memory().values()) / measured - 1) < within
    assert sum(unconverted.memory().values()) / measured - 1 > over


@pytest.mark.parametrize("overrides, within", [
    (("+plugins=[tp,lora]", "plugins.tp.degree=2"), 0.01),
    (("+plugins=[fsdp,tp,lora]", "plugins.fsdp.degree=2", "plugins.tp.degree=2"), 0.01),
    (("+plugins=[tp,lora,ac]", "plugins.tp.degree=2", "plugins.ac.mode=full"), 0.04),
], ids=["tp", "fsdp-tp", "tp-ac-full"])
def test_tensor_parallel_leaves_each_lora_factor_it_does_not_split_whole(overrides, within):
    """Under tp, lora splits one factor of each adapter like its linear and leaves the other whole on every rank,
    and the low-rank input that factor makes or reads (tokens x rank) whole too: each rank trains more than its
    split share, and keeps more. The optimizer's states within 1% of the tracker's, the peak within 1% (measured
    +0.2%, fsdp 2 x tp 2 +0.1%; full checkpointing, whose recomputing block is priced at its split share, -3.6%);
    as if every factor were split, as until 2026-12-02, -3.0%, -3.0% and -6.8% (and -3.6% to -5.6% while tp's
    split of the activations was read off the model before lora's adapters joined it)."""
    config, registry, plan, result = _estimate("launch.device=cpu", "training.seq_len=256", *overrides)
    measured = _tracked_step(config, registry, plan)
    assert result.memory()["optimizer"] == pytest.approx(measured["OPT"], rel=0.01)
    split_evenly = dataclasses.replace(result, trained_whole=0.0, memory_terms=[
        term for term in result.memory_terms if not term[1].endswith("whole on every tensor-parallel rank")])
    error, before = (sum(e.memory().values()) / measured["Total"] - 1 for e in (result, split_evenly))
    print(f"{error:+.1%} (every factor split: {before:+.1%})")
    assert abs(error) < within
    assert before < error - 0.02


def test_each_pipeline_rank_holds_the_whole_lora_factors_of_its_own_blocks():
    """Under tp 2 x pp 2 each stage holds half the blocks, and of the adapters' factors tp leaves whole only its
    own blocks' (the tiny Llama's blocks, width 64, rank 8: lora_A of wq, wk, wv, w1 and w3, lora_B of wo and w2,
    8 x 64 each): what each rank holds beyond its split share, half of them; until 2026-12-02 every stage was priced
    with the whole model's, twice that."""
    config, registry, plan, result = _estimate("launch.device=cpu", "+plugins=[tp,pp,lora]", "plugins.tp.degree=2",
                                               "plugins.pp.degree=2", "plugins.lora.rank=8")
    ranks = result.each_rank()
    per_block = 7 * 8 * 64
    assert [sorted(r.blocks) for r in ranks] == [[0, 1], [2, 3]]
    assert [_term(r, "the adapters' factors whole") for r in ranks] == [4 * 2 * per_block * (1 - 1 / 2)] * 2


def test_selective_checkpointing_of_a_frozen_model_keeps_more_than_autograd_alone():
    """torch's selective checkpoint stores its policy's results (every matmul's) whatever autograd needs, and a
    frozen model's autograd keeps less (LoRA: no input of a frozen weight's matmul): the blocks keep more than
    without checkpointing. Within 1% of torch's tracker (measured -0.0%); capped at what the blocks keep without
    checkpointing, as ac's estimate was until 2026-12-02, -12.0%."""
    config, registry, plan, result = _estimate("launch.device=cpu", "training.seq_len=256", "+plugins=[lora,ac]",
                                               "plugins.ac.mode=selective_op")
    measured = _tracked_step(config, registry, plan)["Total"]
    assert all(result.kept(i) > 1.1 * result.saved(i) for i in result.blocks)
    assert abs(sum(result.memory().values()) / measured - 1) < 0.01


@pytest.mark.parametrize("overrides, within, under", [
    (("training.seq_len=256",), 0.01, 0.08), (("+plugins=[ac]", "plugins.ac.mode=full"), 0.02, 0.09),
    (("+plugins=[tp]", "plugins.tp.degree=2"), 0.03, 0.09), (("+plugins=[float8]",), 0.03, 0.04),
], ids=["alone", "ac-full", "tp", "float8"])
def test_the_cores_autocast_is_traced_with_float32_weights_and_their_cached_copies(overrides, within, under):
    """bfloat16 compute with no plugin providing mixed precision (the default on GPUs without fsdp): the weights
    stay float32 and autocast casts each for its products, caching the copies until the micro-batch's backward
    ends (the step runs backward inside autocast); the residual stream and the norms stay float32. Traced so (on
    fake CPU tensors: meta ones have no autocast), within 3% of torch's tracker (measured -0.0%, full
    checkpointing +1.2%, tp -1.7%; float8, whose linears cast the float32 weights themselves, +2.2%); traced with
    bfloat16 weights and no copies, as until 2026-12-02, under by 8.9%, 10.8%, 10.9% and 4.7%."""
    config, registry, plan, result = _estimate("launch.device=cpu", "training.compute_dtype=bfloat16", *overrides)
    measured = _tracked_step(config, registry, plan)["Total"]
    assert result.autocasts and sum(result.facts.block_weight_casts) > 0
    copies = _term(result, "the weights' copies")
    assert (copies == result.facts.outer_weight_casts) == ("float8" in str(overrides))  # its output layer's alone
    as_weights = dataclasses.replace(
        result, facts_in=lambda dtype, conversions, autocast: result.facts_in(dtype, conversions),
        memory_terms=[t for t in result.memory_terms if not t[1].startswith("the weights' copies")])
    error, before = (sum(e.memory().values()) / measured - 1 for e in (result, as_weights))
    print(f"{error:+.1%} (bfloat16 weights: {before:+.1%})")
    assert abs(error) < within
    assert before < -under


def test_cudas_autocast_policy_runs_on_cpu_as_cuda_documents_it():
    """While a CUDA job is traced on CPU tensors, CPU autocast gives the ops CUDA's autocast runs in float32
    (torch's "CUDA ops that can autocast to float32": norms, pow, rsqrt, exp, softmax, sum...) float32 results
    from bfloat16 inputs, as CUDA does, and matmuls stay bfloat16; each op so treated has a CUDA autocast kernel
    and no CPU one in this torch; afterwards CPU's own policy is back."""
    from titan_core.planner.cuda_autocast import FLOAT32_INPUTS, FLOAT32_RESULT, cuda_autocast_policy, differs_on_cpu

    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(8, requires_grad=True)

    def results():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = [torch.nn.functional.rms_norm(x, (8,), weight), torch.nn.functional.layer_norm(x, (8,), weight),
                       x.softmax(-1), torch.log_softmax(x, -1), x.pow(2), x.rsqrt(), x.exp(), x.sum(), x.sum(-1),
                       x.cumsum(0), x @ weight]
        sum(output.float().sum() for output in outputs).backward()  # autograd follows the widened ops
        return [output.dtype for output in outputs]
    assert results() == [torch.bfloat16] * 11
    with cuda_autocast_policy():
        assert results() == [torch.float32] * 10 + [torch.bfloat16]
    assert results() == [torch.bfloat16] * 11
    assert all(map(differs_on_cpu, ("rms_norm", "layer_norm", "softmax.int", "pow.Tensor_Scalar", "rsqrt", "sum")))
    assert sum(map(differs_on_cpu, FLOAT32_INPUTS + FLOAT32_RESULT)) >= 30  # the lists are torch's, not stale


@pytest.mark.parametrize("model, widened", [("qwen3_tiny", True), ("tiny", False)])
def test_a_cuda_jobs_autocast_is_traced_with_cudas_float32_ops(model, widened):
    """bfloat16 compute under the core's autocast, planned for a GPU: Qwen3's query and key norms, fed a linear's
    bfloat16 output, keep float32 tensors on a GPU (CUDA's autocast runs rms_norm in float32), which a trace under
    CPU's autocast kept in bfloat16; Llama's norms read the float32 residual stream, the same either way."""
    config = compose(*SMALL, f"model={model}", "training.compute_dtype=bfloat16")
    registry = Registry(config)
    plan = build_plan(config, registry, None, 256)
    gpu, cpu = (estimate(config, plan, registry, hardware) for hardware in (hardware_profile("h100"), CPU))
    assert gpu.autocasts and cpu.autocasts
    kept_gpu, kept_cpu = sum(gpu.facts.block_saved), sum(cpu.facts.block_saved)
    assert (kept_gpu > 1.02 * kept_cpu) if widened else (kept_gpu == kept_cpu), (kept_gpu, kept_cpu)


def test_the_freeze_example_is_planned_frozen(tmp_path):
    """examples/freeze-plugin, installed as a user would, prices itself from its own pricing module: the optimizer's
    states cover only what still trains (the tiny Llama with its embeddings and first block frozen), and it is not
    listed as not counted."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(Path(__file__).resolve().parents[1] / "examples" / "freeze-plugin")], check=True,
                   capture_output=True, timeout=600)
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    job = ["--hardware", "a100", "model=tiny", "tokenizer.path=bytes", "training.seq_len=64", "launch.world_size=1"]
    plain, frozen = (_plan_command(*job, *extra, env=env) for extra in (
        (), ("+plugins=[freeze]", "plugins.freeze.blocks=[0]", "plugins.freeze.inputs=true")))
    assert plain.returncode == 0 and frozen.returncode == 0, frozen.stderr
    assert "not counted" not in frozen.stdout
    config = compose("model=tiny", "tokenizer.path=bytes", "training.seq_len=64")
    model = build_meta_model(config, build_plan(config, Registry(config), None, 256).model)
    kept = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("tok_embeddings.", "layers.0.")))
    everything = sum(p.numel() for p in model.parameters())
    states = [_printed_bytes(run.stdout, "    optimizer ") for run in (plain, frozen)]
    assert states[1] / states[0] == pytest.approx(kept / everything, rel=5e-3)  # sizes printed to 3 figures
