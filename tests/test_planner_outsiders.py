"""Outsiders' plugins written from docs/planner-internals.md alone, installed for the test (titan_core.testing.
install_plugins): each prices itself in a pricing module of its own (``costs=``, group titan_core.costs) beside its
plugin module (empty when it has no technique hook), and the planner counts what each says; a plugin with no
pricing is reported, not counted."""

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
from titan_core.planner.hardware import hardware_profile
from titan_core.testing import install_plugins

# What the planner's tests share, loaded by path as tracked_rank.py is (tests/ is not on the path).
spec = importlib.util.spec_from_file_location("planner_cases", Path(__file__).with_name("planner_cases.py"))
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
SMALL, tracked_rank, _estimate = cases.SMALL, cases.tracked_rank, cases._estimate
_on_rank0, _printed_bytes, _plan_command = cases._on_rank0, cases._printed_bytes, cases._plan_command


OUTSIDER = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """staging: a host-side copy of every micro-batch's tokens, sent once to a parameter server each step."""
    estimate.add_memory("buffers", lambda e: e.microbatch_tokens * plugin_config.bytes_per_token, "staged tokens",
                        "staging")
    estimate.add_collective("tokens to the parameter server", ("dp_shard",), 1e9, overlapped=False, plugin="staging")
'''


def test_an_outsiders_plugin_contributes_its_own_terms(tmp_path):
    env = install_plugins(tmp_path / "site", {"staging": ("", "bytes_per_token: 1024\n")}, "staging-plugin",
                          costs={"staging": OUTSIDER})
    args = ["--hardware", "a100", *SMALL, "launch.world_size=2", "+plugins=[fsdp,staging]"]
    done = _plan_command(*args, env=env)
    assert done.returncode == 0, done.stderr
    assert "staging: staged tokens 256.00 KiB" in done.stdout  # 4 rows x 64 tokens x 1024 bytes
    assert "collective staging: tokens to the parameter server over dp_shard" in done.stdout
    assert "at 25 GB/s" not in done.stdout.split("staging: tokens")[1].splitlines()[0]  # 2 ranks: one node
    assert "not counted" not in done.stdout


# Written from docs/planner-internals.md's paragraph on the estimate's properties: a moment just after the loss's
# backward, counted beyond what the moment as backward starts holds for the outputs and the loss.
AFTER_THE_LOSS = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """gradstats: a hook on the logits' gradient keeps `mib` MiB of statistics as the loss's backward ends."""
    estimate.add_memory("buffers", lambda e: max(0.0, plugin_config.mib * 2**20 - e.loss_backward_bytes()),
                        "logits' gradient statistics", "gradstats", when="start")
'''


@pytest.mark.parametrize("mib", [64, 0.01])
def test_an_outsiders_term_after_the_loss_counts_beyond_the_losss_backward(tmp_path, mib):
    env = install_plugins(tmp_path / "site", {"gradstats": ("", f"mib: {mib}\n")}, "gradstats-plugin",
                          costs={"gradstats": AFTER_THE_LOSS})
    args = ["--hardware", "a100", *SMALL, "launch.world_size=2", "+plugins=[fsdp]"]
    _, plain = job_estimate(args)
    loss = plain.loss_backward_bytes()
    assert loss > 0.2 * plain.memory()["activations"]  # a share of the peak: the logits' gradients, what the loss kept
    alone, stacked = (_plan_command(*args[:-1], f"+plugins=[{plugins}]", env=env) for plugins in ("fsdp",
                                                                                                  "fsdp,gradstats"))
    assert alone.returncode == 0 and stacked.returncode == 0, stacked.stderr
    label = "memory per rank (the most loaded), at its peak: "
    grown = _printed_bytes(stacked.stdout, label) - _printed_bytes(alone.stdout, label)
    if mib * 2**20 > loss:
        assert _printed_bytes(stacked.stdout, "gradstats: logits' gradient statistics ") == pytest.approx(
            mib * 2**20 - loss, rel=1e-3)
        assert grown == pytest.approx(mib * 2**20 - loss, rel=1e-3)
    else:
        assert "gradstats:" not in stacked.stdout and grown == 0


# Written from docs/planner-internals.md's expert-load paragraph: a memory term grows with the busiest micro-batch's
# load, a time term with the step's.
RECEIVE_BUFFER = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """routebuf: a buffer for `copies` token copies of 1 KiB a rank receives, and the same sent once a step."""
    estimate.add_memory("buffers", lambda e: plugin_config.copies * 1024 * e.peak_expert_load, "received copies",
                        "routebuf")
    estimate.add_collective("copies to the expert ranks", ("dp_shard",),
                            lambda e: plugin_config.copies * 1024 * e.expert_load, overlapped=False, plugin="routebuf")
'''


def test_an_outsiders_terms_follow_the_busiest_micro_batchs_load_and_the_steps(tmp_path):
    """--expert-load-peak reaches a plugin's memory terms through Estimate.peak_expert_load, --expert-load its
    traffic through Estimate.expert_load."""
    env = install_plugins(tmp_path / "site", {"routebuf": ("", "copies: 1024\n")}, "routebuf-plugin",
                          costs={"routebuf": RECEIVE_BUFFER})
    done = _plan_command("--hardware", "a100", "--expert-load", "1.25", "--expert-load-peak", "1.5", *SMALL,
                         "model=qwen3_moe_tiny", "+plugins=[routebuf]", env=env)
    assert done.returncode == 0, done.stderr
    assert "routebuf: received copies 1.50 MiB" in done.stdout
    assert "copies to the expert ranks over dp_shard: 1.25 MiB per step" in done.stdout


# An optimizer plugin as docs/writing-plugins.md describes one: plain SGD, and the FLOPs it says its step runs.
MATRIX_OPTIMIZER = '''
import torch
from titan_core import hookimpl


@hookimpl
def build_optimizer(model_parts, config, plugin_config):
    """matrixsgd: SGD over every trainable parameter."""
    trained = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    return torch.optim.SGD(trained, lr=config.optimizer.lr)
