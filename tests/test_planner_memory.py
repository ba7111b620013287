"""The planner's peak memory against torch's memory tracker over the worker's own step: one rank on a fake process
group or each rank on its own real world (tp, fsdp, cp, ac, float8, chunked_loss, simplefsdp, mixtures of experts,
the loss, the attention masks, the optimizer's step, every CI stack)."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_core.planner.cli import job_estimate
from titan_core.planner.estimate import evaluated

# What the planner's tests share, loaded by path as tracked_rank.py is (tests/ is not on the path).
spec = importlib.util.spec_from_file_location("planner_cases", Path(__file__).with_name("planner_cases.py"))
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
SMALL, DISTRIBUTED, TP_NO_SP = cases.SMALL, cases.DISTRIBUTED, cases.TP_NO_SP
_estimate, _tracked_step, _each_rank_tracked = cases._estimate, cases._tracked_step, cases._each_rank_tracked
_term = cases._term


@pytest.mark.parametrize("overrides", [
    (), ("+plugins=[ac]", "plugins.ac.mode=full"), ("+plugins=[ac]", "plugins.ac.mode=selective_op"),
    ("+plugins=[ac]", "plugins.ac.mode=selective_op", "plugins.ac.matmuls=every_other"),
    ("+plugins=[ac]", "plugins.ac.mode=selective_layer", "plugins.ac.every=2"), ("training.grad_accum_steps=2",),
    ("model=qwen3_tiny",), ("model=qwen3_tiny", "+plugins=[ac]", "plugins.ac.mode=full"),
    ("model=gpt2_tiny", "+plugins=[ac]", "plugins.ac.mode=full"),
    DISTRIBUTED, ("+plugins=[fsdp]", "plugins.fsdp.degree=2", "plugins.fsdp.replicate_degree=2"),
    ("+plugins=[fsdp,ac]", "plugins.fsdp.degree=4", "plugins.ac.mode=full"),
    ("+plugins=[fsdp]", "plugins.fsdp.degree=2", "training.grad_accum_steps=2", "plugins.fsdp.reduce_gradients=last_micro_batch"),
    ("+plugins=[tp]", "plugins.tp.degree=2"), TP_NO_SP, ("+plugins=[fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2"),
    ("+plugins=[tp,ac]", "plugins.tp.degree=2", "plugins.ac.mode=full"),
    ("+plugins=[tp,ac]", "plugins.tp.degree=2", "plugins.tp.sequence_parallel=false", "plugins.ac.mode=selective_op"),
    ("+plugins=[cp]", "plugins.cp.degree=2"), ("+plugins=[fsdp,cp]", "plugins.fsdp.degree=2", "plugins.cp.degree=2"),
    ("+plugins=[float8]",),
    ("+plugins=[fsdp,float8]", "plugins.fsdp.degree=2", "plugins.float8.fsdp_float8_all_gather=true"),
    ("+plugins=[tp,float8]", "plugins.tp.degree=2"),
    ("+plugins=[tp,float8,ac]", "plugins.tp.degree=2", "plugins.ac.mode=full"),
    ("+plugins=[tp,float8,ac]", "plugins.tp.degree=2", "plugins.ac.mode=selective_op"),
    ("+plugins=[chunked_loss]", "plugins.chunked_loss.chunk_tokens=128"),
    ("+plugins=[chunked_loss,tp]", "plugins.chunked_loss.chunk_tokens=128", "plugins.tp.degree=2"),
    ("+plugins=[simplefsdp]", "plugins.simplefsdp.degree=4"),
    ("+plugins=[simplefsdp,ac]", "plugins.simplefsdp.degree=4", "plugins.ac.mode=full"),
], ids=["none", "ac-full", "ac-selective_op", "ac-selective_op-every-other-matmul", "ac-selective_layer", "grad-accum", "qwen3", "qwen3-ac-full",
        "gpt2-ac-full", "fsdp", "hsdp", "fsdp-ac-full", "fsdp-reduce-last-micro-batch", "tp", "tp-no-sp", "fsdp-tp", "tp-ac-full",
        "tp-no-sp-ac-selective_op", "cp", "fsdp-cp", "float8",
        "fsdp-float8", "tp-float8", "tp-float8-ac-full", "tp-float8-ac-selective_op",
        "chunked_loss", "chunked_loss-tp", "simplefsdp", "simplefsdp-ac-full"])
def test_predicted_peak_matches_torchs_memory_tracker(overrides, tmp_path):
    """Within 5% of torch's tracker, every rank of each plan running the worker's own step, a plan of several
    ranks on its own real gloo world. Without its estimate, chunked_loss was 6-9% over (the logits it never keeps)
    and simplefsdp 40% over with full checkpointing (weights a checkpointed block gathers again, not kept); fsdp
    reducing only the last micro-batch was 9% over while it counted the gradients' shards beside the whole ones;
    tp 2 with float8 11% over when tp's float8 gathers came (what the linears keep of them is float8)."""
    config, registry, plan, result = _estimate("launch.device=cpu", *overrides)
    assert not result.not_counted
    if plan.world_size == 1:
        ranks = [(0, result, _tracked_step(config, registry, plan))]
    else:
        ranks = list(_each_rank_tracked(("launch.device=cpu", *overrides), tmp_path))
    for rank, estimated, measured in ranks:
        predicted = estimated.memory()
        assert (measured["float8_linears"] == 7 * 4) == ("float8" in str(overrides))  # its linears ran float8
        if "fsdp" not in str(overrides):  # FSDP's gathered weights are parameters to the tracker, buffers to us
            assert predicted["parameters"] == pytest.approx(measured["PARAM"], rel=0.01)  # tp leaves norms whole
        assert predicted["optimizer"] == pytest.approx(measured["OPT"], rel=0.01)  # and AdamW's step counters
        error = sum(predicted.values()) / measured["Total"] - 1
        print(f"rank {rank}: {error:+.1%}")
        assert abs(error) < 0.05, (rank, error)


