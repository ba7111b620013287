"""The Llama model: published shapes, RoPE 3.1 scaling against Hugging Face's, init and FLOPs."""

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from titan_checkpoint.hf import load_hf_slices
from titan_core import ConfigError, document_ids
from titan_core.testing import init_weights, transformers_folder
from titan_llama3.model import LlamaArgs, Transformer, rope_frequencies
from titan_llama3.plugin import describe, llama_args, options_from_hf

CONF = Path(__file__).resolve().parents[1] / "titan_llama3" / "conf" / "model"


def published(name: str) -> LlamaArgs:
    return llama_args(OmegaConf.load(CONF / f"{name}.yaml"), vocab_size=128256, seq_len=8192)


@pytest.mark.parametrize("name, billions", [("8B", 8.03), ("70B", 70.55), ("405B", 405.85)])
def test_published_sizes(name, billions):
    with torch.device("meta"):
        model = Transformer(published(name))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


def test_rope_scaling_matches_hugging_face_llama3():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    args = published("8B")
    hf = LlamaConfig(hidden_size=args.dim, num_attention_heads=args.n_heads, rope_theta=args.rope_theta,
                     max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    args.max_seq_len = 2
    ours = rope_frequencies(args)  # angle at position 1 is the frequency itself
    torch.testing.assert_close(torch.atan2(ours[1, :, 1], ours[1, :, 0]), inv_freq.float(), rtol=1e-6, atol=1e-9)
    plain = rope_frequencies(LlamaArgs(dim=args.dim, n_heads=args.n_heads, max_seq_len=2))
    assert not torch.allclose(plain, ours), "scaling must change the low frequencies"


def tiny_args(**overrides) -> LlamaArgs:
    return LlamaArgs(**{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96,
                        "multiple_of": 32, "max_seq_len": 16, **overrides})


def test_grouped_query_attention_shapes_and_causality():
    model = Transformer(tiny_args())
    init_weights(model, describe(model.args), 0)
    assert model.layers["0"].attention.wk.weight.shape == (2 * 16, 64)
    tokens = torch.randint(0, 96, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 96)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 96
    # A later token must not change earlier positions' logits.
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def test_init_depends_on_the_seed_and_the_name_only():
    first, second, other = Transformer(tiny_args()), Transformer(tiny_args()), Transformer(tiny_args())
    with torch.device("meta"):
        on_meta = Transformer(tiny_args())
    on_meta.to_empty(device="cpu")
    for model, seed in ((first, 0), (second, 0), (other, 1), (on_meta, 0)):
        init_weights(model, describe(model.args), seed)
    for (name, a), b, c, d in zip(first.named_parameters(), second.parameters(), other.parameters(),
                                  on_meta.parameters()):
        assert torch.equal(a, b) and torch.equal(a, d), name
        assert name.endswith("norm.weight") or not torch.equal(a, c), name
    torch.testing.assert_close(on_meta.rope, rope_frequencies(tiny_args()))


def test_flops_per_token_counts_every_matmul_weight():
    args = tiny_args()
    model = Transformer(args)
    matmul_weights = sum(p.numel() for n, p in model.named_parameters()
                         if "norm" not in n and n != "tok_embeddings.weight")
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 16
    assert describe(args).flops_per_token(16) == 6 * matmul_weights + attention


def test_ffn_hidden_size_follows_the_published_rounding():
    assert published("8B").ffn_hidden_dim == 14336
    assert published("70B").ffn_hidden_dim == 28672
    assert published("405B").ffn_hidden_dim == 53248
    assert math.isclose(published("8B").head_dim, 128)


# No conformance matrix here: its every case (fsdp 2, tp 2, cp 2, pp 2, ac, compile, chunked loss under tp, float8,
# fsdp 2 to one process through a checkpoint) is a test of the plugin's own on this same tiny Llama, the reference
# family of every parity test; the kit runs on Qwen3, Qwen3-MoE and the GPT-2 example.


def test_block_causal_attention_equals_each_document_alone():
    """Packed documents masked by document attend as if each were the whole input (RoPE is relative,
    so only positions within a document matter)."""
    bos = 95
    model = Transformer(tiny_args(max_seq_len=38))
    init_weights(model, describe(model.args), 0)
    torch.manual_seed(0)
    documents = [torch.cat([torch.tensor([bos]), torch.randint(0, 90, (n - 1,))]) for n in (5, 9, 3, 15)]
    packed = torch.cat([torch.randint(0, 90, (6,)), *documents])[None]  # a row opens mid-document
    with torch.no_grad():
        masked = model(packed, document_ids=document_ids(packed, bos))
        causal = model(packed)
        start = 6
        for document in documents:
            alone = model(document[None])
            torch.testing.assert_close(masked[:, start:start + len(document)], alone, rtol=0, atol=2e-5)
            start += len(document)
        torch.testing.assert_close(masked[:, :6], model(packed[:, :6]), rtol=0, atol=2e-5)
    assert (masked - causal).abs().max() > 1e-2  # without the mask later documents see earlier ones


# A Llama config.json setting every key this family reads, each (but the computed ones) off transformers' default,
# with Llama 3.1's RoPE scaling.
HF_BASE = {"model_type": "llama", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "vocab_size": 300, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
           "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 4.0, "low_freq_factor": 1.5,
                               "high_freq_factor": 3.0, "original_max_position_embeddings": 16}}