'''
MATRIX_OPTIMIZER_COSTS = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(ledger, plugin_config):
    """matrixsgd: the matrix products its step runs, per rank."""
    ledger.add_flops(plugin_config.flops, "its step's products")
'''


def test_an_outsiders_optimizer_flops_lengthen_the_step_at_the_matmul_rate(tmp_path):
    env = install_plugins(tmp_path / "site", {"matrixsgd": (MATRIX_OPTIMIZER, "flops: 0.0\n")}, "matrixsgd-plugin",
                          costs={"matrixsgd": MATRIX_OPTIMIZER_COSTS})
    a100 = hardware_profile("a100")

    def matmul_seconds(flops):
        done = _plan_command("--hardware", "a100", *SMALL, "+plugins=[matrixsgd]", f"plugins.matrixsgd.flops={flops}",
                             env=env)
        assert done.returncode == 0, done.stderr
        return float(done.stdout.split("= matmul ")[1].split(",")[0])

    longer = matmul_seconds(3e13) - matmul_seconds(0.0)
    assert longer == pytest.approx(3e13 / (a100.peak_tflops() * 1e12 * a100.achievable), rel=1e-3)


# A plugin written from docs/planner-internals.md that copies every weight once per step in device memory.
WEIGHT_COPY = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """weightcopy: `copies` copies of the rank's weights a step, read and written in device memory."""
    estimate.add_traffic(lambda e: plugin_config.copies * 2 * 4 * e.held_gathered(), "weights copied", "weightcopy")
'''


def test_an_outsiders_memory_traffic_lengthens_the_step_at_the_memory_bandwidth(tmp_path):
    env = install_plugins(tmp_path / "site", {"weightcopy": ("", "copies: 100\n")}, "weightcopy-plugin",
                          costs={"weightcopy": WEIGHT_COPY})
    a100 = hardware_profile("a100")

    def elementwise(*plugins):
        done = _plan_command("--hardware", "a100", *SMALL, f"+plugins=[{','.join(plugins)}]", env=env)
        assert done.returncode == 0, done.stderr
        return float(done.stdout.split("elementwise ")[1].split(",")[0]), done.stdout

    alone, _ = elementwise()
    copied, text = elementwise("weightcopy")
    _, plain = job_estimate(["--hardware", "a100", *SMALL])  # as the command has it
    moved = 100 * 2 * 4 * plain.held_gathered()
    assert f"memory traffic weightcopy: weights copied: {moved / 2**20:.2f} MiB per step at 2039 GB/s" in text
    assert copied - alone == pytest.approx(moved / (a100.memory_gbps * 1e9), rel=1e-3)


SPLIT_STREAM = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """splitstream: the residual stream between blocks split over `ways` ranks, gathered once per block; its
    gathered copy of the embeddings' output held after the blocks' backward."""
    estimate.stream_split *= plugin_config.ways
    estimate.add_memory("buffers", lambda e: e.facts.block_input * e.microbatch_tokens, "gathered stream",
                        "splitstream", when="end")
    estimate.add_collective("stream gathered", ("pp",), lambda e: len(e.blocks) * e.facts.block_input
                            * e.microbatch_tokens * e.microbatches_per_step(), overlapped=False, plugin="splitstream",
                            calls=lambda e: len(e.blocks) * e.microbatches_per_step())
'''


def test_a_field_an_outsider_sets_is_read_by_the_plugins_it_concerns(tmp_path):
    """An outsider's plugin splits the residual stream: pipelining's receive buffers, sized by the stream, halve."""
    env = install_plugins(tmp_path / "site", {"splitstream": ("", "ways: 2\n")}, "splitstream-plugin",
                          costs={"splitstream": SPLIT_STREAM})

    def receive_buffers(*plugins):
        done = _plan_command("--hardware", "a100", *SMALL, "launch.world_size=2", f"+plugins=[{','.join(plugins)}]",
                             "plugins.pp.degree=2", env=env)
        assert done.returncode == 0, done.stderr
        line = next(line for line in done.stdout.splitlines() if "pp: pipeline receive buffers" in line)
        assert line.endswith("(across steps)")
        number, unit = line.split("pp: pipeline receive buffers ")[1].split()[:2]
        return float(number), unit, done.stdout

    alone, unit, _ = receive_buffers("pp")
    split, split_unit, printed = receive_buffers("pp", "splitstream")
    assert split_unit == unit and split == pytest.approx(alone / 2, rel=0.01)
    assert "collective splitstream: stream gathered over pp" in printed
    assert "splitstream: gathered stream" in printed and "(after the blocks' backward)" in printed


LOGIT_CHUNKS = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """logitchunks: the loss makes the logits `tokens` at a time, keeping none from forward."""
    estimate.logits_tokens = plugin_config.tokens
'''


def test_an_outsiders_chunked_loss_keeps_one_chunk_of_logits(tmp_path):
    """Estimate.logits_tokens, set as docs/planner-internals.md says by a plugin written from it: the activations
    printed are the plan's with the logits of 16 tokens instead of the micro-batch's 512."""
    env = install_plugins(tmp_path / "site", {"logitchunks": ("", "tokens: 16\n")}, "logitchunks-plugin",
                          costs={"logitchunks": LOGIT_CHUNKS})
    plain, chunked = _activations_with_outsider(env, "logitchunks", (), logits_tokens=16)
    assert chunked < 0.9 * plain


def _activations_with_outsider(env, plugin: str, job: tuple, **fields) -> tuple[float, float]:
    """The activations the planner has for ``job`` on an A100, as planned and with ``fields`` as the outsider's
    ``plugin`` should set them, once the plan command printed the same without and with that plugin."""
    def printed(*plugins):
        done = _plan_command("--hardware", "a100", *SMALL, *job, *plugins, env=env)
        assert done.returncode == 0, done.stderr
        return _printed_bytes(done.stdout, "    activations")

    *_, plain = _estimate(*job)
    plain = dataclasses.replace(plain, hardware=hardware_profile("a100"), compute_dtype=torch.bfloat16)
    changed = dataclasses.replace(plain, **fields)
    assert printed() == pytest.approx(plain.memory()["activations"], rel=0.01)
    assert printed(f"+plugins=[{plugin}]") == pytest.approx(changed.memory()["activations"], rel=0.01)
    return plain.memory()["activations"], changed.memory()["activations"]


HELD_COPIES = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """heldcopies: the experts' call holds `copies` more copies of the token copies while the experts compute."""
    estimate.expert_copies_held += plugin_config.copies
'''


