"""The numbers a run prints mean what they say: throughput counts the steps' own time (validation and checkpoint
saves are reported on their own), and the time left comes from the recent pace."""

import dataclasses
import json
import logging

import pytest
import torch
import torch.distributed as dist

from titan_core import metrics as metrics_module
from titan_core.metrics import MetricsLogger, trained_flops_per_token
from titan_core.plugins import Registry, build_meta_model, build_plan
from titan_core.testing import TINY, compose, run_job


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_throughput_leaves_out_validation_and_saves_and_the_eta_follows_the_recent_pace(one_rank, tmp_path,
                                                                                         monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="titan_core")
    config = compose(*TINY, "training.steps=100", "metrics.log_every=10")
    clock = [0.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock[0])
    logger = MetricsLogger(config, tmp_path, 0, 1, torch.device("cpu"), (1.0, "every weight trains"), first_step=0)
    logged = []
    for step in range(1, 61):
        clock[0] += 10.0 if step <= 10 else 1.0  # a slow start (compilation), then 1 s a step
        logger.record(step, torch.tensor(1.0))
        if step == 30:
            clock[0] += 7.0
            logger.spent("checkpoint", 7.0)
        if step % 10 == 0:
            clock[0] += 3.0
            logger.spent("validation", 3.0)
            logged.append(logger.log(step, 0.5, 1e-3, {}))
    assert [m["step_time_s"] for m in logged] == pytest.approx([10.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert logged[2]["checkpoint_time_s"] == 7.0 and "checkpoint_time_s" not in logged[3]
    assert all(m["validation_time_s"] == 3.0 for m in logged)
    assert logged[-1]["tokens_per_s"] == pytest.approx(8 * 32 / 1.0)
    # After 60 steps: 40 left at the last five intervals' pace (1 s a step); the slow start has left the window
    # (over the whole run it would say 40 x 2.5 s).
    assert caplog.records[-1].getMessage().endswith("| eta 0m40s (at the last 50 steps' pace)")
    # Output that is no terminal gets a line at least every metrics.progress_every_s (60 s) between logged steps:
    # the sixth step of the slow start, nothing logged for a minute.
    progress = [line for line in (r.getMessage() for r in caplog.records)
                if line.startswith("step ") and "loss" not in line]
    assert progress == ["step 6/100 | eta 15m40s (at the last 6 steps' pace)"]
    logger.close()


@pytest.mark.parametrize("chunk", [1 << 16, 7], ids=["one-read", "many-reads"])
def test_a_resumed_runs_log_supersedes_what_its_stopped_attempt_logged_past_the_checkpoint(tmp_path, monkeypatch,
                                                                                        chunk):
    """A run stopped at step 30 after saving step 20 logged 21-30 (and may have torn its last line): the resumed run
    cuts the log after step 20 before logging 21 again, reading back from the end only (in chunks of LOG_CHUNK)."""
    monkeypatch.setattr(metrics_module, "LOG_CHUNK", chunk)
    log = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step, "loss": 1.0 / step}) for step in range(1, 31)]
    log.write_text("\n".join(lines[:20]) + "\n" + json.dumps({"step": 20, "validation_loss": 2.0}) + "\n"
                   + "\n".join(lines[20:]) + '\n{"step": 31, "lo')
    metrics_module.cut_log_after(log, 20)
    kept = log.read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept] == [*range(1, 21), 20] and log.read_text().endswith("\n")
    metrics_module.cut_log_after(log, 0)  # a run starting afresh in the same folder
    assert log.read_text() == ""


def test_frozen_weights_gradients_are_not_counted_in_the_flops_a_run_reports(tmp_path):
    """A frozen linear never computes its weight's gradient: 2 FLOPs per element and token fewer than the model's
    training FLOPs (6 per weight); a frozen expert's for the tokens routed to it (top-k of the experts). A LoRA run
    (every base weight frozen) reports TFLOPS/device and MFU from what it computes; a model that does not say how many
    experts a token goes to gets none once its experts are frozen."""
    config = compose("model=qwen3_moe_tiny", "tokenizer.path=bytes", "training.seq_len=64")
    description = build_plan(config, Registry(config), None, 256).model
    model = build_meta_model(config, description)
    full = description.flops_per_token(64)
    assert trained_flops_per_token(model, description, 64) == (full, "every weight trains")
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    stacks = [getattr(block.mlp.experts, name) for block in model.layers.values() if hasattr(block.mlp, "experts")
              for name in description.experts.linears]
    for weight in linears:
        weight.requires_grad_(False)
    counted, how = trained_flops_per_token(model, description, 64)
    assert full - counted == 2 * sum(w.numel() for w in linears) and how == "frozen weights' gradients not counted"
    for weight in stacks:
        weight.requires_grad_(False)
    routed, count = description.experts.routed, description.experts.count
    assert (routed, count) == (2, 8)
    counted, _ = trained_flops_per_token(model, description, 64)
    assert full - counted == pytest.approx(2 * sum(w.numel() for w in linears) + 2 * sum(w.numel() for w in stacks)
                                           * routed / count)
    unsaid = dataclasses.replace(description, experts=dataclasses.replace(description.experts, routed=None))
    assert trained_flops_per_token(model, unsaid, 64) == (None, "model 'qwen3_moe' does not say how many experts a "
                                                          "token goes to (ExpertsLayout.routed), so with frozen "
                                                          "experts no TFLOPS or MFU")

    def flops_per_token(run_dir):
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["mfu"] == last["tflops_per_device"]  # of TINY's peak of 1 TFLOPS
        return last["tflops_per_device"] * 1e12 / last["tokens_per_s_per_device"]

    job = (*TINY, "training.steps=1", "testing.save_final_weights=false")
    whole, adapted = (flops_per_token(run_job([*job, *extra], tmp_path / name).run_dir)
                                                  for name, extra in (("whole", ()), ("lora", ("+plugins=[lora]",))))
    tiny = compose(*TINY)
    base = build_meta_model(tiny, build_plan(tiny, Registry(tiny), None, 264).model)  # the byte tokenizer's size
    frozen = sum(m.weight.numel() for m in base.modules() if isinstance(m, torch.nn.Linear))
    assert whole - adapted == pytest.approx(2 * frozen, rel=1e-9)
