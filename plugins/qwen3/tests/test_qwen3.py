"""Qwen3: published sizes, transformers reads our export with equal logits, import gives the model back, a
config.json leaving keys out is read as transformers reads it, and the conformance kit."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from titan_checkpoint.hf import export_hf, import_hf
from titan_core import ConfigError
from titan_core.testing import init_weights
from titan_core.testing import TINY, model_conformance, run_job
from titan_qwen3.model import Qwen3
from titan_qwen3.plugin import describe, options_from_hf, qwen3_args

CONF = Path(__file__).resolve().parents[1] / "titan_qwen3" / "conf" / "model"
LOGIT_TOLERANCE = 1e-5
TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))

test_qwen3_conformance = model_conformance(["model=qwen3_tiny"])


@pytest.mark.parametrize("name, billions", [("qwen3_0.6B", 0.596), ("qwen3_8B", 8.19), ("qwen3_32B", 32.76)])
def test_published_sizes(name, billions):
    with torch.device("meta"):
        model = Qwen3(qwen3_args(OmegaConf.load(CONF / f"{name}.yaml"), vocab_size=151936, seq_len=4096))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


def tiny_qwen3(tied: bool) -> Qwen3:
    options = {**OmegaConf.to_container(OmegaConf.load(CONF / "qwen3_tiny.yaml")), "tie_word_embeddings": tied,
               "rope_theta": 10000.0}
    model = Qwen3(qwen3_args(options, vocab_size=300, seq_len=32))
    init_weights(model, describe(model.args), 3)
    with torch.no_grad():  # norms start at 1: move them, or a transposed or skipped norm would go unseen
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_reads_the_export_with_equal_logits_and_import_gives_it_back(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    model = tiny_qwen3(tied)
    adapter = describe(model.args).hf
    export_hf(model.state_dict(), adapter, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is tied
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        expected = model(TOKENS)
        diff = (hf(TOKENS).logits - expected).abs().max().item()
    print(f"max logit diff against transformers' Qwen3 ({'tied' if tied else 'untied'}): {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE

    options, weights = import_hf(tmp_path, adapter)
    rebuilt = Qwen3(qwen3_args(options, vocab_size=300, seq_len=32))
    rebuilt.load_state_dict(weights)
    with torch.no_grad():
        assert torch.equal(rebuilt(TOKENS), expected)


def test_bfloat16_autocast_on_the_cpu_trains_without_torchs_norm_warning(tmp_path):
    """Under the core's autocast on a CPU, Qwen3's query and key norms get a linear's bfloat16 output beside their
    float32 weights, and torch warns that it takes the unfused path: nothing a user can act on, kept off the
    console (it was printed once per run)."""
    result = run_job([*TINY, "model=qwen3_tiny", "training.compute_dtype=bfloat16", "training.steps=2"],
                     tmp_path / "run")
    assert "step 2/2" in result.stdout + result.stderr
    assert "Warning" not in result.stdout + result.stderr, result.stderr


# A Qwen3 config.json setting every key this family reads, each (but the computed ones) off transformers' default.
HF_BASE = {"model_type": "qwen3", "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
           "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 96, "vocab_size": 300, "rms_norm_eps": 1e-5,
           "max_position_embeddings": 64, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
ABSENT = "absent"  # a case's value for a key it leaves out of the file
COMPARED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")  # and head_dim, RoPE


@pytest.mark.parametrize("changes", [
    {}, {"hidden_size": ABSENT}, {"num_hidden_layers": ABSENT}, {"num_attention_heads": ABSENT},
    {"num_key_value_heads": ABSENT, "num_attention_heads": 64}, {"num_key_value_heads": None}, {"head_dim": ABSENT},
    {"intermediate_size": ABSENT}, {"vocab_size": ABSENT}, {"rms_norm_eps": ABSENT},
    {"max_position_embeddings": ABSENT}, {"tie_word_embeddings": True}, {"rope_parameters": ABSENT},
    {"rope_parameters": {"rope_type": "default"}},
    {"rope_parameters": {"rope_type": "default"}, "rope_theta": 2e4}, {"rope_parameters": ABSENT, "rope_theta": 2e4},
], ids=lambda changes: "-".join(f"{key}={value}" for key, value in changes.items()) or "all-set")
def test_a_config_json_is_read_as_transformers_reads_it(read_as_transformers, changes):
    """Each key left out (or null) defaults as transformers' Qwen3Config defaults it, and each set is honoured: the file
    was once read with the options' defaults for left-out keys (rope_theta 1e6, num_key_value_heads 8, 36 layers, the
    tokenizer's vocabulary, a null number of key-value heads)."""
    config = {key: value for key, value in {**HF_BASE, **changes}.items() if value != ABSENT}
    read_as_transformers(config, COMPARED, lambda options: Qwen3(qwen3_args(options, vocab_size=300, seq_len=32)),
                         options_from_hf, describe)


@pytest.mark.parametrize("changes, said", [
    ({"head_dim": None}, "config.json sets head_dim=null, which transformers' qwen3 config refuses too"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
     "config.json sets rope_type='yarn', which qwen3 does not compute"),
    ({"rope_parameters": {"type": "linear", "factor": 2.0, "rope_theta": 5e5}},
     "config.json sets rope_type='linear', which qwen3 does not compute"),
])
def test_a_config_json_qwen3_does_not_compute_is_refused_in_one_line(changes, said):
    """A null transformers refuses too, and a RoPE scaling under either name or its old key ``type`` (the file was
    once read as unscaled)."""
    with pytest.raises(ConfigError) as error:
        options_from_hf({**HF_BASE, **changes})
    assert error.value.field == "model.path" and said in str(error.value)