def test_an_outsiders_experts_call_holds_its_copies_where_a_block_recomputes(tmp_path):
    """Estimate.expert_copies_held, set as docs/planner-internals.md says by a plugin written from it: a checkpointed
    block's forward, run again in backward, then holds the plan's peak (its backward's did without them)."""
    env = install_plugins(tmp_path / "site", {"heldcopies": ("", "copies: 3\n")}, "heldcopies-plugin",
                          costs={"heldcopies": HELD_COPIES})
    job = ("model=gpt_oss_tiny", "+plugins=[ac]", "plugins.ac.mode=full")
    plain, held = _activations_with_outsider(env, "heldcopies", job, expert_copies_held=3)
    assert held > 1.05 * plain


DEFERRED_WEIGHTS = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """deferredw: each block's weight gradients wait `waiting` micro-batches after their input half; a warm-up
    keeps `warmup` micro-batches at the first backward; a copy of the gradients accumulates whole."""
    estimate.weight_halves_waiting = plugin_config.waiting
    estimate.first_backward = (plugin_config.warmup, 0)
    estimate.add_memory("buffers", lambda e: 4 * e.held_params(), "gradients kept whole", "deferredw",
                        when="accumulated")
'''


def test_an_outsiders_deferred_weight_gradients_keep_what_their_weight_half_needs(tmp_path):
    """Estimate.weight_halves_waiting, first_backward and a term "accumulated", set by a plugin written from
    docs/planner-internals.md: each waiting micro-batch keeps the gradients of its blocks' parameter-reading results
    (facts.block_param_results); a warm-up of many micro-batches peaks before any gradient exists."""
    env = install_plugins(tmp_path / "site", {"deferredw": ("", "waiting: 2\nwarmup: 1\n")}, "deferredw-plugin",
                          costs={"deferredw": DEFERRED_WEIGHTS})

    def printed(*extra):
        done = _plan_command("--hardware", "a100", *SMALL, "+plugins=[deferredw]", *extra, env=env)
        assert done.returncode == 0, done.stderr
        return _printed_bytes(done.stdout, "    activations"), done.stdout

    *_, plain = _estimate()
    plain = dataclasses.replace(plain, hardware=hardware_profile("a100"), compute_dtype=torch.bfloat16)
    waiting = 2 * plain.microbatch_tokens * sum(plain.facts.block_param_results)
    activations, text = printed()
    assert activations == pytest.approx(plain.memory()["activations"] + waiting, rel=0.01)
    assert waiting > 0.2 * plain.memory()["activations"]  # a change the tolerance cannot hide
    assert "deferredw: gradients kept whole" in text and "(as the gradients accumulate)" in text
    # Eight micro-batches at the first backward, no gradient yet: the peak is there, without the whole copy.
    warm, text = printed("plugins.deferredw.warmup=8", "plugins.deferredw.waiting=0")
    assert warm == pytest.approx(plain.memory()["activations"] + 7 * plain.microbatch_tokens * plain.kept_per_token(),
                                 rel=0.01)
    assert "gradients 0 B (made in backward" in " ".join(text.split())
    assert "buffers 4.00 KiB" in " ".join(text.split())  # the model's buffers; the whole copy not yet made


# A plugin written from docs/planner-internals.md that changes what a pipeline sets per rank, knowing no pipeline.
OFFLOAD = '''
from titan_core import hookimpl
from titan_core.planner import evaluated


@hookimpl
def estimate_costs(estimate, plugin_config):
    """offload: at most `keep` micro-batches' activations stay on the device, the rest go to host memory."""
    keep, in_flight, first = plugin_config.keep, estimate.microbatches_in_flight, estimate.first_backward

    def first_backward(e):
        kept = first(e) if callable(first) else first
        return None if kept is None else (min(keep, kept[0]), kept[1])
    estimate.microbatches_in_flight = lambda e: min(keep, evaluated(in_flight, e))
    estimate.first_backward = first_backward
'''


def test_an_outsiders_change_to_a_per_rank_field_reaches_every_rank(tmp_path):
    """A plugin after pp caps the micro-batches in flight, which 1F1B makes 4, 3, 2, 1 on its four ranks: the plan
    prints the most loaded rank with at most 2 kept. When pp gave those in Estimate.ranks, each rank's own value
    replaced the wrapped one and the plan printed the same memory with the plugin as without it. A plugin giving
    anything but what a rank holds in Estimate.ranks is refused."""
    env = install_plugins(tmp_path / "site", {"offload": ("", "keep: 2\n")}, "offload-plugin", costs={"offload": OFFLOAD})
    pipeline = ("launch.world_size=4", "plugins.pp.degree=4", "plugins.pp.microbatches=8")
    _, alone = job_estimate(["--hardware", "a100", *SMALL, "+plugins=[pp]", *pipeline])  # as the command has it
    ranks = alone.each_rank()
    assert [evaluated(rank.microbatches_in_flight, rank) for rank in ranks] == [4, 3, 2, 1]
    # 1F1B's warm-up keeps 4 - rank micro-batches at the rank's first backward.
    capped = [dataclasses.replace(rank, microbatches_in_flight=min(2, evaluated(rank.microbatches_in_flight, rank)),
                                  first_backward=(min(2, 4 - index), 0)) for index, rank in enumerate(ranks)]
    heaviest = max(capped, key=lambda rank: sum(rank.memory().values())).memory()
    assert sum(heaviest.values()) < 0.9 * sum(alone.most_loaded().memory().values())  # more than the rounding
    done = _plan_command("--hardware", "a100", *SMALL, "+plugins=[pp,offload]", *pipeline, env=env)
    assert done.returncode == 0, done.stderr
    assert _printed_bytes(done.stdout, "at its peak:") == pytest.approx(sum(heaviest.values()), abs=0.006 * 2**20)
    assert _printed_bytes(done.stdout, "    activations") == pytest.approx(heaviest["activations"], abs=0.006 * 2**20)
    wrong = dataclasses.replace(alone, ranks=[{**fields, "microbatches_in_flight": 1} for fields in alone.ranks])
    with pytest.raises(ValueError, match="not 'microbatches_in_flight': give microbatches_in_flight as a function"):
        wrong.each_rank()


# A plugin written from docs/planner-internals.md's "regathered" paragraph: weights that leave the device after
# forward and come back block by block as backward reaches them.
WEIGHT_STREAM = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """weightstream: its fp32 weights sent to host memory after forward and brought back as backward reaches each
    block, `ahead` blocks early (none of a block's if not `prefetch_whole`); `all_back`: backward finds them back."""
    estimate.backward_prefetch = plugin_config.ahead
    if not plugin_config.prefetch_whole:
        estimate.prefetched_gathered = lambda e, index: 0.0
    if plugin_config.all_back:
        estimate.backward_regathers = False
    estimate.add_memory("parameters", lambda e: 4 * e.held_gathered(), "weights brought back", "weightstream",
                        when="regathered")
'''


