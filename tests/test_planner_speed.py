"""The planner's step time: the FLOPs a step runs (selective checkpointing's reruns, float8's converted linears and
their casts, each linear's shapes under tp), the host's operators, each call's latency, this CPU's cores."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_core.plugins import Registry, build_meta_model, build_plan
from titan_core.planner.cli import job_estimate
from titan_core.planner.costs import estimate
from titan_core.planner.estimate import evaluated
from titan_core.planner.hardware import hardware_profile
from titan_core.testing import compose

# What the planner's tests share, loaded by path as tracked_rank.py is (tests/ is not on the path).
spec = importlib.util.spec_from_file_location("planner_cases", Path(__file__).with_name("planner_cases.py"))
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
CPU, SMALL, tracked_rank = cases.CPU, cases.SMALL, cases.tracked_rank
_estimate, _on_rank0 = cases._estimate, cases._on_rank0


def test_selective_checkpointings_rerun_matmuls_are_the_flops_torch_counts():
    """Keeping every other matmul, a step of the tiny Llama runs in backward the forward of the rest again: torch's
    FLOP counter, over one step against the same step keeping every matmul, counts what the planner adds to the
    step's FLOPs (``recomputed_fraction``); priced as elementwise traffic only, it added nothing."""
    from torch.utils.flop_counter import FlopCounterMode

    flops, fractions = {}, {}
    for policy in ("all", "every_other"):
        config, registry, plan, result = _estimate("launch.device=cpu", "+plugins=[ac]", "plugins.ac.mode=selective_op",
                                                   f"plugins.ac.matmuls={policy}")
        fractions[policy] = result.recomputed_fraction
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
        try:
            _, _, step = tracked_rank._training_step(config, registry, plan)
            step()
            with FlopCounterMode(display=False) as counter:
                step()
        finally:
            dist.destroy_process_group()
        flops[policy] = counter.get_total_flops()
    tokens = config.training.global_batch_size * config.training.seq_len
    predicted = (fractions["every_other"] - fractions["all"]) * plan.model.flops_per_token(config.training.seq_len)
    assert fractions["all"] == 0 and predicted > 0
    assert predicted * tokens == pytest.approx(flops["every_other"] - flops["all"], rel=0.01)


@pytest.mark.parametrize("recipe, all_gather", [("tensorwise", True), ("tensorwise", False), ("rowwise", False),
                                                ("rowwise_with_gw_hp", False)])
def test_float8s_casts_move_the_rooflines_bytes_of_the_linears_it_converts(recipe, all_gather):
    """What float8 adds to a step's memory traffic is torchao's roofline count for its recipe (bytes per element of
    each linear's input, output gradient and weight) over the linears the plugin converts, found among the
    modules of the converted model: their features per token, their weights per micro-batch, cast on the rank's
    FSDP shard with float8 all-gathers; rowwise's backward matmuls also read and write their outputs (the input's
    and the weight's gradients) once more, to scale them. The trace's count of each block's linears is what this
    sums."""
    from torchao.float8.float8_linear import Float8Linear

    from titan_float8.costs import CAST_BYTES, RESCALED_OUTPUT_BYTES
    from titan_float8.plugin import convert_modules

    config, _, plan, result = _estimate("launch.world_size=2", "+plugins=[fsdp,float8]", "training.grad_accum_steps=2",
                                        f"plugins.float8.recipe={recipe}",
                                        f"plugins.float8.fsdp_float8_all_gather={all_gather}")
    model = build_meta_model(config, plan.model)
    convert_modules(model, config, config.plugins.float8, plan)
    converted = [module for module in model.modules() if isinstance(module, Float8Linear)]
    assert len(converted) == 7 * plan.model.n_layers  # every block's linears, not the output layer
    inputs, gradients, weights = CAST_BYTES[recipe]
    rescaled = RESCALED_OUTPUT_BYTES.get(recipe, 0)
    assert (rescaled > 0) == (recipe == "rowwise")
    tokens = config.training.global_batch_size * config.training.seq_len / 2  # this rank's, over 2 micro-batches
    expected = (tokens * sum((inputs + rescaled) * m.in_features + gradients * m.out_features for m in converted)
                + 2 * (weights / (2 if all_gather else 1) + rescaled) * sum(m.weight.numel() for m in converted))
    (what, nbytes, plugin), = result.traffic_terms
    assert plugin == "float8" and recipe in what
    assert evaluated(nbytes, result) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("model", ["qwen3_moe_tiny", "deepseek_v3_tiny"])
