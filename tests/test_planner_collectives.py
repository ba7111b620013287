"""The planner's collectives: the calls and bytes each plugin states against those its ranks issue (a fake process
group, or a real world for ep and cp), and what each first-party technique changes in the estimate."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_core.parameter_roles import parameter_role
from titan_core.plugins import build_meta_model
from titan_core.planner.estimate import evaluated

# What the planner's tests share, loaded by path as tracked_rank.py is (tests/ is not on the path).
spec = importlib.util.spec_from_file_location("planner_cases", Path(__file__).with_name("planner_cases.py"))
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
SMALL, DISTRIBUTED, TP_NO_SP = cases.SMALL, cases.DISTRIBUTED, cases.TP_NO_SP
tracked_rank, _estimate, _on_rank0 = cases.tracked_rank, cases._estimate, cases._on_rank0


def assert_issued_as_planned(world: int, tmp_path, overrides, result) -> None:
    """Every rank of a real world of ``world`` counts the collective calls it issues: each equals the plan's."""
    ranks = subprocess.run([sys.executable, tracked_rank.__file__, str(world), str(tmp_path), "--calls", *overrides],
                           timeout=300, capture_output=True, text=True)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    for rank in range(world):
        issued = json.loads((tmp_path / f"rank{rank}.json").read_text())["calls"]
        assert sum(result.collective_calls(c) for c in result.collectives) == issued, (rank, issued)


def test_each_plugin_changes_what_its_technique_changes():
    *_, alone = _estimate()
    *_, sharded = _estimate("+plugins=[fsdp]", "plugins.fsdp.degree=4", "launch.world_size=4")
    *_, split = _estimate("+plugins=[tp]", "plugins.tp.degree=2")
    *_, checkpointed = _estimate("+plugins=[ac]", "plugins.ac.mode=full")
    *_, pipelined = _estimate("+plugins=[pp]", "plugins.pp.degree=2", "plugins.pp.microbatches=4")
    *_, ring = _estimate("+plugins=[cp]", "plugins.cp.degree=2")
    base = alone.memory()
    assert sharded.memory()["optimizer"] == pytest.approx(base["optimizer"] / 4)
    assert [c.name for c in sharded.collectives if c.plugin == "fsdp"] == ["all-gather of the weights",
                                                                          "reduce-scatter of the gradients"]
    assert split.memory()["optimizer"] == pytest.approx(base["optimizer"] / 2)
    assert [(c.plugin, c.overlapped) for c in split.collectives] == [("core", False), ("tp", False)]
    assert checkpointed.kept_per_token() < alone.kept_per_token() / 3
    assert checkpointed.recomputed_fraction == pytest.approx(1 / 3)
    assert ring.microbatch_tokens == alone.microbatch_tokens / 2
    stages = pipelined.most_loaded()
    assert pipelined.bubble == pytest.approx(1 / 5)  # (2 - 1) / (4 micro-batches + 2 - 1)
    assert len(stages.blocks) == alone.plan.model.n_layers // 2
    assert {p for p in sharded.counted} == {"fsdp"} and not alone.not_counted