def test_an_outsiders_weights_brought_back_in_backward_count_what_backward_has_reached(tmp_path):
    """A term added when="regathered", with Estimate.backward_prefetch, prefetched_gathered and backward_regathers
    set by a plugin written from docs/planner-internals.md. The tiny Llama's peak is as backward starts: then it holds
    the weights outside the blocks and the `ahead` last blocks' (all of them when the plugin says backward finds
    them back), summed here by hand from the plan's own block sizes."""
    env = install_plugins(tmp_path / "site", {"weightstream": (
        "", "ahead: 0\nprefetch_whole: true\nall_back: false\n")}, "weightstream-plugin",
                          costs={"weightstream": WEIGHT_STREAM})

    def printed(*extra):
        done = _plan_command("--hardware", "a100", *SMALL, *extra, env=env)
        assert done.returncode == 0, done.stderr
        return (_printed_bytes(done.stdout, "at its peak:"), _printed_bytes(done.stdout, "    activations"),
                done.stdout)

    *_, plain = _estimate()  # parameters per block, whatever the dtype
    blocks = [plain.block_gathered(i) for i in plain.blocks]
    outside = plain.held_gathered() - sum(blocks)
    alone, activations, _ = printed()
    for extra, held in [((), outside), (("plugins.weightstream.ahead=1",), outside + blocks[-1]),
                        (("plugins.weightstream.ahead=1", "plugins.weightstream.prefetch_whole=false"), outside),
                        (("plugins.weightstream.all_back=true",), outside + sum(blocks))]:
        total, streamed_activations, text = printed("+plugins=[weightstream]", *extra)
        assert streamed_activations == activations, extra  # the peak is still as backward starts
        assert total == pytest.approx(alone + 4 * held, abs=0.011 * 2**20), extra  # two printed roundings
        assert "weightstream: weights brought back" in text and "(as backward reaches each block)" in text
    assert 4 * blocks[-1] > 0.1 * 2**20  # a block more or less moves the total beyond the printed rounding


# A plugin written from docs/planner-internals.md's "unreleased" paragraph: weights kept from forward until backward
# has passed them.
WEIGHTS_KEPT = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate):
    """weightskept: an fp32 copy of every weight made in forward, each let go once backward has run its unit."""
    estimate.add_memory("parameters", lambda e: 4 * e.held_gathered(), "weights kept since forward", "weightskept",
                        when="unreleased")
'''


def test_an_outsiders_weights_kept_since_forward_are_let_go_as_backward_passes_them(tmp_path):
    """A term added when="unreleased" by a plugin written from docs/planner-internals.md. The tiny Llama's peak is as
    backward starts, when every copy is held (summed here by hand from the plan's own sizes). (How the moment lets
    units go as backward passes them is checked against torch's tracker by fsdp's reshard_after_forward=never.)"""
    env = install_plugins(tmp_path / "site", {"weightskept": ("", "")}, "weightskept-plugin",
                          costs={"weightskept": WEIGHTS_KEPT})

    def printed(*extra):
        done = _plan_command("--hardware", "a100", *SMALL, *extra, env=env)
        assert done.returncode == 0, done.stderr
        return _printed_bytes(done.stdout, "at its peak:"), done.stdout

    *_, plain = _estimate()
    alone, _ = printed()
    total, text = printed("+plugins=[weightskept]")
    assert total == pytest.approx(alone + 4 * plain.held_gathered(), abs=0.011 * 2**20)
    assert "weightskept: weights kept since forward" in text and "(until backward has run each unit)" in text


# A plugin written from docs/planner-internals.md: an optimizer's step of its own, and a buffer kept across steps.
STEP_HELD = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """stepheld: its optimizer's step holds `step_bytes` beyond the states; `kept_bytes` of buffers across steps."""
    estimate.optimizer_step_bytes = plugin_config.step_bytes
    estimate.add_memory("buffers", plugin_config.kept_bytes, "a buffer kept across steps", "stepheld", when="held")
'''