@pytest.mark.parametrize("overrides", [
    ("model=gpt_oss_tiny",), ("model=deepseek_v3_tiny",), ("model=gpt_oss_tiny", "+plugins=[ac]", "plugins.ac.mode=full"),
    ("model=deepseek_v3_tiny", "training.grad_accum_steps=2"),
], ids=["gpt-oss", "deepseek-v3", "gpt-oss-ac-full", "deepseek-v3-two-micro-batches"])
def test_a_mixture_of_experts_is_planned_within_2_percent_of_torchs_tracker_at_the_load_it_ran(overrides):
    """The core's MoE traced on meta tensors with every expert evenly loaded, then planned at the load the step
    measured (its experts' rows per copy routed: this CPU's kernel pads every expert's batch to the busiest one's,
    1.21-1.26 here) and its memory at the busiest micro-batch's, as the model plugin's object measured it (1.33
    against the step's 1.28 with two). Evenly routed, the plan was 2.3% to 6.1% under; leaving out the experts'
    activations would miss a third."""
    config, registry, plan, result = _estimate("launch.device=cpu", *overrides)
    measured = _tracked_step(config, registry, plan)
    assert measured["expert_load_peak"] >= measured["expert_load"] > 1.15  # the terms are exercised
    assert result.memory()["parameters"] == pytest.approx(measured["PARAM"], rel=0.01)
    uneven = dataclasses.replace(result, expert_load=measured["expert_load"],
                                 expert_load_peak=measured["expert_load_peak"]).memory()
    assert abs(sum(uneven.values()) / measured["Total"] - 1) < 0.02
    assert sum(uneven.values()) > sum(result.memory().values())


