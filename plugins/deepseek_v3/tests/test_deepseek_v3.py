"""DeepSeek-V3: published sizes, transformers' model made in the test (which writes the released per-expert layout)
imported with its logits and our export read back by transformers (YaRN, MLA, group-limited sigmoid routing with a
balancing bias, shared experts), the conformance kit, and the one-line refusals."""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from titan_checkpoint.hf import export_hf, import_hf, load_hf_slices
from titan_core import ConfigError
from titan_core.testing import LOSS_TOL, PARAM_TOL, config_error, model_conformance
from titan_deepseek_v3.model import DeepseekV3, rope_table
from titan_deepseek_v3.plugin import deepseek_v3_args, describe, options_from_hf

CONF = "titan_deepseek_v3/conf/model"
TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))

# Each case trains the tiny model 5 steps and compares every loss and the final weights with one process. cp rings
# MLA's unequal head widths; pp's first step must not count torch's shape-inference forward into the routing bias.
# Measured too, by hand (docs/models/deepseek-v3.md): fsdp 2 (trained under fsdp 2 by the checkpoint case), ac
# selective, float8 (1.5e-3 from fp32), compile (the core's MoE compiles in Qwen3-MoE's and ep's tests), fsdp 2 x
# tp 2 without sequence parallel and a full-rank query.
test_deepseek_v3_conformance = model_conformance(["model=deepseek_v3_tiny"], cases=[
    "cp2", "pp2-interleaved1f1b", "checkpoint-fsdp2-to-one"])


@pytest.mark.slow
@pytest.mark.parametrize("stack, shared", [
    (("+plugins=[fsdp,ep]", "plugins.fsdp.degree=2", "plugins.ep.degree=2"), ()),
    # Heads split; the down-projections whole on each rank; the shared rotated key's gradient summed over ranks.
    # The MoE blocks' tokens are split instead, their gradients summed by fsdp.
    (("+plugins=[fsdp,tp]", "plugins.fsdp.degree=1", "plugins.tp.degree=2"), ()),
    # Documents masked from each other under the ring: cp gathers the keys and the (padded) values.
    (("+plugins=[cp]", "plugins.cp.degree=2"), ("training.attention_mask=block_causal",)),
    # TorchTitan's fused grouped experts case, which needs no override here: the core's experts hold gate and up as
    # one stacked weight run by grouped products; ep borrows the 4 ranks of fsdp 2 x tp 2.
    (("+plugins=[fsdp,tp,ep]", "plugins.fsdp.degree=2", "plugins.tp.degree=2", "plugins.ep.degree=4"), ()),
], ids=["fsdp2-ep2", "tp2-sp-lp", "cp2-block-causal", "fsdp2-tp2-ep4"])
def test_expert_tensor_and_masked_context_parallel_train_like_one_process(stack, shared, titan_parity):
    """``shared``: options the single-process reference takes too."""
    report = titan_parity(list(stack), reference_overrides=("model=deepseek_v3_tiny", *shared))
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report


def args(name="deepseek_v3_tiny", vocab_size=300, seq_len=32, **overrides):
    from pathlib import Path
    folder = Path(__file__).resolve().parents[1] / CONF
    return deepseek_v3_args({**OmegaConf.to_container(OmegaConf.load(folder / f"{name}.yaml")), **overrides},
                            vocab_size=vocab_size, seq_len=seq_len)


@pytest.mark.parametrize("preset, total, active, rounding", [
    ("deepseek_v3_671B", 671.03, 37, 0.6),  # 671,026,404,352 without the 14B multi-token-prediction module
    ("deepseek_v3_16B", 15.96, 3, 0.1),  # Moonlight-16B-A3B
])
def test_published_sizes(preset, total, active, rounding):
    """Totals to the published configs' exact counts; active parameters to the names' rounding (37B, A3B)."""
    big = args(preset, vocab_size=129280 if preset.endswith("671B") else 163840, seq_len=4096)
    with torch.device("meta"):
        model = DeepseekV3(big)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert params / 1e9 == pytest.approx(total, abs=0.01)
    met = params - experts * (big.num_experts - big.num_experts_per_tok) / big.num_experts
    assert met / 1e9 == pytest.approx(active, abs=rounding)


def hf_config(**overrides) -> dict:
    """transformers' DeepseekV3Config of the tiny preset, YaRN on."""
    a = args()
    config = dict(vocab_size=300, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                  moe_intermediate_size=a.moe_intermediate_size, num_hidden_layers=a.num_hidden_layers,
                  num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_attention_heads,
                  n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=a.kv_lora_rank,
                  q_lora_rank=a.q_lora_rank, qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
                  qk_nope_head_dim=a.qk_nope_head_dim, n_group=4, topk_group=2, num_experts_per_tok=2,
                  first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64, rope_interleave=True,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                                   "original_max_position_embeddings": 16}, tie_word_embeddings=False)
    return config | overrides