def test_an_outsiders_optimizer_step_and_kept_buffer_reach_the_step_peak(tmp_path):
    """Estimate.optimizer_step_bytes and a term added when="held", by a plugin written from docs/planner-internals.md,
    on two sequences of 16 tokens, where the step's peak is the optimizer's: what its step holds replaces what the
    core measured of its own optimizer, and the kept buffer is there too (summed by hand)."""
    env = install_plugins(tmp_path / "site", {"stepheld": ("", "step_bytes: 0\nkept_bytes: 0\n")}, "stepheld-plugin",
                          costs={"stepheld": STEP_HELD})
    tiny = ("training.seq_len=16", "training.global_batch_size=2")

    def printed(*extra):
        done = _plan_command("--hardware", "a100", *SMALL, *tiny, "+plugins=[stepheld]", *extra, env=env)
        assert done.returncode == 0, done.stderr
        return _printed_bytes(done.stdout, "at its peak (as the optimizer steps):"), done.stdout

    _, plain = job_estimate(["--hardware", "a100", *SMALL, *tiny])
    core_step = plain.optimizer_step_bytes(plain)
    assert core_step == 4 * plain.facts.largest_role  # torch's batched AdamW: a float32 copy of its largest group
    step = sum(plain.step_peak().values()) - core_step
    total, _ = printed("plugins.stepheld.step_bytes=4194304")
    assert total == pytest.approx(step + 4 * 2**20, abs=0.011 * 2**20)
    total, text = printed("plugins.stepheld.step_bytes=4194304", "plugins.stepheld.kept_bytes=2097152")
    assert total == pytest.approx(step + 6 * 2**20, abs=0.011 * 2**20)
    assert "the step's own, beyond the states: 4.00 MiB" in text
    assert "stepheld: a buffer kept across steps 2.00 MiB (across steps)" in text


# A plugin written from docs/planner-internals.md: a schedule of its own that keeps micro-batches' outputs.
HELD_OUTPUTS = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """heldoutputs: `in_flight` micro-batches alive at the worst backward, each keeping `output_bytes` of its output
    per token until its backward ends; `made` of the gradients exist there."""
    estimate.microbatches_in_flight = plugin_config.in_flight
    estimate.output_kept = plugin_config.output_bytes
    estimate.gradients_made = plugin_config.made
'''


def test_an_outsiders_kept_outputs_and_gradients_made_reach_the_peak(tmp_path):
    """Estimate.output_kept and gradients_made, set by a plugin written from docs/planner-internals.md, on a step of
    two micro-batches: three micro-batches in flight keep three outputs (summed by hand); half the gradients
    exist at the peak, as backward starts, where all did."""
    env = install_plugins(tmp_path / "site", {"heldoutputs": ("", "in_flight: 3\noutput_bytes: 0\nmade: 1.0\n")},
                          "heldoutputs-plugin", costs={"heldoutputs": HELD_OUTPUTS})

    def printed(*extra):
        done = _plan_command("--hardware", "a100", *SMALL, "training.grad_accum_steps=2", "+plugins=[heldoutputs]",
                             *extra, env=env)
        assert done.returncode == 0, done.stderr
        return _printed_bytes(done.stdout, "    activations"), _printed_bytes(done.stdout, "    gradients")

    _, plain = job_estimate(["--hardware", "a100", *SMALL, "training.grad_accum_steps=2"])  # as the command has it
    activations, gradients = printed()
    held, _ = printed("plugins.heldoutputs.output_bytes=4096")
    assert held - activations == pytest.approx(3 * 4096 * plain.microbatch_tokens, abs=0.011 * 2**20)
    assert 3 * 4096 * plain.microbatch_tokens > 0.5 * 2**20  # beyond the printed rounding
    _, half = printed("plugins.heldoutputs.made=0.5")
    assert gradients == pytest.approx(4 * plain.sharded_params(), rel=0.01)
    assert half == pytest.approx(gradients / 2, rel=0.01)


# A plugin written from docs/planner-internals.md: a fused cross-entropy kernel of its own (no torch.compile).
FUSED_CROSS_ENTROPY = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """fusedce: the loss runs as one fused kernel, keeping the logits as returned and making only their gradient."""
    estimate.fused_loss = True
'''


def test_an_outsiders_fused_loss_reaches_the_peak(tmp_path):
    """Estimate.fused_loss, set by a plugin written from docs/planner-internals.md: the plan command prints the
    activations the core's fused facts give, less than the eager loss's by more than the printed rounding."""
    env = install_plugins(tmp_path / "site", {"fusedce": ("", "")}, "fusedce-plugin",
                          costs={"fusedce": FUSED_CROSS_ENTROPY})
    done = _plan_command("--hardware", "a100", *SMALL, "+plugins=[fusedce]", env=env)
    assert done.returncode == 0, done.stderr
    _, plain = job_estimate(["--hardware", "a100", *SMALL])
    fused = dataclasses.replace(plain, fused_loss=True)
    expected = fused.memory()["activations"]
    assert _printed_bytes(done.stdout, "    activations") == pytest.approx(expected, abs=0.011 * 2**20)
    assert plain.memory()["activations"] - expected > 0.1 * 2**20


STAGING_STREAM = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """stagingstream: copies each batch on a stream of its own, whose 64 MiB block the allocator keeps for it."""
    estimate.add_memory("buffers", 64 << 20, "the staging stream's block", "stagingstream", when="cached")
'''


def test_an_outsiders_cached_term_is_reserved_not_allocated(tmp_path):
    """A term added ``when="cached"`` by a plugin written from docs/planner-internals.md: the plan command prints it
    under what the allocator reserves, which grows by it, and the allocated peak (what "fits" is judged on) does
    not move."""
    env = install_plugins(tmp_path / "site", {"stagingstream": ("", "")}, "stagingstream-plugin",
                          costs={"stagingstream": STAGING_STREAM})
    done = _plan_command("--hardware", "a100", *SMALL, "+plugins=[stagingstream]", env=env)
    assert done.returncode == 0, done.stderr
    _, plain = job_estimate(["--hardware", "a100", *SMALL])
    assert _printed_bytes(done.stdout, "at its peak:") == pytest.approx(sum(plain.memory().values()), abs=0.006 * 2**20)
    assert _printed_bytes(done.stdout, "reserved by the caching allocator at that peak:") == pytest.approx(
        plain.reserved() + (64 << 20), abs=0.006 * 2**20)
    assert "stagingstream: the staging stream's block 64.00 MiB" in done.stdout


WHOLE_GRADIENT = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """wholegrad: its backward makes the embedding's whole gradient, however its weight is split."""
    estimate.grad_whole_params = lambda e: e.facts.inputs_params * e.holds_inputs
'''


