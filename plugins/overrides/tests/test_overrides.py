"""Module overrides: the fused SwiGLU computes the model's own SwiGLU (logits and gradients), trains like the
unfused model in one process under fsdp, pp, activation checkpointing and compile, leaves a mixture of experts'
sparse blocks alone, keeps checkpoints in the model's own names, and refuses what it cannot run exactly; an
outsider's override written from docs/plugins/overrides.md alone swaps the same modules."""

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from titan_core.testing import (CHECKPOINT_STEP, LOSS_TOL, PARAM_TOL, TINY, built_model, compare, compose,
                                config_error, install_plugins, run_job, write_hf_folder)
from titan_core import folder_config, load_tokenizer, model_description
from titan_overrides.plugin import FusedSwiGLU, activation, swap_swiglu

DOC = Path(__file__).parents[3] / "docs" / "plugins" / "overrides.md"
FUSED = ["+plugins=[overrides]"]


def logits_and_grads(model, tokens):
    logits = model(tokens)
    F.cross_entropy(logits[0, :-1], tokens[0, 1:]).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("model, run", [("model=tiny", "eager"), ("model=qwen3_tiny", "eager"),
                                        ("model=tiny", "compiled")])
def test_the_fused_swiglu_computes_the_models_own(model, run):
    """The same logits and gradients as the model's own SwiGLU, every dense block swapped, the names unchanged."""
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    plain, fused = built_model(model, "tokenizer.path=bytes"), built_model(model, "tokenizer.path=bytes")
    config = compose(model, "tokenizer.path=bytes")
    description = model_description(config, load_tokenizer(config.tokenizer).vocab_size)
    assert swap_swiglu(fused, description, activation(run)) == description.n_layers
    assert sum(isinstance(m, FusedSwiGLU) for m in fused.modules()) == description.n_layers
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in plain.named_parameters()]
    (expected, grads), (got, fused_grads) = logits_and_grads(plain, tokens), logits_and_grads(fused, tokens)
    assert (got - expected).abs().max() <= 1e-5 and expected.abs().max() > 0.1
    for name, grad in grads.items():
        assert (fused_grads[name] - grad).abs().max() <= 1e-5, name


def test_the_fused_swiglu_computes_transformers_own_swiglu(tmp_path):
    """A Mistral folder through the transformers backend: its layers' MLP is transformers' SwiGLU, found by the
    backend, and fused it computes transformers' logits and gradients."""
    transformers = pytest.importorskip("transformers")
    from titan_checkpoint.generate import load_model  # (after the skip: it needs safetensors)
    folder = write_hf_folder(transformers.MistralForCausalLM(transformers.MistralConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=2048, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)), tmp_path / "m")
    config = folder_config(folder, 24, model="transformers")
    description = model_description(config, load_tokenizer(config.tokenizer).vocab_size)
    plain, fused = load_model(folder, config).train(), load_model(folder, config).train()
    assert swap_swiglu(fused, description, activation("eager")) == 2
    tokens = torch.randint(0, 2048, (1, 24), generator=torch.Generator().manual_seed(0))
    (expected, grads), (got, fused_grads) = logits_and_grads(plain, tokens), logits_and_grads(fused, tokens)
    assert (got - expected).abs().max() <= 1e-5 and expected.abs().max() > 0.1
    assert all((fused_grads[name] - grad).abs().max() <= 1e-5 for name, grad in grads.items())