def transformers_model(**overrides):
    """transformers' DeepSeek-V3 with random weights, its router's bias and norms moved off their starts."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_config(**overrides)))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):
                tensor.normal_(0, 1)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["low-rank-query", "full-query"])
def test_a_transformers_folder_imports_with_its_logits_and_the_export_reads_back(tmp_path, q_lora_rank):
    hf = transformers_model(q_lora_rank=q_lora_rank)
    hf.save_pretrained(tmp_path / "hf")
    a = args(q_lora_rank=q_lora_rank)
    # transformers writes each expert's projections apart, as deepseek-ai's release stores them.
    assert (tmp_path / "hf" / "model.safetensors").exists()
    options, _ = import_hf(tmp_path / "hf", describe(a).hf)
    ours = DeepseekV3(deepseek_v3_args(options, vocab_size=300, seq_len=32))
    assert ours.args.mscale == 0.707 and ours.args.rope_scaling_factor == 4.0
    for tensor in ours.state_dict().values():
        tensor.zero_()
    read = load_hf_slices([ours], tmp_path / "hf", describe(ours.args).hf)
    assert read == sum(t.nbytes for t in ours.state_dict().values())
    assert ours.layers["1"].mlp.gate.expert_bias.abs().sum() > 0  # the released balance, kept
    with torch.no_grad():
        expected = hf(TOKENS).logits
        diff = (ours(TOKENS) - expected).abs().max().item()
    print(f"DeepSeek-V3 ({'full' if q_lora_rank is None else 'low-rank'} query): max logit diff against "
          f"transformers {diff:.2e} (logits' scale {expected.abs().max():.1f})")
    assert diff <= 1e-5

    export_hf(ours.state_dict(), describe(ours.args).hf, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["max_position_embeddings"] == 64  # the source's context, not the training length (32)
    assert (config["n_routed_experts"], config["rope_parameters"]["rope_type"]) == (8, "yarn")
    transformers = pytest.importorskip("transformers")
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (again(TOKENS).logits - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("yarn", [{}, {"mscale": 0.707}, {"mscale": 1.0, "mscale_all_dim": 1.0},
                                  {"beta_fast": 0, "beta_slow": None}],
                         ids=["no-mscale", "mscale-alone", "both", "betas-zero"])
def test_yarns_optional_keys_default_as_transformers_reads_them(tmp_path, yarn):
    """A config.json whose YaRN leaves out mscale or mscale_all_dim (or zeroes the betas) is read as transformers reads
    it: without mscale_all_dim, the rotation's magnitude is the plain correction and the softmax scale has none (the
    options once defaulted both to 1, 2.9e-3 off the logits, accepted)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16, **yarn}
    hf = transformers_model(rope_parameters=rope)
    hf.save_pretrained(tmp_path / "hf")
    options, _ = import_hf(tmp_path / "hf", describe(args()).hf)
    ours = DeepseekV3(deepseek_v3_args(options, vocab_size=300, seq_len=32))
    load_hf_slices([ours], tmp_path / "hf", describe(ours.args).hf)
    with torch.no_grad():
        expected = hf(TOKENS).logits
        assert (ours(TOKENS) - expected).abs().max().item() <= 1e-5


def test_yarn_keys_titan_core_does_not_compute_are_refused():
    for rope, key in (({"attention_factor": 1.2}, "attention_factor=1.2"), ({"truncate": False}, "truncate=False"),
                      ({"mscale_all_dim": 1.0}, "mscale_all_dim=1.0 without mscale")):
        with pytest.raises(ConfigError, match=f"config.json's YaRN sets {key}"):
            options_from_hf(hf_config(rope_parameters={**hf_config()["rope_parameters"], "mscale": None, **rope}))


def test_yarn_changes_the_table_where_it_should():
    """The fast-turning pairs keep their frequency, the slow ones are divided by the factor; mscale over
    mscale_all_dim scales the rotation's magnitude."""
    def angles(table):
        return torch.atan2(table[..., 1], table[..., 0])
    plain, yarn = rope_table(args(rope_scaling_factor=1.0)), rope_table(args(mscale=0.707))
    torch.testing.assert_close(angles(yarn)[:, 0], angles(plain)[:, 0])  # 1 rotation per 6 positions: kept
    assert angles(yarn)[1, -1].item() == pytest.approx(10000.0 ** (-6 / 8) / 4.0, rel=1e-5)  # the slowest: / 4
    assert 0 < angles(yarn)[1, 1] < angles(plain)[1, 1]  # on the ramp
    magnitude = (0.1 * 0.707 * math.log(4) + 1) / (0.1 * math.log(4) + 1)
    torch.testing.assert_close(yarn.norm(dim=-1), torch.full(yarn.shape[:2], magnitude))
    torch.testing.assert_close(plain.norm(dim=-1), torch.ones(plain.shape[:2]))


@pytest.mark.parametrize("override, field", [
    ("model.qk_rope_head_dim=7", "model.qk_rope_head_dim"),
    ("model.first_k_dense_replace=9", "model.first_k_dense_replace"),
    ("model.rope_scaling_factor=0.5", "model.rope_scaling_factor"),
    ("model.topk_group=5", "model.topk_group"),
])
def test_bad_options_are_refused_in_one_line(override, field):
    error = config_error("model=deepseek_v3_tiny", "tokenizer.path=bytes", override)
    assert error.field == field