def test_an_outsiders_whole_gradient_accumulates_whole_under_fsdp(tmp_path):
    """Estimate.grad_whole_params, set by a plugin written from docs/planner-internals.md and read by fsdp, which
    knows no such plugin: accumulating two micro-batches unreduced, fsdp keeps that gradient whole in float32
    beside the others."""
    env = install_plugins(tmp_path / "site", {"wholegrad": ("", "")}, "wholegrad-plugin",
                          costs={"wholegrad": WHOLE_GRADIENT})
    accumulated = ("model.vocab_size=16384", "launch.world_size=2", "plugins.fsdp.degree=2",
                   "training.grad_accum_steps=2", "plugins.fsdp.reduce_gradients=last_micro_batch")

    def printed(*plugins):
        done = _plan_command("--hardware", "a100", *SMALL, f"+plugins=[{','.join(plugins)}]", *accumulated, env=env)
        assert done.returncode == 0, done.stderr
        return _printed_bytes(done.stdout, "beyond their shards (reduce_gradients)")

    _, alone = job_estimate(["--hardware", "a100", *SMALL, "+plugins=[fsdp]", *accumulated])
    whole = alone.facts.inputs_params * 4  # float32, fsdp's reduce dtype
    assert printed("fsdp", "wholegrad") - printed("fsdp") == pytest.approx(whole, abs=0.011 * 2**20)
    assert whole > 0.1 * 2**20  # beyond the printed rounding


HOLDS_GRADIENTS = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate):
    """holdgrads: a sharder of its own that holds the gradients and counts them itself."""
    estimate.sharder_holds_gradients = True
'''


def test_an_outsiders_whole_gradient_is_kept_by_autograd_unless_a_sharder_holds_the_gradients(tmp_path):
    """Without a sharder, autograd keeps the whole gradient of Estimate.grad_whole_params (set by a plugin written
    from docs/planner-internals.md) across two micro-batches, which the core counts; a second outsider's plugin,
    written from the same page, that says it holds the gradients (Estimate.sharder_holds_gradients) takes it over."""
    env = install_plugins(tmp_path / "site", {"wholegrad": ("", ""), "holdgrads": ("", "")}, "outsider-gradients",
                          costs={"wholegrad": WHOLE_GRADIENT, "holdgrads": HOLDS_GRADIENTS})
    line = "core: split weights' gradients kept whole across micro-batches"

    def printed(*plugins):
        done = _plan_command("--hardware", "a100", *SMALL, f"+plugins=[{','.join(plugins)}]", "model.vocab_size=16384",
                             "training.grad_accum_steps=2", env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout

    _, alone = job_estimate(["--hardware", "a100", *SMALL, "model.vocab_size=16384", "training.grad_accum_steps=2"])
    assert _printed_bytes(printed("wholegrad"), line) == pytest.approx(4 * alone.facts.inputs_params, abs=0.011 * 2**20)
    assert line not in printed("wholegrad", "holdgrads")


VOCAB_SPLIT = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """vocabsplit: the logits split by vocabulary over `ways` ranks."""
    estimate.logits_split *= plugin_config.ways
'''


def test_an_outsiders_logits_split_reaches_what_a_pipelines_last_stage_keeps(tmp_path):
    """Estimate.logits_split, set by a plugin written from docs/planner-internals.md and read by pp, which knows no
    such plugin: GPipe's last stage keeps each of its four micro-batches' logits, and its loss makes their
    gradients, half as large split two ways."""
    env = install_plugins(tmp_path / "site", {"vocabsplit": ("", "ways: 2\n")}, "vocabsplit-plugin",
                          costs={"vocabsplit": VOCAB_SPLIT})
    pipeline = ("launch.world_size=2", "plugins.pp.degree=2", "plugins.pp.schedule=GPipe", "plugins.pp.microbatches=4")

    def printed(*plugins):
        done = _plan_command("--hardware", "a100", *SMALL, f"+plugins=[{','.join(plugins)}]", *pipeline, env=env)
        assert done.returncode == 0, done.stderr
        return _printed_bytes(done.stdout, "    activations")

    _, alone = job_estimate(["--hardware", "a100", *SMALL, "+plugins=[pp]", *pipeline])  # as the command has it
    last = alone.most_loaded()
    assert last.holds_outputs and last.first_backward(last) == (4, 0)  # its peak: every forward before a backward
    halved = last.microbatch_tokens * (4 * last.facts.output + last.facts.loss_backward) / 2
    assert printed("pp") - printed("pp", "vocabsplit") == pytest.approx(halved, abs=0.011 * 2**20)
    assert halved > 0.1 * 2**20  # beyond the printed rounding


# Written from docs/planner-internals.md's paragraph on memory traffic: each linear as the rank computes it.
INT8_INPUTS = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """int8acts: each linear's input, as this rank computes on it, is written once more in int8 for its backward."""
    def written(e):
        per_token = sum(linear.inputs for i in e.blocks for linear in e.rank_linears(i).values())
        return plugin_config.bytes * per_token * e.microbatch_tokens * e.microbatches_per_step()
    estimate.add_traffic(written, "linears' inputs in int8", "int8acts")