@pytest.mark.slow
def test_a_compiled_loss_holds_what_the_planner_counts():
    """The core's loss, on bf16 logits, measured in a fresh interpreter (loss_memory.py): eager, it keeps their
    float32 log-probabilities (2x the logits' bytes) and its backward holds two float32 gradients (4x); compiled,
    it keeps the logits themselves (1x) and its backward holds their gradient (1x). The planner's facts, eager
    and with compile_loss (``ModelFacts.with_fused_loss``), count the same, within 5% (2 against 1 is what a
    planner counting the compiled loss as eager would be off by); the compiled backward's at most."""
    script = Path(__file__).with_name("loss_memory.py")
    measuring = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert measuring.returncode == 0, measuring.stderr[-3000:]
    measured = json.loads(measuring.stdout.splitlines()[-1])
    _, estimate = job_estimate([*SMALL, "launch.device=cpu", "+plugins=[compile]", "plugins.compile.compile_loss=true"])
    eager = estimate.facts_in(estimate.compute_dtype, {}, estimate.autocasts)
    assert estimate.compute_dtype == torch.bfloat16 and estimate.facts is eager.with_fused_loss  # what the peak reads
    fused = eager.with_fused_loss
    for facts, holds in ((eager, measured["eager"]), (fused, measured["compiled"])):
        print(f"kept {holds['kept']:.3f} (planned {facts.outer_logits / facts.output:.3f}), backward "
              f"{holds['backward']:.3f} (planned {facts.loss_backward / facts.output:.3f}) x the logits")
        assert facts.outer_logits / facts.output == pytest.approx(holds["kept"], rel=0.05)
    assert eager.loss_backward / eager.output == pytest.approx(measured["eager"]["backward"], rel=0.05)
    # The compiled backward is one kernel, reading the kept logits as it writes their gradient: both exist as it
    # ends, and the loss lets go of the logits right after, sooner than a sampler of the resident memory can be
    # sure to look (measured 0.73x to 1.0x): bounded from above.
    assert measured["compiled"]["backward"] < 1.05 * fused.loss_backward / fused.output


@pytest.mark.parametrize("overrides", [(), ("plugins.tp.sequence_parallel=false",), ("plugins.tp.loss_parallel=false",)],
                         ids=["loss-parallel", "loss-parallel-without-sequence-parallel", "logits-gathered"])
def test_tensor_parallels_logits_match_the_tracker_where_they_make_the_peak(overrides):
    """tp 2 on a vocabulary of 16,384, whose logits and the loss's tensors of their shape are most of the peak:
    within 1%. Under loss parallel the logits' gradients are split by vocabulary (``logits_split``; divided by the
    split blended with the outputs' other tensors, this plan was 21% under and Llama 3 70B's widths at 2 x 8,192
    tokens a rank 36% over, where the outputs' other tensors are larger), torch's loss-parallel backward makes a
    third float32 tensor of their shape, and with sequence parallel the final norm's tensors stay split."""
    config, registry, plan, result = _estimate("launch.device=cpu", "training.seq_len=256", "model.vocab_size=16384",
                                               "+plugins=[tp]", "plugins.tp.degree=2", *overrides)
    measured = _tracked_step(config, registry, plan)
    logits = config.training.global_batch_size * config.training.seq_len * 16384 * 4 / result.logits_split  # float32
    assert result.logits_split == (1 if "plugins.tp.loss_parallel=false" in overrides else 2)
    assert measured["Total"] > 3 * logits  # the loss's tensors of the logits' shape are most of the peak
    assert abs(sum(result.memory().values()) / measured["Total"] - 1) < 0.01


def test_tensor_parallels_embedding_gradient_stays_whole_while_it_accumulates():
    """The backward of tp's vocabulary-split embedding makes the whole table's gradient, a partial sum over the tp
    ranks: FSDP accumulating gradients unreduced over micro-batches keeps it whole, in float32
    (``Estimate.grad_whole_params``), beside the shards. FSDP 2 x TP 2, two micro-batches reduced in the last, a
    vocabulary of 16,384: within 0.5% of torch's tracker (measured: 0.01%); without the whole table, 6.5% under.
    Found on a 405B pipeline's first stage, whose micro-batches accumulate alike (7.8 GiB there)."""
    config, registry, plan, result = _estimate("launch.device=cpu", "model.vocab_size=16384", "+plugins=[fsdp,tp]",
                                               "plugins.fsdp.degree=2", "plugins.tp.degree=2",
                                               "plugins.fsdp.param_dtype=bfloat16", "training.grad_accum_steps=2",
                                               "plugins.fsdp.reduce_gradients=last_micro_batch")
    measured = _tracked_step(config, registry, plan)
    planned = sum(result.memory().values())
    whole = sum(dataclasses.replace(result, grad_whole_params=0.0).memory().values())
    assert planned - whole == evaluated(result.grad_whole_params, result) * 4 > 0.05 * measured["Total"]
    assert abs(planned / measured["Total"] - 1) < 0.005