def test_float8_speeds_up_the_share_of_the_flops_its_converted_linears_run(model):
    """float8 converts Linear layers, not a mixture of experts' stacked expert weights nor its router: its speed-up
    applies to the FLOPs of the linears it converts, found among the modules of the converted model (DeepSeek-V3's
    dense first block's feed-forward among them). It was every block parameter's share, held to 1 (Qwen3-30B-A3B's
    is 6.4: every matmul, the experts' too, planned 1.95 times faster under float8; now 1.10)."""
    from torchao.float8.float8_linear import Float8Linear

    from titan_float8.plugin import convert_modules

    config = compose(*SMALL, f"model={model}", "+plugins=[float8]")
    registry = Registry(config)
    plan = build_plan(config, registry, None, 256)
    card = hardware_profile("mi300x")  # no table measured on its chip: its float8 rate
    result = estimate(config, plan, registry, card)
    module = build_meta_model(config, plan.model)
    convert_modules(module, config, config.plugins.float8, plan)
    converted = {name: m for name, m in module.named_modules() if isinstance(m, Float8Linear)}
    if model == "deepseek_v3_tiny":
        assert "layers.0.mlp.gate_proj" in converted  # not skipped by the router's "mlp.gate"
    share = 6 * sum(m.weight.numel() for m in converted.values()) / plan.model.flops_per_token(config.training.seq_len)
    assert 0 < share < 0.9
    speedup = 1 / ((1 - share) + share * card.matmul_tflops() / card.matmul_tflops(float8=True))
    assert evaluated(result.matmul_speedup, result) == pytest.approx(speedup, rel=1e-9)


def test_float8_all_gathers_move_one_byte_for_the_weights_it_converts_only():
    """With fsdp_float8_all_gather FSDP gathers the converted linears' weights in float8 and the rest (norms,
    embeddings, the output layer, a mixture of experts' experts) in the compute dtype: on Qwen3-MoE the gathers'
    bytes fall by the converted weights' share, found among the modules of the converted model. Every gathered
    weight was priced at one byte (experts and output too: Qwen3-30B-A3B's gathers at half their bytes)."""
    from torchao.float8.float8_linear import Float8Linear

    from titan_float8.plugin import convert_modules

    def gathered(result):
        return next(evaluated(c.bytes, result) for c in result.collectives if c.name == "all-gather of the weights")

    stack = ("model=qwen3_moe_tiny", "launch.world_size=2", "+plugins=[fsdp,float8]")
    config, _, plan, narrow = _estimate(*stack, "plugins.float8.fsdp_float8_all_gather=true")
    wide = _estimate(*stack)[3]
    module = build_meta_model(config, plan.model)
    convert_modules(module, config, config.plugins.float8, plan)
    converted = sum(m.weight.numel() for m in module.modules() if isinstance(m, Float8Linear))
    total = sum(p.numel() for p in module.parameters())
    assert 0 < converted < total / 2  # the experts and the embeddings stay in the compute dtype
    itemsize = wide.compute_dtype.itemsize
    assert gathered(narrow) / gathered(wide) == pytest.approx((converted + itemsize * (total - converted))
                                                             / (itemsize * total), rel=1e-6)


def _llama3_8b_tp8_rank(recipe):
    """The estimate of Llama 3 8B's rank on 64 H100s, FSDP 8 x TP 8 (TorchTitan's June 2025 job), with the float8
    recipe given (None: bf16), and its step's seconds of matmuls."""
    float8 = [] if recipe is None else ["float8", f"plugins.float8.recipe={recipe}"]
    plugins = ",".join(["fsdp", "tp", "compile", *float8[:1]])
    _, estimate = job_estimate(["--hardware", "h100_sxm_96gb", "model=8B", "launch.world_size=64",
                                "training.seq_len=8192", "training.global_batch_size=96", f"+plugins=[{plugins}]",
                                "plugins.tp.degree=8", *float8[1:]])
    rank = estimate.most_loaded()
    return rank, rank.step_seconds()["matmul"]


