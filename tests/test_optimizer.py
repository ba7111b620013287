"""The default optimizer's implementations: torch's AdamW kernels train alike, and their state is
checkpointed and resharded like any other."""

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from titan_core.adamw import AdamWNarrowStates
from titan_core.launch.cluster import job_nodes
from titan_core.launch.prepare import prepare
from titan_core.testing import TINY, compare, compose, config_error, error_line, install_plugins, run_job

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


def _adamw_trajectories(optimizer_class, steps=4, **kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    optimizer = optimizer_class(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kwargs)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
    return params, optimizer


def test_narrow_state_adamw_is_torch_adamw_in_float32():
    """The bf16-state optimizer's update is torch's AdamW: with float32 states the two agree to the ulp."""
    ours, _ = _adamw_trajectories(AdamWNarrowStates, state_dtype=torch.float32)
    torch_params, _ = _adamw_trajectories(torch.optim.AdamW, foreach=False)
    for a, b in zip(ours, torch_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_narrow_state_adamw_keeps_bfloat16_moments():
    ours, optimizer = _adamw_trajectories(AdamWNarrowStates, state_dtype=torch.bfloat16)
    wide, _ = _adamw_trajectories(torch.optim.AdamW, foreach=False)
    states = [optimizer.state[p] for p in ours]
    assert {s[k].dtype for s in states for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    assert all(s["step"].item() == 4 for s in states)
    # Rounding the moments moves the weights by much less than one update (lr 1e-2), but it moves them.
    drift = max((a - b).abs().max().item() for a, b in zip(ours, wide))
    assert 0 < drift < 1e-3


def test_bfloat16_states_are_refused_with_float32_kernels(tmp_path):
    result = run_job([*TINY, "optimizer.state_dtype=bfloat16", "optimizer.implementation=fused",
                      "launch.dry_run=true"], tmp_path / "run", expect_success=False)
    assert error_line(result) == ("titan-core: error: optimizer.implementation: 'fused' keeps float32 states, but "
                                  "optimizer.state_dtype=bfloat16 updates one parameter at a time; fix: set "
                                  "optimizer.implementation=null (or for_loop)")


@pytest.mark.slow
def test_bfloat16_states_checkpoint_and_resume_resharded(tmp_path):
    """bf16 moments saved under FSDP 2 are read back as bf16 and resume on one process where the sharded
    run went on."""
    sharded = run_job([*TINY, "optimizer.state_dtype=bfloat16", "+plugins=[fsdp,checkpoint]",
                       "plugins.fsdp.degree=2", "plugins.checkpoint.interval=3"], tmp_path / "sharded")
    step_3 = tmp_path / "sharded" / "checkpoints" / "step-3"
    saved = FileSystemReader(str(step_3)).read_metadata().state_dict_metadata
    moments = {k: v.properties.dtype for k, v in saved.items() if k.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq")}
    assert moments and set(moments.values()) == {torch.bfloat16}
    resumed = run_job([*TINY, "optimizer.state_dtype=bfloat16", "+plugins=[checkpoint]",
                       f"plugins.checkpoint.load_path={step_3}"], tmp_path / "resumed")
    report = compare(resumed, dataclasses.replace(sharded, after_step=3))
    assert len(report.losses) == 2 and report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report


def test_warmup_stable_decay_holds_then_decays_in_its_shape():
    from titan_core.lr_schedule import lr_schedule
    from titan_core.testing import compose

    def rates(*overrides):
        factor = lr_schedule(compose("training.steps=100", "lr_scheduler.warmup_steps=10", "lr_scheduler.decay=wsd",
                                     "lr_scheduler.min_lr_ratio=0.1", *overrides))
        return [factor(step) for step in range(100)]

    linear = rates("lr_scheduler.decay_steps=20")
    assert linear[:10] == [(step + 1) / 10 for step in range(10)]  # warm-up
    assert set(linear[10:81]) == {1.0}  # stable until the last 20 steps
    assert linear[90] == pytest.approx(1 - 0.9 * 10 / 20) and linear[99] == pytest.approx(1 - 0.9 * 19 / 20)
    sqrt = rates("lr_scheduler.decay_steps=20", "lr_scheduler.decay_shape=sqrt")
    assert sqrt[90] == pytest.approx(0.1 + 0.9 * (1 - (10 / 20) ** 0.5))
    assert rates()[80] == 1.0 and rates()[81] < 1.0  # null: the last fifth decays


@pytest.mark.parametrize("overrides, line", [
    (["lr_scheduler.decay_steps=20"], "lr_scheduler.decay_steps: 20 does nothing unless lr_scheduler.decay=wsd (decay "
     "is cosine); fix: set lr_scheduler.decay=wsd, or leave lr_scheduler.decay_steps at its default (null)"),
    (["lr_scheduler.decay=linear", "lr_scheduler.decay_shape=sqrt"], "lr_scheduler.decay_shape: sqrt does nothing unless "
     "lr_scheduler.decay=wsd (decay is linear); fix: set lr_scheduler.decay=wsd, or leave lr_scheduler.decay_shape at "
     "its default (linear)"),
])
def test_wsds_options_beside_another_decay_are_refused(overrides, line):
    """decay_steps and decay_shape shape wsd's decay only: beside cosine or linear they once did nothing silently."""
    from titan_core.testing import config_error

    assert str(config_error(*overrides)) == line


@pytest.mark.parametrize("override, words", [
    ("lr_scheduler.decay=step", "lr_scheduler.decay: unknown decay 'step'"),
    ("lr_scheduler.decay_shape=exp", "lr_scheduler.decay_shape: unknown shape 'exp'"),
    ("lr_scheduler.decay_steps=500", "lr_scheduler.decay_steps: 500 is not a number of steps from 1 to"),
])
def test_a_bad_schedule_is_one_line(override, words):
    from titan_core.testing import config_error

    assert words in str(config_error("lr_scheduler.decay=wsd", override) if "decay=" not in override
                        else config_error(override))


def test_warmup_stable_decay_resumes_at_any_step(tmp_path):
    from titan_core.testing import TINY, run_job

    job = [*TINY, "training.steps=6", "lr_scheduler.decay=wsd", "lr_scheduler.decay_steps=3",
           "+plugins=[checkpoint]", "plugins.checkpoint.interval=4"]
    whole = run_job(job, tmp_path / "whole")
    resumed = run_job([*job, f"plugins.checkpoint.load_path={tmp_path / 'whole' / 'checkpoints' / 'step-4'}"],
                      tmp_path / "resumed")
    assert [m["lr"] for m in resumed.metrics] == [m["lr"] for m in whole.metrics[4:]]
    assert [m["lr"] for m in whole.metrics][1:4] == [1e-3] * 3  # stable, then the last three decay
    assert whole.metrics[4]["lr"] < 1e-3


def test_one_device_trains_in_bfloat16_with_float32_weights(titan_reference, tmp_path):
    """training.compute_dtype=bfloat16 without a sharding plugin: autocast computes in bf16, the weights (and the
    optimizer) stay float32. bf16 keeps 8 mantissa bits: within the tolerance fsdp's bf16 parameters meet, and not
    equal, which would mean nothing was cast."""
    from titan_core.testing import TINY, compare, run_job

    result = run_job([*TINY, "training.compute_dtype=bfloat16"], tmp_path / "bf16")
    report = compare(result, titan_reference())
    print(f"bf16 autocast against fp32: {report}")
    # Measured: losses 1.7e-4 apart, weights 4.9e-3 (the embedding: a few Adam steps of lr 1e-3 whose sign bf16
    # flipped); a wrong gradient moves the loss by > 0.1.
    assert 0 < report.max_loss_diff <= 1e-2, report
    assert report.max_param_diff <= 1e-2, report
    assert {tensor.dtype for tensor in result.final_weights().values()} == {torch.float32}


# An optimizer plugin as docs/writing-plugins.md describes one: plain SGD over the core's parameter groups, honouring
# the learning rate and weight decay it receives and saying so; the other declaring nothing.
SGD_PLUGIN = '''
import torch
from titan_core import Declaration, hookimpl, param_groups


@hookimpl
def declare(plugin_config):
    return Declaration(optimizer_options=frozenset(plugin_config.honours))


@hookimpl
def build_optimizer(model_parts, config, plan):
    opt = config.optimizer
    groups = param_groups(model_parts, plan.model, opt.lr, opt.weight_decay, opt.no_weight_decay, opt.lr_multipliers)
    return torch.optim.SGD(groups, lr=opt.lr)
'''


def test_an_option_the_optimizer_plugin_does_not_honour_is_refused(tmp_path, monkeypatch):
    """The core's optimizer.* options reach an optimizer plugin, which declares the ones it honours: another set
    away from its default is refused before launch, naming it (an optimizer plugin once ignored betas, eps,
    implementation and state_dtype silently); one it honours, or any left at its default, launches."""
    install_plugins(tmp_path / "site", {"sgd": (SGD_PLUGIN, "honours: [lr, weight_decay, no_weight_decay, "
                                                             "lr_multipliers]\n")}, "sgd-plugin")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    job = [*TINY, "+plugins=[sgd]"]
    error = config_error(*job, "optimizer.betas=[0.8,0.9]")
    assert error.field == "optimizer.betas" and "plugin 'sgd' builds the optimizer without it" in str(error)
    assert "it honours optimizer.lr, optimizer.weight_decay, optimizer.no_weight_decay, optimizer.lr_multipliers" in str(
        error)
    assert config_error(*job, "optimizer.state_dtype=bfloat16").field == "optimizer.state_dtype"
    prepare(compose(*job, "optimizer.lr=0.5", "optimizer.weight_decay=0.0"), job_nodes())  # honoured: launches
    error = config_error(*job, "plugins.sgd.honours=[]", "optimizer.lr=0.5")
    assert error.field == "optimizer.lr" and "(it honours none of them)" in str(error)


FROZEN_FIRST_STAGE = '''
from titan_core import hookimpl


@hookimpl
def convert_modules(model, plan):
    for name in (*plan.model.inputs, f"{plan.model.blocks}.0", f"{plan.model.blocks}.1"):
        model.get_submodule(name).requires_grad_(False)
'''


@pytest.mark.slow
def test_a_pipeline_stage_with_nothing_to_train_steps_an_empty_optimizer(tmp_path):
    """A conversion freezes the embeddings and the first two of four blocks: under pp 2 the first stage trains
    nothing. Its optimizer steps one empty group (it once failed after launch: "optimizer got an empty parameter
    list"), the run matches one process, and it saves and resumes like any other."""
    env = install_plugins(tmp_path / "site", {"frozen": (FROZEN_FIRST_STAGE, "")}, "frozen-plugin")
    job = [*TINY, "training.steps=4", "+plugins=[frozen]"]
    reference = run_job(job, tmp_path / "one", env=env)
    staged = [*job[:-1], "+plugins=[frozen,pp,checkpoint]", "plugins.pp.degree=2", "plugins.checkpoint.interval=2"]
    whole = run_job(staged, tmp_path / "pp", env=env)
    report = compare(whole, reference)
    assert report.max_loss_diff <= 1e-5 and report.max_param_diff <= 1e-4, report
    assert torch.equal(whole.final_weights()["layers.0.attention.wq.weight"],
                       reference.final_weights()["layers.0.attention.wq.weight"])
    first = run_job([*staged, "training.steps=2"], tmp_path / "resumed", env=env)
    assert len(first.losses) == 2
    resumed = run_job(staged, tmp_path / "resumed", env=env)
    assert "continuing after step 2" in (tmp_path / "resumed" / "logs" / "rank0.log").read_text()
    assert compare(resumed, whole).max_param_diff == 0.0