'''


def test_an_outsiders_traffic_per_linear_follows_tensor_parallels_splits(tmp_path):
    """A plugin written from docs/planner-internals.md reads each linear of the rank's blocks (Estimate.rank_linears)
    and knows no tp: stacked with tp 2, its bytes are the inputs each linear of a real tp step computes on (a
    column-wise linear's whole, a row-wise one's half), not the whole model's nor its half."""
    env = install_plugins(tmp_path / "site", {"int8acts": ("", "bytes: 1\n")}, "int8acts-plugin",
                          costs={"int8acts": INT8_INPUTS})
    tp = ("launch.world_size=2", "plugins.tp.degree=2")
    done = _plan_command("--hardware", "a100", *SMALL, "+plugins=[tp,int8acts]", *tp, env=env)
    assert done.returncode == 0, done.stderr
    printed = _printed_bytes(done.stdout, "memory traffic int8acts: linears' inputs in int8:")
    config, registry, plan, result = _estimate("launch.device=cpu", "+plugins=[tp]", *tp)
    measured = _on_rank0(tracked_rank.linear_elements, config, registry, plan)
    assert printed == pytest.approx(sum(inputs for inputs, _ in measured.values()), abs=0.006 * 2**10)
    whole = sum(linear.inputs for linears in result.facts.block_linears for linear in linears.values()) \
        * result.microbatch_tokens
    assert whole / 2 + 2**10 < printed < whole - 2**10


# Written from docs/planner-internals.md's paragraph on recomputation: an exchange each time attention runs.
KV_MIRROR = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """kvmirror: each attention's keys and values sent to a mirror, in forward and again when it is recomputed."""
    def sent(e):
        runs = sum(1 + e.recomputes_attention(i) for i in e.blocks)
        return runs * e.facts.attention_kv * e.microbatch_tokens * e.microbatches_per_step()
    estimate.add_collective("keys and values to the mirror", ("dp_shard",), sent, overlapped=False, plugin="kvmirror")
'''


@pytest.mark.parametrize("mode, runs", [("full", 2), ("selective_op", 1)])
def test_an_outsiders_attention_exchange_is_paid_again_only_where_attention_is_recomputed(mode, runs, tmp_path):
    """A plugin written from docs/planner-internals.md whose attention exchanges data reads
    Estimate.recomputes_attention: under full checkpointing a block's attention runs twice, under selective
    checkpointing, which keeps attention's results (ac sets Estimate.attention_kept), once."""
    env = install_plugins(tmp_path / "site", {"kvmirror": ("", "")}, "kvmirror-plugin", costs={"kvmirror": KV_MIRROR})
    done = _plan_command("--hardware", "a100", *SMALL, "+plugins=[ac,kvmirror]", f"plugins.ac.mode={mode}", env=env)
    assert done.returncode == 0, done.stderr
    _, result = job_estimate(["--hardware", "a100", *SMALL, "+plugins=[ac]", f"plugins.ac.mode={mode}"])
    assert all(result.recomputes(i) for i in result.blocks)
    once = len(result.blocks) * result.facts.attention_kv * result.microbatch_tokens * result.microbatches_per_step()
    line = next(line for line in done.stdout.splitlines() if "keys and values to the mirror" in line)
    number, unit = line.split(": ")[-1].split()[:2]
    assert float(number) * {"MiB": 2**20, "KiB": 2**10}[unit] == pytest.approx(runs * once, abs=0.006 * 2**10)


# Written from docs/planner-internals.md's paragraph on mixture-of-experts units: a module of a sparse block marked
# replicate_only_over, and the dimensions it names told to the planner.
EXPERTS_UNIT = '''
from titan_core import DP_SHARD, Declaration, hookimpl, replicate_only_over


@hookimpl
def declare():
    return Declaration(stage=400)


@hookimpl
def apply_parallelism(model_parts, plan):
    """expertsunit: each block's experts a data-parallel unit of their own, over the dp_shard ranks."""
    for part in model_parts:
        for block in plan.model.blocks_of(part).values():
            experts = plan.model.experts_of(block)
            if experts is not None:
                replicate_only_over(experts, (DP_SHARD,))
'''
EXPERTS_UNIT_COSTS = '''
from titan_core import DP_SHARD, hookimpl


@hookimpl
def estimate_costs(estimate):
    """expertsunit: the sharder's units the experts make."""
    estimate.sparse_units.append((DP_SHARD,))
'''


def test_an_outsiders_expert_units_are_gathered_and_reduced_as_planned(tmp_path, monkeypatch):
    """A plugin written from docs/planner-internals.md makes each block's experts a unit of the sharder's own and
    says so in Estimate.sparse_units, knowing no fsdp: under fsdp 2 on gpt-oss (4 sparse blocks) the calls rank 0
    issues are those planned, 7 gathers and 4 reduce-scatters more than fsdp alone."""
    install_plugins(tmp_path / "site", {"expertsunit": (EXPERTS_UNIT, "")}, "expertsunit-plugin",
                    costs={"expertsunit": EXPERTS_UNIT_COSTS})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    job = ("launch.device=cpu", "model=gpt_oss_tiny", "plugins.fsdp.degree=2")
    *_, alone = _estimate(*job, "+plugins=[fsdp]")
    config, registry, plan, result = _estimate(*job, "+plugins=[fsdp,expertsunit]")
    planned = sum(result.collective_calls(c) for c in result.collectives)
    assert planned == sum(alone.collective_calls(c) for c in alone.collectives) + 7 + 4
    assert _on_rank0(tracked_rank.collective_calls, config, registry, plan) == planned


MOMENTUM = '''
import torch
from titan_core import hookimpl


@hookimpl
def build_optimizer(model_parts):
    """momentum: SGD with momentum, one state per parameter."""
    return torch.optim.SGD([p for part in model_parts for p in part.parameters()], lr=0.1, momentum=0.9)
'''


def test_an_optimizer_plugins_state_is_measured_not_assumed(tmp_path):
    """The planner steps the job's own optimizer on one parameter: an outsider's SGD with momentum keeps half of
    AdamW's state per parameter, with nothing stated by the plugin."""
    env = install_plugins(tmp_path / "site", {"momentum": (MOMENTUM, "")}, "momentum-plugin")

    def optimizer_gib(*plugins):
        done = _plan_command("--hardware", "a100", *SMALL, "launch.world_size=2", f"+plugins=[{','.join(plugins)}]",
                             env=env)
        assert done.returncode == 0, done.stderr
        line = next(line for line in done.stdout.splitlines() if line.strip().startswith("optimizer "))
        return float(line.split()[1]), line.split()[2]

    adamw, momentum = optimizer_gib("fsdp"), optimizer_gib("fsdp", "momentum")
    assert adamw[1] == momentum[1] and momentum[0] == pytest.approx(adamw[0] / 2, rel=0.01)
    *_, narrow = _estimate("optimizer.state_dtype=bfloat16")
    assert narrow.optimizer_state_bytes == 4  # AdamW's two moments in bfloat16