def test_rowwise_on_an_h100_prices_each_linear_at_the_speedup_measured_for_its_shape():
    """On an H100 (a profile of the GH100 chip) each rowwise linear's forward and backward take its bf16 time over
    the table's speed-up at the shape the rank computes it on (M: a micro-batch's tokens, gathered under sequence
    parallel; K, N: its features after tp 8), its casts included: no cast traffic term. At 8B's shapes under tp 8
    that is slower than bf16, as TorchTitan measured (3,709 tokens/s against bf16's 4,378); priced at the float8
    rate plus the casts' bytes, it was planned 7% faster (5,048 against 4,705). Tensorwise reads the same table
    times TENSORWISE_OVER_ROWWISE, held to FLOAT8_PEAK_GAIN: faster than bf16 there, as TorchTitan measured (5,078);
    at its one float8 rate it was planned 1.5 times faster than bf16 once tp cast its inputs on the shards."""
    from titan_float8.measured import FLOAT8_PEAK_GAIN, H100_ROWWISE, H100_TENSORWISE, TENSORWISE_OVER_ROWWISE, speedup

    assert all(cell == min(FLOAT8_PEAK_GAIN, TENSORWISE_OVER_ROWWISE * rowwise)
               for planes in zip(H100_TENSORWISE, H100_ROWWISE) for rows in zip(*planes) for cell, rowwise in zip(*rows))
    _, bf16_matmul = _llama3_8b_tp8_rank(None)
    dim, kv, hidden, tokens = 4096, 1024, 14336, 12 * 8192
    shapes = [(dim, dim / 8), (dim, kv / 8), (dim, kv / 8), (dim / 8, dim), (dim, hidden / 8), (dim, hidden / 8),
              (hidden / 8, dim)]  # (K, N) of wq, wk, wv, wo, w1, w3, w2 on a rank
    for recipe, table, within in (("rowwise", H100_ROWWISE, (1.3, 1.4)), ("tensorwise", H100_TENSORWISE, (0.8, 0.9))):
        rank, matmul = _llama3_8b_tp8_rank(recipe)
        assert not rank.traffic_terms
        ratio = (sum(k * n / speedup(table, tokens, k, n) for k, n in shapes) / sum(k * n for k, n in shapes))
        assert within[0] < ratio < within[1], (recipe, ratio)  # rowwise slower than bf16 at these shapes
        linear_share = 6 * 32 * sum(k * n for k, n in shapes) * 8 / rank.plan.model.flops_per_token(8192)
        # (the plugin's share counts the blocks' norms' weights too: 5e-6 of it)
        assert matmul / bf16_matmul == pytest.approx((1 - linear_share) + linear_share * ratio, rel=1e-4)


@pytest.mark.parametrize("overrides", [
    ("+plugins=[tp,float8]", "plugins.tp.degree=2"),
    ("+plugins=[tp,float8]", "plugins.tp.degree=2", "plugins.tp.sequence_parallel=false"),
    ("+plugins=[fsdp,tp,float8]", "plugins.fsdp.degree=2", "plugins.tp.degree=2", "model=qwen3_tiny"),
], ids=["tp", "tp-no-sp", "fsdp-tp-qwen3"])
def test_each_linear_computes_on_what_the_planner_says_under_tensor_parallel(overrides):
    """Each linear of a real step (rank 0 on a fake group) computes on its input and makes its result at the sizes
    ``Estimate.rank_linears`` gives, which float8 casts: a column-wise linear's input whole (sequence parallel
    gathers it) and its result split, a row-wise linear's input split and its result whole (a partial sum). float8
    used to divide every linear's input and result by the blocks' blended activation split (1.56 here: a
    column-wise input counted 1.56 times too small, a row-wise one 1.28 times too large; Llama 3 8B with tp 8, 5.24:
    rowwise's casts a step 2.26 times what was counted)."""
    config, registry, plan, result = _estimate("launch.device=cpu", *overrides)
    measured = _on_rank0(tracked_rank.linear_elements, config, registry, plan)
    planned = {(i, path): (linear.inputs * result.microbatch_tokens, linear.outputs * result.microbatch_tokens)
               for i in result.blocks for path, linear in result.rank_linears(i).items()}
    assert planned.keys() == measured.keys() and len(planned) == 7 * plan.model.n_layers
    for key, (inputs, outputs) in measured.items():
        assert planned[key] == pytest.approx((inputs, outputs)), key