@pytest.mark.parametrize("overrides", [
    ("+plugins=[tp]", "plugins.tp.degree=2"), TP_NO_SP, DISTRIBUTED,
    ("+plugins=[fsdp]", "plugins.fsdp.degree=2", "training.grad_accum_steps=2"),
    ("+plugins=[fsdp]", "plugins.fsdp.degree=2", "training.grad_accum_steps=2",
     "plugins.fsdp.reduce_gradients=last_micro_batch"),
    ("+plugins=[fsdp]", "plugins.fsdp.degree=2", "plugins.fsdp.replicate_degree=2"),
    ("+plugins=[fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2"),
    ("+plugins=[simplefsdp]", "plugins.simplefsdp.degree=2", "plugins.simplefsdp.replicate_degree=2",
     "training.grad_accum_steps=2"),
    ("+plugins=[tp,ac]", "plugins.tp.degree=2", "plugins.ac.mode=full"),
    ("+plugins=[tp,ac]", "plugins.tp.degree=2", "plugins.ac.mode=selective_op", "plugins.ac.matmuls=every_other"),
    ("+plugins=[tp,ac]", "plugins.tp.degree=2", "plugins.tp.sequence_parallel=false", "plugins.ac.mode=full"),
    ("+plugins=[fsdp,tp,ac]", "plugins.fsdp.degree=2", "plugins.tp.degree=2", "plugins.ac.mode=selective_layer",
     "plugins.ac.every=2"),
    ("model=qwen3_tiny", "+plugins=[fsdp,tp]", "plugins.fsdp.degree=1", "plugins.tp.degree=2",
     "plugins.tp.sequence_parallel=false"),
    ("model=gpt_oss_tiny", "+plugins=[fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2"),
    ("model=gpt_oss_tiny", "+plugins=[fsdp,tp,ac]", "plugins.fsdp.degree=2", "plugins.tp.degree=2",
     "plugins.ac.mode=full"),
    ("model=gpt_oss_tiny", "+plugins=[fsdp,tp,ac]", "plugins.fsdp.degree=1", "plugins.tp.degree=2",
     "plugins.tp.sequence_parallel=false", "plugins.ac.mode=full"),
    ("model=qwen3_moe_tiny", "+plugins=[fsdp,tp]", "plugins.fsdp.degree=1", "plugins.fsdp.replicate_degree=2",
     "plugins.tp.degree=2"),
    ("model=deepseek_v3_tiny", "+plugins=[fsdp,tp,ac]", "plugins.fsdp.degree=2", "plugins.tp.degree=2",
     "plugins.ac.mode=full"),
], ids=["tp", "tp-no-sp", "fsdp", "fsdp-grad-accum", "fsdp-grad-accum-reduce-last", "hsdp", "fsdp-tp", "simplefsdp",
        "tp-full-ac", "tp-selective-ac", "tp-no-sp-full-ac", "fsdp-tp-every-2nd-block", "qwen3-head-norms-fsdp-1",
        "gpt-oss-fsdp-tp", "gpt-oss-fsdp-tp-full-ac", "gpt-oss-tp-no-sp-full-ac", "qwen3-moe-hsdp-tp",
        "deepseek-v3-fsdp-tp-full-ac"])
def test_collective_calls_are_those_torch_issues(overrides):
    """Each call pays the link's latency: a plugin's stated calls per step are those its rank 0 issues, a
    checkpointed block's again as it recomputes (tp's three calls of the four its forward makes with sequence
    parallel, one of two without: uncounted before). A mixture-of-experts block under tp has no feed-forward
    collectives, and its sharder makes the experts' layer a unit of its own over more ranks (gpt-oss at fsdp 2 x
    tp 2 was planned at 74 calls and issued 65); a sharder over one rank issues nothing (16 planned calls before).
    The model plugin's own hooks count too: DeepSeek-V3's balancing bias sums the experts' counts over every rank
    after each step (ExpertRouting.estimate_costs; one call short before). (Context parallel's ring exchanges do not reach the dispatcher on a fake process group: cp is not checked
    here.)"""
    config, registry, plan, result = _estimate("launch.device=cpu", *overrides)
    issued = _on_rank0(tracked_rank.collective_calls, config, registry, plan)
    assert sum(result.collective_calls(c) for c in result.collectives) == issued


@pytest.mark.parametrize("overrides, float8_gathers", [
    (("+plugins=[tp]",), False), (("+plugins=[tp]", "plugins.tp.sequence_parallel=false"), False),
    (("+plugins=[tp]", "plugins.tp.loss_parallel=false"), False), (("+plugins=[tp,float8]",), True), (("+plugins=[tp,float8,ac]", "plugins.ac.mode=full"), True),
    (("+plugins=[tp,float8]", "plugins.tp.sequence_parallel=false"), False),
    (("+plugins=[tp,float8]", "plugins.float8.recipe=rowwise"), False),
], ids=["tp", "tp-no-sp", "tp-no-loss-parallel", "tp-float8", "tp-float8-full-ac", "tp-no-sp-float8",
        "tp-float8-rowwise"])
def test_tensor_parallels_bytes_are_those_its_ranks_send(overrides, float8_gathers):
    """tp's bytes a step are those its rank sends (an all-gather its shard to each other rank, a reduce-scatter or
    an all-reduce its share): the blocks' stream, the embeddings' and the output layer's (left out until
    2026-12-06), the logits gathered whole without loss parallel. Float8's tensorwise linears have the stream
    gathered in float8 under sequence parallel, cast on the shard (e4m3 inputs forward, e5m2 gradients backward,
    a checkpointed block's inputs again as it recomputes): a quarter of the float32 bytes there (TorchTitan's
    float8 tensor-parallel styles; gathered in float32 before)."""
    config, registry, plan, result = _estimate("launch.device=cpu", "plugins.tp.degree=2", *overrides)
    issued = _on_rank0(tracked_rank.collective_bytes, config, registry, plan)
    float8 = {name: size for name, size in issued.items() if "float8" in name}
    assert bool(float8) == float8_gathers, issued
    if float8_gathers:
        assert set(float8) == {"all_gather_into_tensor float8_e4m3fn", "all_gather_into_tensor float8_e5m2"}
    sent = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1 / 2, "all_reduce": 1, "allreduce_": 1}  # tp 2
    streams = next(c for c in result.collectives if c.plugin == "tp")
    tokens = next(c for c in result.collectives if c.plugin != "tp")  # the core's count of the trained tokens
    assert len(result.collectives) == 2
    assert (sum(size * sent[name.split()[0]] for name, size in issued.items())
            == evaluated(streams.bytes, result) + evaluated(tokens.bytes, result))