# Written from docs/planner-internals.md's paragraph on the estimate's properties: a plugin freezing modules as it
# converts them registers the same conversion for the planner's trace.
FROZEN_LAYERS = '''
from titan_core import hookimpl


def freeze(model, prefixes):
    for name, parameter in model.named_parameters():
        if name.startswith(tuple(prefixes)):
            parameter.requires_grad_(False)


@hookimpl
def convert_modules(model, plugin_config):
    """frozenlayers: freeze the parameters whose names start with the prefixes given."""
    freeze(model, plugin_config.prefixes)
'''
# Its pricing imports from its own plugin's module (install_plugins names it after the distribution and the plugin).
FROZEN_LAYERS_COSTS = '''
import functools

from frozenlayers_plugin_frozenlayers import freeze
from titan_core import hookimpl


@hookimpl
def estimate_costs(estimate, plugin_config):
    """frozenlayers: the model traced frozen as converted (the core then counts what still trains)."""
    if plugin_config.traced:  # false: as a plugin that does not register its conversion
        estimate.trace_conversions[f"frozenlayers {list(plugin_config.prefixes)}"] = functools.partial(
            freeze, prefixes=list(plugin_config.prefixes))
'''


def test_an_outsiders_frozen_layers_are_traced_as_it_converts_them(tmp_path):
    """An outsider's plugin freezes the embeddings and the first two blocks: they keep nothing for backward and make
    no gradient. Its rank's plan (the plan command) within 1% of torch's tracker over the worker's step (measured
    +0.6%); without its conversion registered, the model traced unfrozen, 73% over."""
    env = install_plugins(tmp_path / "site", {"frozenlayers": (
        FROZEN_LAYERS, "prefixes: [tok_embeddings, layers.0., layers.1.]\ntraced: true\n")}, "frozenlayers-plugin",
        costs={"frozenlayers": FROZEN_LAYERS_COSTS})
    overrides = ["launch.device=cpu", "training.seq_len=256", "+plugins=[frozenlayers]"]
    tracked = subprocess.run([sys.executable, tracked_rank.__file__, "1", str(tmp_path), *SMALL, *overrides],
                             env={**os.environ, **env}, timeout=600, capture_output=True, text=True)
    assert tracked.returncode == 0, tracked.stderr[-3000:]
    measured = json.loads((tmp_path / "rank0.json").read_text())["Total"]
    label = "memory per rank (the most loaded), at its peak: "
    profile = tmp_path / "this-cpu.yaml"
    profile.write_text("bf16_tflops: 0.1\nmemory_gib: 16\ndevice_type: cpu\nachievable: 1.0\n")
    planned = {}
    for traced in ("true", "false"):
        done = _plan_command("--hardware", str(profile), *SMALL, *overrides, f"plugins.frozenlayers.traced={traced}",
                             env=env)
        assert done.returncode == 0, done.stderr
        planned[traced] = _printed_bytes(done.stdout, label) / measured - 1
    assert abs(planned["true"]) < 0.01
    assert planned["false"] > 0.1


def test_a_plugin_without_the_hook_is_reported_not_counted():
    *_, result = _estimate("+plugins=[checkpoint]")
    assert result.not_counted == ["checkpoint"]


# Two plugins written from docs/planner-internals.md that cost the devices nothing: one says so, one has no hook.
NOTIFIER = '''
from titan_core import hookimpl


@hookimpl
def estimate_costs():
    """notifier: nothing on the devices or in their collectives: rank 0 posts a logged step between steps."""
'''


UNPRICED = '''
from titan_core import hookimpl


@hookimpl
def on_step_end(step):
    """unpriced: does nothing in this test."""
'''


def test_an_outsiders_plugin_that_costs_nothing_says_so_and_is_counted(tmp_path):
    env = install_plugins(tmp_path / "site", {"notifier": ("", ""), "unpriced": (UNPRICED, "")},
                          "nothing-plugins", costs={"notifier": NOTIFIER})
    counted = _plan_command("--hardware", "a100", *SMALL, "+plugins=[notifier]", env=env)
    unpriced = _plan_command("--hardware", "a100", *SMALL, "+plugins=[unpriced]", env=env)
    assert counted.returncode == unpriced.returncode == 0, counted.stderr + unpriced.stderr
    assert "not counted" not in counted.stdout
    assert "  not counted (no estimate_costs hook): unpriced" in unpriced.stdout.splitlines()


def test_the_trackers_are_counted_as_costing_the_devices_nothing(tmp_path):
    *_, plain = _estimate()
    # A store the installed client serves: MLflow's own default, a SQLite file, is refused as run refuses it.
    *_, tracked = _estimate("+plugins=[wandb,mlflow]", "plugins.wandb.mode=offline",
                            f"plugins.mlflow.tracking_uri=file:{tmp_path / 'mlruns'}")
    assert sorted(tracked.counted) == ["mlflow", "wandb"] and not tracked.not_counted
    assert sum(tracked.memory().values()) == sum(plain.memory().values())
    assert tracked.step_seconds() == plain.step_seconds()


def test_recommend_tries_an_outsiders_options_and_drops_what_does_not_fit(tmp_path):
    source = OUTSIDER + '''

@hookimpl
def plan_options():
    """staging: off, or staging tokens in a small or an impossibly large buffer."""
    return [None, {"bytes_per_token": 1024}, {"bytes_per_token": 1 << 40}]
'''
    env = install_plugins(tmp_path / "site", {"staging": ("", "bytes_per_token: 1024\n")}, "staging-plugin",
                          costs={"staging": source})
    done = _plan_command("--hardware", "a100", "--recommend", *SMALL, "launch.world_size=2",
                         "+plugins=[fsdp,staging]", env=env)
    assert done.returncode == 0, done.stderr
    header, *lines = done.stdout.splitlines()
    assert "fastest of 3 plans" in header and len(lines) == 2  # fsdp alone, fsdp + staging 1024; not 2**40
    assert "staging" not in lines[0] and "plugins.staging.bytes_per_token=1024" in lines[1]