@pytest.mark.parametrize("overrides", [("training.grad_accum_steps=2",),
                                       ("+plugins=[ac]", "plugins.ac.mode=full", "training.grad_accum_steps=4")],
                         ids=["two-micro-batches", "four-checkpointed"])
def test_autograd_keeps_tensor_parallels_embedding_gradient_whole_across_micro_batches(overrides):
    """Without a sharder holding the gradients, the first micro-batch's backward leaves in tp's vocabulary-split
    embedding the whole table's gradient (a replicated tensor), and the next ones add into it: the core counts it
    beside the split gradients. TP 2, a vocabulary of 16,384: within 0.5% of torch's tracker (measured: 0.04%);
    without it, 3.7% and 5.7% under."""
    config, registry, plan, result = _estimate("launch.device=cpu", "model.vocab_size=16384", "+plugins=[tp]",
                                               "plugins.tp.degree=2", *overrides)
    measured = _tracked_step(config, registry, plan)
    planned = sum(result.memory().values())
    held = sum(dataclasses.replace(result, sharder_holds_gradients=True).memory().values())
    assert planned - held == evaluated(result.grad_whole_params, result) * 4 > 0.03 * measured["Total"]
    assert abs(planned / measured["Total"] - 1) < 0.005


@pytest.mark.parametrize("overrides", [
    ("training.seq_len=512", "training.attention_mask=block_causal"),
    ("model=gpt_oss_tiny", "training.seq_len=512"),
    ("model=gpt_oss_tiny", "training.seq_len=256", "training.attention_mask=block_causal", "+plugins=[ac]",
     "plugins.ac.mode=full"),
], ids=["documents", "windows-and-sinks", "documents-windows-sinks-ac-full"])
def test_the_attention_masks_the_kernels_keep_are_counted_once(overrides):
    """The fused kernels keep the masks they are handed, which the blocks of a micro-batch share (by document: the
    micro-batch's rows; gpt-oss's sliding and full blocks without documents: one set for every micro-batch): traced,
    and counted by query and key. Within 1% of torch's tracker (measured: 0.1%, 0.4%, 0.4%); the planner was 24%
    and 3.6% under with a mask a block, counted as a token's bytes at 64 traced positions. gpt-oss's experts are
    planned at the load they ran."""
    config, registry, plan, result = _estimate("launch.device=cpu", *overrides)
    measured = _tracked_step(config, registry, plan)
    result = dataclasses.replace(result, expert_load=max(1.0, measured["expert_load"]),
                                 expert_load_peak=max(1.0, measured["expert_load_peak"]))
    assert result.mask_bytes() > 0.015 * measured["Total"]
    assert abs(sum(result.memory().values()) / measured["Total"] - 1) < 0.01


@pytest.mark.parametrize("overrides, what", [
    (("plugins.fsdp.degree=4", "plugins.fsdp.reshard_after_forward=never"), "every unit gathered"),
    (("plugins.fsdp.degree=4", "plugins.fsdp.reshard_after_forward=never", "training.grad_accum_steps=2"),
     "every unit gathered"),
    (("plugins.fsdp.degree=4", "plugins.fsdp.reshard_after_forward=always"), None),
    (("plugins.fsdp.degree=2", "plugins.fsdp.reshard_after_forward=always", "model.vocab_size=16384",
      "training.seq_len=64"), None),
], ids=["never", "never-accumulating", "always", "always-large-vocabulary"])
def test_each_resharding_policy_matches_the_tracker(overrides, what):
    """FSDP's resharding policies as they hold weights when backward starts: never, every unit gathered since its
    forward until its backward has run; always, not even the output layer (gathered again once the loss's backward
    has run). Within 1% of torch's tracker (measured: 0.0% to 0.8%); priced as the default policy, never was 4.5%
    and 7.9% under, always 6.0% over with a 16,384-entry vocabulary."""
    config, registry, plan, result = _estimate("launch.device=cpu", "training.seq_len=256", "+plugins=[fsdp]",
                                               *overrides)
    measured = _tracked_step(config, registry, plan)
    assert abs(sum(result.memory().values()) / measured["Total"] - 1) < 0.01
    if what:
        assert _term(result, what) > 0.03 * measured["Total"]
    else:
        assert _term(result, "the last block and the output gathered") == 0