ABSENT = "absent"  # a case's value for a key it leaves out of the file
TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
UNSCALED = {"rope_type": "default", "rope_theta": 5e5}
SCALED = HF_BASE["rope_parameters"]


@pytest.mark.parametrize("changes", [
    {}, {"hidden_size": ABSENT, "num_hidden_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 1,
         "head_dim": ABSENT},
    {"intermediate_size": ABSENT}, {"num_hidden_layers": ABSENT},
    {"num_attention_heads": ABSENT, "hidden_size": 512, "head_dim": ABSENT},
    {"num_key_value_heads": ABSENT}, {"num_key_value_heads": None}, {"head_dim": ABSENT}, {"head_dim": None},
    {"vocab_size": ABSENT}, {"rms_norm_eps": ABSENT}, {"max_position_embeddings": ABSENT},
    {"tie_word_embeddings": True},
    {"rope_parameters": {k: v for k, v in SCALED.items() if k != "original_max_position_embeddings"}},
    {"rope_parameters": {k: v for k, v in SCALED.items() if k != "original_max_position_embeddings"},
     "max_position_embeddings": ABSENT},
    {"rope_parameters": {k: v for k, v in SCALED.items() if k != "rope_theta"}},
    {"rope_parameters": {k: v for k, v in SCALED.items() if k != "rope_theta"}, "rope_theta": 2e4},
    {"rope_parameters": ABSENT}, {"rope_parameters": ABSENT, "rope_theta": 2e4},
    {"rope_parameters": ABSENT, "rope_theta": 2e4,  # transformers 4's names, and the old key of the type
     "rope_scaling": {"type": "llama3", **{k: v for k, v in SCALED.items() if k not in ("rope_type", "rope_theta")}}},
    {"rope_parameters": UNSCALED, "rope_scaling": {k: v for k, v in SCALED.items() if k != "rope_theta"}},
], ids=lambda changes: "-".join(f"{key}={value}" for key, value in changes.items()) or "all-set")
def test_a_config_json_is_read_as_transformers_reads_it(tmp_path, changes):
    """Each key left out (or null) defaults as transformers' LlamaConfig defaults it, and each set is honoured
    (transformers 4's rope_scaling over 5's rope_parameters): the file was once refused for a left-out size, norm
    epsilon or RoPE base, or read with Llama 3.1's original context (8192) for a left-out one."""
    transformers = pytest.importorskip("transformers")
    config = {key: value for key, value in {**HF_BASE, **changes}.items() if value != ABSENT}
    with torch.random.fork_rng():  # building both models draws from torch's global generator: leave it as found
        folder = transformers_folder(config, tmp_path / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
        ours = Transformer(llama_args(options_from_hf(json.loads((folder / "config.json").read_text())), 300, 32))
    load_hf_slices([ours], folder, describe(ours.args).hf)
    exported = describe(ours.args).hf.config
    compared = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings")
    assert {key: exported[key] for key in compared} == {key: getattr(hf.config, key) for key in compared}
    rope = ("rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings")
    assert {key: exported["rope_parameters"].get(key) for key in rope} == {key: hf.config.rope_parameters.get(key)
                                                                           for key in rope}
    with torch.no_grad():
        expected = hf.eval()(TOKENS).logits
        diff = (ours(TOKENS) - expected).abs().max().item()
    print(f"max logit diff against transformers {diff:.1e} (logits' scale {expected.abs().max():.1f})")
    assert diff <= 1e-5


@pytest.mark.parametrize("key", ["factor", "low_freq_factor", "high_freq_factor"])
def test_a_llama3_rope_without_a_key_transformers_requires_is_refused_in_one_line(key):
    """transformers refuses to build such a file; it was once read with Llama 3.1's values."""
    rope = {k: v for k, v in SCALED.items() if k != key}
    with pytest.raises(ConfigError) as error:
        options_from_hf({**HF_BASE, "rope_parameters": rope})
    assert error.value.field == "model.path"
    assert f"config.json's llama3 RoPE lacks {key}, which transformers requires too" in str(error.value)
