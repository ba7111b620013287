"""Parameter groups of the default optimizer: each parameter's role read from the model's description, weight decay
and learning-rate multipliers by role, the same under sharding, and a resumed job running its own config's rates."""

import types

import pytest
import torch

from titan_core.default_hooks import build_optimizer
from titan_core.parameter_roles import parameter_role
from titan_core.plugins import build_meta_model, model_description
from titan_core.testing import TINY, compare, compose, config_error, run_job


def roles(*overrides):
    config = compose(*overrides)
    description = model_description(config, 256)
    model = build_meta_model(config, description)
    found = {}
    for name, param in model.named_parameters():
        found.setdefault(parameter_role(description, name, param), set()).add(name)
    return found


def test_each_family_s_parameters_have_their_roles():
    llama = roles("model=tiny")
    assert llama["embedding"] == {"tok_embeddings.weight"} and llama["output"] == {"output.weight"}
    assert "bias" not in llama and {"norm.weight", "layers.0.attention_norm.weight"} <= llama["norm"]
    assert {"layers.0.attention.wq.weight", "layers.3.feed_forward.w2.weight"} <= llama["matrix"]
    moe = roles("model=qwen3_moe_tiny")
    experts = {name for name in moe["matrix"] if ".experts." in name}
    assert experts and "layers.0.self_attn.q_norm.weight" in moe["norm"]
    gpt2 = roles("model=gpt2_tiny", "training.seq_len=32")
    assert gpt2["embedding"] == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert "transformer.h.0.attn.c_q.bias" in gpt2["bias"]
    assert "transformer.ln_f.weight" in gpt2["norm"] and "transformer.ln_f.bias" in gpt2["bias"]


def test_only_the_roles_that_decay_decay_and_multipliers_scale_their_rate():
    """Zero gradients: Adam's update is 0, so a step moves a weight by its group's lr x weight decay alone."""
    config = compose("model=tiny", "optimizer.weight_decay=0.5", "optimizer.lr=0.1", "optimizer.lr_multipliers.embedding=2")
    description = model_description(config, 256)
    model = build_meta_model(config, description).to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(1.0)
    optimizer = build_optimizer(model_parts=[model], config=config, plan=types.SimpleNamespace(model=description))
    assert [(g["role"], g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [
        ("matrix", 0.1, 0.5), ("embedding", 0.2, 0.5), ("output", 0.1, 0.5), ("norm", 0.1, 0.0)]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    after = {name: param.flatten()[0].item() for name, param in model.named_parameters()}
    assert after["layers.0.attention.wq.weight"] == pytest.approx(1 - 0.1 * 0.5)
    assert after["output.weight"] == pytest.approx(1 - 0.1 * 0.5)
    assert after["tok_embeddings.weight"] == pytest.approx(1 - 0.2 * 0.5)
    assert after["layers.0.attention_norm.weight"] == 1.0


@pytest.mark.parametrize("override, line", [
    ("optimizer.no_weight_decay=[norms]", "optimizer.no_weight_decay: 'norms' is not a parameter role; fix: use some "
                                          "of matrix, embedding, output, norm, bias"),
    ("optimizer.lr_multipliers.norm=0", "optimizer.lr_multipliers.norm: 0 is not a positive number; fix: set a factor "
                                        "of optimizer.lr greater than 0"),
    ("+optimizer.lr_multipliers.experts=2", "optimizer.lr_multipliers.experts: 'experts' is not a parameter role; fix: "
                                            "use some of matrix, embedding, output, norm, bias"),
])
def test_a_bad_group_rule_is_one_line(override, line):
    assert str(config_error(override)) == line


GROUPS = ("optimizer.weight_decay=0.1", "optimizer.lr_multipliers.embedding=3", "optimizer.lr_multipliers.norm=0.5")


@pytest.mark.slow
def test_groups_under_fsdp_equal_one_process(titan_parity, titan_reference):
    report = titan_parity(["+plugins=[fsdp]", "plugins.fsdp.degree=2"], reference_overrides=GROUPS)
    assert report.max_loss_diff <= 1e-5 and report.max_param_diff <= 1e-4, report
    # Three times the rate moves the embeddings ~1e-2 further in 5 steps: the groups were applied.
    assert compare(titan_reference(GROUPS), titan_reference()).max_param_diff > 1e-3


@pytest.mark.slow
def test_a_resumed_job_runs_its_own_rates_and_groups(tmp_path):
    """Saved with one group at lr 1e-3, resumed with three groups at 2e-3: the schedule continues at the step it
    had reached, at the resumed job's rate (a checkpoint's rates would silently override the config)."""
    whole = run_job([*TINY, "+plugins=[checkpoint]", "plugins.checkpoint.interval=3"], tmp_path / "whole")
    resumed = run_job([*TINY, *GROUPS, "optimizer.lr=2e-3", "+plugins=[checkpoint]",
                       f"plugins.checkpoint.load_path={tmp_path / 'whole' / 'checkpoints' / 'step-3'}"],
                      tmp_path / "resumed")
    assert [m["step"] for m in resumed.metrics] == [4, 5]
    assert [m["lr"] for m in resumed.metrics] == pytest.approx([2 * m["lr"] for m in whole.metrics[3:]], rel=1e-12)