@pytest.mark.parametrize("model", ["tiny", "qwen3_tiny", "gpt2_tiny"])
def test_the_trace_counts_the_operators_a_step_runs(model):
    """The host issues a step's operators one by one: the trace's count, with the optimizer's counted per group
    and per tensor (torch's batched AdamW: 119 to 188 a step on these models), within 10% of the worker's step."""
    config, registry, plan, result = _estimate("launch.device=cpu", f"model={model}")
    issued, optimizer = _on_rank0(tracked_rank.operators, config, registry, plan)
    assert evaluated(result.optimizer_operators, result) == pytest.approx(optimizer, rel=0.05)
    traced = sum(result.facts.block_ops) + result.facts.outer_ops + evaluated(result.optimizer_operators, result)
    assert traced == pytest.approx(issued, rel=0.1)
    assert len(set(result.facts.block_ops)) == 1  # alike blocks, alike counts


def test_each_call_pays_the_latency_and_each_operator_the_host_time():
    *_, one = _estimate()
    *_, tp = _estimate("+plugins=[tp]", "plugins.tp.degree=2")
    later = dataclasses.replace(CPU, collective_latency_us=CPU.collective_latency_us + 100)
    calls = sum(tp.collective_calls(c) for c in tp.collectives)
    waited = dataclasses.replace(tp, hardware=later).step_seconds()["exposed communication"]
    assert waited - tp.step_seconds()["exposed communication"] == pytest.approx(calls * 100e-6)
    one_core = dataclasses.replace(CPU, cores=1)  # on a CPU the same thread issues the operators and computes
    one, tp = (dataclasses.replace(e, hardware=one_core) for e in (one, tp))
    ops = sum(one.facts.block_ops) + one.facts.outer_ops + evaluated(one.optimizer_operators, one)
    assert one.step_seconds()["host"] == pytest.approx(ops * CPU.op_overhead_us * 1e-6)
    assert tp.step_seconds()["host"] > 10 * one.step_seconds()["host"]  # DTensor's sharding propagation
    gpu = dataclasses.replace(one, hardware=dataclasses.replace(CPU, op_overhead_us=1e-3))  # a host ahead
    assert gpu.step_seconds()["host"] == 0 and gpu.step_seconds()["step"] < one.step_seconds()["step"]
    optimizer = dataclasses.replace(one, hardware=dataclasses.replace(CPU, memory_gbps=CPU.memory_gbps / 2))
    assert optimizer.step_seconds()["optimizer"] == pytest.approx(2 * one.step_seconds()["optimizer"])
    assert 50 < one.optimizer_bytes < 150  # AdamW's batched update: several passes over 16 bytes per parameter
    assert one.optimizer_state_bytes == 8  # its two float32 moments


def test_this_cpu_is_measured_and_each_worker_runs_on_its_threads_within_its_share_of_the_cores():
    import os

    cpu = hardware_profile("cpu-measured")
    assert (cpu.device_type, cpu.cores) == ("cpu", os.cpu_count()) and cpu.bf16_tflops > 0 and cpu.memory_gbps > 0
    *_, four = _estimate("+plugins=[fsdp]", "plugins.fsdp.degree=4", "launch.world_size=4")
    for cores, sharing in ((4, 1), (2, 2), (1, 4)):
        shared = dataclasses.replace(four, hardware=dataclasses.replace(CPU, cores=cores))
        assert shared.step_seconds()["matmul"] == pytest.approx(four.step_seconds()["matmul"] * sharing)
    *_, one = _estimate()
    threaded = dataclasses.replace(one, hardware=dataclasses.replace(CPU, cores=2))
    assert threaded.step_seconds()["matmul"] == pytest.approx(one.step_seconds()["matmul"] / 2)
    *_, two = _estimate("+plugins=[fsdp]", "plugins.fsdp.degree=2", "launch.world_size=2")
    *_, two_threads_each = _estimate("+plugins=[fsdp]", "plugins.fsdp.degree=2", "launch.world_size=2",
                                     "launch.cpu_threads_per_worker=2")
    for cores, speed in ((8, 2), (4, 2), (2, 1)):  # two threads each, as long as the cores go round
        with_cores = dataclasses.replace(CPU, cores=cores)
        assert (dataclasses.replace(two_threads_each, hardware=with_cores).step_seconds()["matmul"]
                == pytest.approx(dataclasses.replace(two, hardware=CPU).step_seconds()["matmul"] / speed))