VOCABULARY_REDUCED = ("the output layer's gradient reduced", "the embeddings' gradient reduced")


@pytest.mark.parametrize("overrides", [
    ("+plugins=[fsdp]", "plugins.fsdp.degree=4"),
    ("+plugins=[fsdp]", "plugins.fsdp.degree=4", "training.global_batch_size=8", "training.grad_accum_steps=2"),
    ("+plugins=[fsdp]", "plugins.fsdp.degree=4", "plugins.fsdp.param_dtype=bfloat16", "plugins.fsdp.reduce_dtype=bfloat16"),
    ("+plugins=[fsdp]", "plugins.fsdp.degree=4", "plugins.fsdp.reshard_after_forward=always"),
    ("+plugins=[fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2"),
], ids=["one-micro-batch", "two-micro-batches", "reduced-in-bfloat16", "resharded-always", "tp2"])
def test_fsdp_reduces_a_vocabulary_wide_unit_where_it_makes_the_peak(overrides):
    """A 16,384-entry vocabulary, one sequence of 16 tokens a rank: the output layer's and the embeddings' units are
    reduced as the loss's backward and the whole backward end, each holding its gradient whole, its copy in the
    reduction's dtype and the shard it makes (under tp the embedding's whole table, cut to the rank's rows first).
    Within 1% of torch's tracker (measured -0.6% to 0.0%); priced as a block's reduction, 10.5% to 40.9% under."""
    config, registry, plan, result = _estimate("launch.device=cpu", "model.vocab_size=16384", "training.seq_len=16",
                                               "training.global_batch_size=4", *overrides)
    measured = _tracked_step(config, registry, plan)["Total"]
    as_blocks = dataclasses.replace(result, memory_terms=[term for term in result.memory_terms
                                                          if term[1] not in VOCABULARY_REDUCED])
    assert sum(as_blocks.memory().values()) / measured - 1 < -0.09
    assert abs(sum(result.memory().values()) / measured - 1) < 0.01


@pytest.mark.parametrize("overrides", [
    (), ("+plugins=[tp]", "plugins.tp.degree=2"),
    ("+plugins=[tp]", "plugins.tp.degree=2", "plugins.tp.loss_parallel=false"),
    ("model=qwen3_tiny", "+plugins=[tp]", "plugins.tp.degree=2"),
    ("model=qwen3_tiny", "+plugins=[tp]", "plugins.tp.degree=2", "plugins.tp.loss_parallel=false",
     "training.seq_len=16"),
], ids=["alone", "tp-loss-parallel", "tp", "qwen3-tp-loss-parallel", "qwen3-tp-one-chunk"])
def test_chunked_loss_matches_the_tracker(overrides):
    """chunked_loss over a 16,384-entry vocabulary, chunks of 128 tokens: autograd sums the logits layer's gradient
    over the chunks in a buffer as wide as the logits' vocabulary, and under loss parallel each chunk's backward
    makes a third float32 tensor of its logits' shape. Within 1% of torch's tracker (measured: 0.0% to 0.6%);
    without the two, tp 2 was 16.6% (Llama) and 16.9% (Qwen3) under. A micro-batch of one chunk (8 x 16 tokens)
    sums nothing: counted, it was 10.3% over."""
    config, registry, plan, result = _estimate("launch.device=cpu", "model.vocab_size=16384", "+plugins=[chunked_loss]",
                                               "plugins.chunked_loss.chunk_tokens=128", *overrides)
    measured = _tracked_step(config, registry, plan)
    summed = _term(result, "the logits layer's gradient, summed over the chunks")
    if result.microbatch_tokens > 128:
        assert summed > 0.05 * measured["Total"]
    else:
        assert summed == 0
    assert abs(sum(result.memory().values()) / measured["Total"] - 1) < 0.01


@pytest.mark.parametrize("overrides, within", [
    ((), 0.01), (("optimizer.implementation=for_loop",), 0.02), (("optimizer.state_dtype=bfloat16",), 0.01),
    (("+plugins=[muon]",), 0.01), (("+plugins=[fsdp,muon]", "plugins.fsdp.degree=2"), 0.01),
    (("+plugins=[tp,muon]", "plugins.tp.degree=2"), 0.01),
    (("+plugins=[fsdp,tp,muon]", "plugins.fsdp.degree=2", "plugins.tp.degree=2"), 0.05),
], ids=["batched-adamw", "adamw-one-tensor-at-a-time", "narrow-states", "muon", "muon-fsdp2", "muon-tp2",
        "muon-fsdp2-tp2"])