@pytest.mark.parametrize("policy, per_step", [("every_micro_batch", 4), ("last_micro_batch", 1)])
def test_fsdp_reduces_each_micro_batch_or_only_the_last(policy, per_step):
    """Under 4 accumulated micro-batches FSDP reduce-scatters each unit's gradients 4 times a step, or once with
    reduce_gradients=last_micro_batch, whose whole gradients held until then the planner counts as a buffer."""
    config, registry, plan, result = _estimate("launch.device=cpu", "+plugins=[fsdp]", "plugins.fsdp.degree=2",
                                               "training.grad_accum_steps=4", f"plugins.fsdp.reduce_gradients={policy}")
    issued = _on_rank0(tracked_rank.reduce_scatters, config, registry, plan)
    units = plan.model.n_layers + 2  # each block, the embeddings, the final norm with the output (the root: none)
    assert issued == per_step * units, issued
    held = [term for term in result.memory_terms if "until the last micro-batch" in term[1]]
    assert len(held) == (policy == "last_micro_batch")


def test_expert_parallel_gathers_only_its_experts_and_waits_for_the_all_to_all():
    """fsdp 4 x ep 2 on gpt-oss: each rank gathers (and reduces) half of every block's experts, holds the same
    states as fsdp 4 alone, and sends its token copies (2 per token) to their experts and back, in forward and in
    backward."""
    tiny = ("model=gpt_oss_tiny", "launch.world_size=4", "plugins.fsdp.degree=4")
    *_, fsdp = _estimate(*tiny, "+plugins=[fsdp]")
    *_, ep = _estimate(*tiny, "+plugins=[fsdp,ep]", "plugins.ep.degree=2")
    facts = ep.facts
    experts = sum(facts.block_expert_params)
    assert experts > sum(facts.block_params) / 2  # most of each block
    assert ep.held_gathered() == pytest.approx(fsdp.held_gathered() - experts / 2)
    assert ep.memory()["optimizer"] == pytest.approx(fsdp.memory()["optimizer"])
    assert "ep" in ep.counted and not ep.not_counted
    copy_bytes = 2 * 64 * torch.finfo(ep.compute_dtype).bits // 8  # 2 copies of a 64-wide token
    assert facts.block_expert_input == (copy_bytes,) * 4
    [all_to_all] = [c for c in ep.collectives if c.plugin == "ep"]
    step_tokens = ep.microbatch_tokens * ep.microbatches_per_step()
    assert evaluated(all_to_all.bytes, ep) == pytest.approx(4 * 4 * copy_bytes * step_tokens / 2)
    assert ep.collective_calls(all_to_all) == 5 * 4 * ep.microbatches_per_step()
    # Routed unevenly, the busiest rank receives 1.5 times its share: its experts keep, compute and exchange that.
    uneven = dataclasses.replace(ep, expert_load=1.5)
    assert facts.block_expert_copies == (2,) * 4 and 0 < facts.block_expert_saved[0] < facts.block_saved[0]
    assert uneven.memory()["activations"] - ep.memory()["activations"] == pytest.approx(
        0.5 * ep.microbatch_tokens * sum(facts.block_expert_saved))
    assert uneven.uneven_expert_flops() == pytest.approx(0.5 * 6 * 2 * experts / ep.plan.model.experts.count * step_tokens)
    assert evaluated(all_to_all.bytes, uneven) == pytest.approx(1.5 * evaluated(all_to_all.bytes, ep))
    # As loaded in its busiest micro-batch only: it keeps that much more at its peak, and computes and sends as even.
    peaked = dataclasses.replace(ep, expert_load_peak=1.5)
    assert peaked.memory() == uneven.memory() and peaked.peak_expert_load == 1.5
    assert peaked.uneven_expert_flops() == 0 and evaluated(all_to_all.bytes, peaked) == evaluated(all_to_all.bytes, ep)


@pytest.mark.slow
@pytest.mark.parametrize("world, ac, repeated", [(2, (), 0), (2, ("plugins.ac.mode=full",), 4),
                                                 (2, ("plugins.ac.mode=selective_layer", "plugins.ac.every=2"), 2),
                                                 (4, (), 0)],
                         ids=["no-ac", "full", "every-2nd-block", "experts-sharded-over-2"])