def fused_blocks(run_dir: Path) -> list[int]:
    """The swapped blocks each logged step counted on rank 0 (the plugin's own metric)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [int(json.loads(line)["overrides_fused_swiglu_blocks"]) for line in lines]


PLANS = {  # what each adds: the reference is the same model unfused, in one process
    "fsdp2": ([], ["plugins.fsdp.degree=2", "+plugins=[fsdp]"], 4),
    "pp2-ac-full": ([], ["+plugins=[pp,ac]", "plugins.pp.degree=2", "plugins.ac.mode=full",
                         "training.grad_accum_steps=2"], 2),  # each stage holds 2 of the 4 blocks
    "compile": ([], ["+plugins=[compile]"], 4),
    # the dense first block fused, the sparse ones (experts over 2 ranks) left to the core's grouped experts
    "deepseek-fsdp2-ep2": (["model=deepseek_v3_tiny"], ["+plugins=[fsdp,ep]", "plugins.fsdp.degree=2",
                                                        "plugins.ep.degree=2"], 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS))
def test_trains_like_the_unfused_model_in_one_process(titan_parity, plan, tmp_path):
    model, overrides, blocks = PLANS[plan]
    report = titan_parity([*model, *FUSED, *overrides], reference_overrides=model)
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report
    assert set(fused_blocks(tmp_path / "run")) == {blocks}  # rank 0's blocks, every step


@pytest.mark.slow
def test_a_checkpoint_saved_fused_resumes_unfused(titan_reference, tmp_path):
    """The names never change: saved under fsdp 2 with the override, resumed in one process without it, the run
    continues the unfused reference."""
    run_job([*TINY, *FUSED, "+plugins=[fsdp,checkpoint]", "plugins.fsdp.degree=2",
             f"plugins.checkpoint.interval={CHECKPOINT_STEP}"], tmp_path / "fused")
    assert set(fused_blocks(tmp_path / "fused")) == {4}
    saved = tmp_path / "fused" / "checkpoints" / f"step-{CHECKPOINT_STEP}"
    resumed = run_job([*TINY, "+plugins=[checkpoint]", f"plugins.checkpoint.load_path={saved}"], tmp_path / "plain")
    reference = titan_reference()
    assert [m["step"] for m in resumed.metrics] == list(range(CHECKPOINT_STEP + 1, len(reference.losses) + 1))
    diff = max(abs(a - b) for a, b in zip(resumed.losses, reference.losses[CHECKPOINT_STEP:]))
    assert diff <= LOSS_TOL


@pytest.mark.parametrize("overrides, field, said", [
    (["plugins.overrides.modules=[fused_mlp]"], "plugins.overrides.modules", "'fused_mlp' is not an override"),
    (["plugins.overrides.modules=[]"], "plugins.overrides.modules", "is empty"),
    (["plugins.overrides.activation=triton"], "plugins.overrides.activation", "'triton' is not a way"),
    (["+plugins=[tp]", "plugins.tp.degree=2"], "plugins.overrides.modules", "does not run under tensor parallel"),
    (["model=gpt2_tiny"], "plugins.overrides.modules", "does not describe gated_mlp"),
])
def test_what_cannot_run_exactly_is_refused_before_launch(overrides, field, said):
    error = config_error(*TINY, *FUSED, *overrides)
    assert error.field == field and said in str(error), error


@pytest.mark.parametrize("converter, made", [("float8", "Float8Linear"), ("lora", "Linear carrying lora_A"),
                                             ("float8,lora", "Float8Linear")])
def test_linears_another_plugin_converted_are_refused_before_launch(converter, made):
    """float8's and LoRA's linears would be bypassed by the fused product: refused by the launcher's own check, which
    runs the conversions on the meta model when two plugins convert (before, each worker refused it)."""
    error = config_error(*TINY, f"+plugins=[{converter},overrides]")
    assert error.field == "plugins.overrides.modules" and f"another plugin made one a {made}" in str(error), error


# A converter that fails with an ordinary exception, not a refusal.
BROKEN_CONVERSION = """
from titan_core import hookimpl


@hookimpl
def convert_modules(model):
    raise RuntimeError("brokenconv failed on purpose")
"""


@pytest.mark.slow
def test_a_conversion_failing_otherwise_is_reported_in_the_runs_one_line(tmp_path):
    """Beside another converter, a conversion failing with anything but a ConfigError is not a traceback from the
    launcher's check of the conversions: the run starts, and its one line names the failure."""
    env = install_plugins(tmp_path / "site", {"brokenconv": (BROKEN_CONVERSION, "")}, "brokenconv-plugin")
    result = run_job([*TINY, "+plugins=[brokenconv,overrides]"], tmp_path / "run", expect_success=False, env=env)
    lines = [line for line in result.stderr.splitlines() if line.startswith("titan-core:")]
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "titan-core: run dir" in result.stdout, result.stdout  # printed once the launcher's checks passed
    assert len(lines) == 1 and "brokenconv failed on purpose" in lines[0], result.stderr


def documented_override() -> str:
    """The override docs/plugins/overrides.md shows an author, as written there."""
    return re.search(r"## Write your own.*?```python\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)


@pytest.mark.slow
def test_an_outsiders_override_from_the_docs_swaps_the_same_modules(titan_reference, tmp_path):
    env = install_plugins(tmp_path / "site", {"my_swiglu": (documented_override(), "")})
    result = run_job([*TINY, "+plugins=[my_swiglu,fsdp]", "plugins.fsdp.degree=2"], tmp_path / "run", env=env)
    report = compare(result, titan_reference())
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report
    assert result.metrics[-1]["my_swiglu_calls"] == 5 * 4  # 5 steps x 4 blocks on rank 0, each one forward