def test_the_optimizers_step_is_weighed_where_it_makes_the_peak(overrides, within):
    """Two sequences of 16 tokens: the activations are nothing beside the model, and the step's peak is the
    optimizer's, with every parameter, gradient and state and what its step holds beyond the states (torch's
    batched AdamW: a float32 copy of its largest group; one tensor at a time: its largest tensor's; Muon: its
    updates and, under a mesh, the exchange's buffers). Within 1% of torch's tracker (measured -0.2% to +0.8%),
    AdamW one tensor at a time within 2% (+1.4%: the tensor before the largest taken as large), Muon on fsdp 2 x
    tp 2 within 5% (-3.8%: a second mesh dimension's re-layout on gloo holds more than counted); without what
    the step holds, each is further under than that (AdamW one tensor at a time -3.0%, the others -10% to -48%)."""
    config, registry, plan, result = _estimate("launch.device=cpu", "training.seq_len=16",
                                               "training.global_batch_size=2", *overrides)
    measured = _tracked_step(config, registry, plan)
    assert measured["ACT"] < 0.01 * measured["Total"]  # the peak came after backward
    assert result.memory()["activations"] == 0  # and the planner found it there
    assert abs(sum(result.memory().values()) / measured["Total"] - 1) < within
    without = dataclasses.replace(result, optimizer_step_bytes=0.0)
    assert sum(without.memory().values()) < (1 - within) * measured["Total"]


def test_a_tensor_parallel_step_is_tracked_alike_on_fake_and_real_tensors():
    """The harness tracks GPU-sized tensor-parallel steps on fake tensors: there a device mesh computes its
    coordinates on real tensors (on fake ones, ``nonzero`` fails) and DTensor's sharding propagation makes its
    global-shape tensors outside the tracked step's fake mode (inside it they were counted: 70B's widths at 2 blocks
    were tracked at 18.2 GiB on fake tensors, 5.0 on real ones). Both trackers count the same bytes."""
    config, registry, plan, _ = _estimate("launch.device=cpu", "training.seq_len=256", "model.vocab_size=16384",
                                          "+plugins=[fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2")
    real = _tracked_step(config, registry, plan)
    fake = _tracked_step(config, registry, plan, fake_tensors=True)
    assert real["Total"] > 0
    assert fake["Total"] == pytest.approx(real["Total"], rel=1e-3)


# The CI's stack matrix (tests/test_stack_matrix.py), each stack tracked on its own real world.
stack_spec = importlib.util.spec_from_file_location("ci_stacks", Path(__file__).with_name("test_stack_matrix.py"))
ci_stacks = importlib.util.module_from_spec(stack_spec)
stack_spec.loader.exec_module(ci_stacks)


def _stack_name(row) -> str:
    return " ".join(label for label, _, _ in row if label != "-")


@pytest.mark.slow
@pytest.mark.parametrize("row", ci_stacks.SMALL, ids=[_stack_name(row) for row in ci_stacks.SMALL])
def test_each_ci_stack_matches_torchs_tracker_on_every_rank(row, tmp_path):
    """Every rank of each CI stack (all the plugins at once, the worker's own step) against its own prediction,
    a mixture of experts planned at the load the rank measured (ranks of one role differ: gpt-oss's pipeline rank
    1 at 1.90 and 1.98 MiB); the error's sign printed (+: the planner over, the safe side). gpt-oss's first stage
    was 9.3% under until the planner counted what a recomputing block's forward holds beyond what it keeps."""
    overrides = ("tokenizer.path=bytes", "training.seq_len=32", "training.global_batch_size=8", "launch.device=cpu",
                 *ci_stacks.matrix.overrides(row))
    for rank, estimated, measured in _each_rank_tracked(overrides, tmp_path):
        error = sum(estimated.memory().values()) / measured["Total"] - 1
        print(f"rank {rank}: {error:+.1%} (expert load {measured['expert_load']:.2f})")
        assert abs(error) < 0.05, (rank, error)