def test_expert_parallel_calls_are_those_its_ranks_issue(world, ac, repeated, tmp_path):
    """fsdp x ep 2 on gpt-oss, each rank of a real world counting what it issues (an all-to-all's sizes come from
    the other rank, which a fake group cannot make up): every collective call counted, and a checkpointed block's
    three exchanges made again as it recomputes its forward (uncounted before: 3 per recomputed block and
    micro-batch fewer than issued). On 4 ranks the experts are sharded over the 2 that ep leaves, units of their
    own that fsdp gathers and reduces (Estimate.sparse_units; 11 calls a step uncounted before)."""
    overrides = (*SMALL, "model=gpt_oss_tiny", "launch.device=cpu", f"launch.world_size={world}",
                 f"plugins.fsdp.degree={world}", "plugins.ep.degree=2", f"+plugins=[fsdp,ep{',ac' if ac else ''}]", *ac)
    config, registry, plan, result = _estimate(*overrides)
    [all_to_all] = [c for c in result.collectives if c.plugin == "ep"]
    assert result.collective_calls(all_to_all) == (5 * 4 + 3 * repeated) * result.microbatches_per_step()
    assert_issued_as_planned(world, tmp_path, overrides, result)


@pytest.mark.slow
@pytest.mark.parametrize("world, overrides", [
    (2, ("+plugins=[cp,ac]", "plugins.cp.degree=2", "plugins.ac.mode=full")),
    (2, ("+plugins=[cp,ac]", "plugins.cp.degree=2", "plugins.ac.mode=selective_op")),
    (2, ("+plugins=[cp,ac]", "plugins.cp.degree=2", "plugins.ac.mode=selective_op",
         "training.attention_mask=block_causal")),
    (4, ("+plugins=[cp,ac]", "plugins.cp.degree=4", "plugins.ac.mode=full", "plugins.cp.rotate_method=alltoall")),
    (4, ("+plugins=[tp,cp,ac]", "plugins.tp.degree=2", "plugins.cp.degree=2", "plugins.ac.mode=full")),
], ids=["ring-full-ac", "ring-selective-ac", "documents-selective-ac", "ring-alltoall-4-full-ac", "tp-2-full-ac"])
def test_context_parallel_calls_are_those_its_ranks_issue(world, overrides, tmp_path):
    """cp on a real world of ``world`` ranks, each counting what it issues (torch's ring exchanges too, issued out
    of a dispatch mode's sight): the ring's gradients travel in ``degree`` exchanges, and a block that recomputes
    its attention exchanges its keys and values again (selective checkpointing keeps attention's results); masked
    attention gathers keys, values, positions and document ids, again as a block recomputes, and reduce-scatters
    the gradients (before: 3 calls per block and micro-batch, 4 to 8 issued here); with tp, its recomputed calls
    besides."""
    overrides = (*SMALL, "launch.device=cpu", f"launch.world_size={world}", *overrides)
    config, registry, plan, result = _estimate(*overrides)
    assert_issued_as_planned(world, tmp_path, overrides, result)


def test_an_optimizer_plugin_is_counted_with_its_state_its_work_and_its_collectives():
    """muon keeps one float32 momentum per matrix element and AdamW's two moments for the rest; under fsdp 4 each
    rank orthogonalises a quarter of the matrices, receives of those the 3/4 of rows it does not hold as float32,
    and of each other matrix its own quarter back as bfloat16; the Newton–Schulz work lengthens the step."""
    config, registry, plan, muon = _estimate("+plugins=[fsdp,muon]", "plugins.fsdp.degree=4")
    adamw = _estimate("+plugins=[fsdp]", "plugins.fsdp.degree=4")[3]
    model = build_meta_model(config, plan.model)
    shapes = [p.shape for n, p in model.named_parameters() if parameter_role(plan.model, n, p) == "matrix"]
    matrices = sum(shape.numel() for shape in shapes)
    share = matrices / sum(p.numel() for p in model.parameters())
    assert muon.optimizer_state_bytes == pytest.approx(4 * share + 8 * (1 - share)) and 4 < muon.optimizer_state_bytes < 8
    sent = {c.name: evaluated(c.bytes, muon) for c in muon.collectives if c.plugin == "muon"}
    assert sent == pytest.approx({"all-to-all of the Muon updates to their owners": matrices * 4 * 3 / 16,
                                  "all-to-all of the orthogonalised rows back": matrices * 2 * 3 / 16})
    work = sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes) / 4
    assert [evaluated(flops, muon) for _, flops, plugin in muon.flops_terms if plugin == "muon"] == [pytest.approx(work)]
    assert muon.step_seconds()["matmul"] > adamw.step_seconds()["matmul"]
