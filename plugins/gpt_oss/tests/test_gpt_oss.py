"""gpt-oss: published sizes, transformers' model made in the test imported with its logits and our export read back by
transformers (sinks, sliding windows, YaRN unrounded, biased clamped-SwiGLU experts stored transposed and
interleaved), the conformance kit, and the one-line refusals."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from titan_checkpoint.hf import export_hf, import_hf, load_hf_slices
from titan_core import ConfigError, MoE
from titan_core.testing import LOSS_TOL, PARAM_TOL, config_error, model_conformance
from titan_gpt_oss.model import GptOss
from titan_gpt_oss.plugin import describe, gpt_oss_args, options_from_hf

CONF = Path(__file__).resolve().parents[1] / "titan_gpt_oss/conf/model"
TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))


def args(name="gpt_oss_tiny", vocab_size=300, seq_len=32, **overrides):
    return gpt_oss_args({**OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml")), **overrides},
                        vocab_size=vocab_size, seq_len=seq_len)


@pytest.mark.parametrize("preset, total, active", [
    ("gpt_oss_120b", 116.83, 5.13),  # openai's model card: 116.83B total, 5.13B active
    ("gpt_oss_20b", 20.91, 3.61),  # 20.91B, 3.61B
])
def test_published_sizes(preset, total, active):
    """The model card's active count leaves out the input embedding (a lookup) and keeps the output layer."""
    big = args(preset, vocab_size=201088, seq_len=4096)
    with torch.device("meta"):
        model = GptOss(big)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    met = params - experts * (big.num_experts - big.num_experts_per_tok) / big.num_experts
    met -= model.embed_tokens.weight.numel()
    assert (round(params / 1e9, 2), round(met / 1e9, 2)) == (total, active)


def hf_config(**overrides) -> dict:
    """transformers' GptOssConfig of the tiny preset (YaRN unrounded at 4 x 16 positions, windows of 8)."""
    a = args()
    config = dict(vocab_size=300, hidden_size=a.hidden_size, intermediate_size=a.moe_intermediate_size,
                  num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
                  num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, num_local_experts=a.num_experts,
                  num_experts_per_tok=a.num_experts_per_tok, sliding_window=a.sliding_window,
                  max_position_embeddings=64, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
    return config | overrides


def transformers_model(**overrides):
    """transformers' gpt-oss with random weights: every bias, sink and norm moved off its start, experts' values
    large enough that the clamp at swiglu_limit bites."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**hf_config(**overrides))
    config._attn_implementation = "eager"
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name:
                tensor.uniform_(0.5, 1.5)
            elif name.endswith(("sinks", "bias")) or "router" in name:
                tensor.normal_(0, 1)
            elif "experts" in name:
                tensor.normal_(0, 0.5)
    return model.eval()


def test_a_transformers_folder_imports_with_its_logits_and_the_export_reads_back(tmp_path):
    hf = transformers_model()
    hf.save_pretrained(tmp_path / "hf")
    options, _ = import_hf(tmp_path / "hf", describe(args()).hf)
    ours = GptOss(gpt_oss_args(options, vocab_size=300, seq_len=32))
    assert (ours.args.rope_scaling_factor, ours.args.layer_types) == (4.0, ("sliding_attention", "full_attention") * 2)
    for tensor in ours.state_dict().values():
        tensor.zero_()
    read = load_hf_slices([ours], tmp_path / "hf", describe(ours.args).hf)
    assert read == sum(t.nbytes for t in ours.state_dict().values())
    with torch.no_grad():
        expected = hf(TOKENS).logits
        diff = (ours(TOKENS) - expected).abs().max().item()
        # The clamp bites on these weights: without it the logits move far past the bound.
        ours.layers["0"].mlp.experts.limit = float("inf")
        unclamped = (ours(TOKENS) - expected).abs().max().item()
        ours.layers["0"].mlp.experts.limit = ours.args.swiglu_limit
    print(f"gpt-oss: max logit diff against transformers {diff:.2e} (logits' scale {expected.abs().max():.1f}); "
          f"without the clamp in block 0: {unclamped:.2e}")
    assert diff <= 1e-5 < unclamped

    export_hf(ours.state_dict(), describe(ours.args).hf, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["max_position_embeddings"] == 64  # the source's context, not the training length (32)
    assert (config["num_local_experts"], config["rope_parameters"]["truncate"]) == (8, False)
    transformers = pytest.importorskip("transformers")
    again = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        assert (again(TOKENS).logits - expected).abs().max().item() <= 1e-5


def expert_by_expert(experts, tokens, counts):
    """The for-loop reference (TorchTitan's grouped-experts test compares its fused kernel with one): each expert's
    biased, clamped feed-forward on its own tokens, written from transformers' formula."""
    outputs = []
    for expert, rows in enumerate(tokens.split(counts.tolist())):
        gate, up = (rows @ experts.gate_up_proj[expert].T + experts.gate_up_proj_bias[expert]).chunk(2, dim=-1)
        gate, up = gate.clamp(max=experts.limit), up.clamp(-experts.limit, experts.limit)
        hidden = (up + 1) * gate * torch.sigmoid(gate * experts.alpha)
        outputs.append(hidden @ experts.down_proj[expert].T + experts.down_proj_bias[expert])
    return torch.cat(outputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_three_expert_kernels_match_an_expert_by_expert_loop(dtype):
    """torch._grouped_mm (GPUs in bf16; this CPU runs it in bf16 only), the padded batch (eager) and the gathered
    weights (compiled) with gpt-oss's biases and clamp, forward and gradients, against the loop in fp32 on the same
    weights. Weights large enough that the clamp bites; bf16 is off by 0.4% of the outputs' scale, a bias taken
    from the wrong expert by 17%."""
    torch.manual_seed(0)
    experts = MoE(args()).experts.to(dtype)
    for param in experts.parameters():
        param.data.normal_(0, 0.5)
    reference = MoE(args()).experts
    reference.load_state_dict({name: value.float() for name, value in experts.state_dict().items()})
    tokens = torch.randn(20, 64, dtype=dtype)
    counts = torch.tensor([5, 0, 3, 4, 0, 6, 1, 1])
    expected = expert_by_expert(reference, tokens.float(), counts)
    grad = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, list(reference.parameters()), grad)
    bound = 1e-2 if dtype == torch.bfloat16 else 1e-5  # of each tensor's largest value

    def assert_near(ours, theirs):
        torch.testing.assert_close(ours.float(), theirs, rtol=0, atol=bound * theirs.abs().max().item())

    # The module's own call is eager on a CPU: the padded batch.
    for kernel in [experts, experts._gathered] + ([experts._grouped] if dtype == torch.bfloat16 else []):
        out = kernel(tokens, counts)
        assert_near(out, expected)
        for ours, theirs in zip(torch.autograd.grad(out, list(experts.parameters()), grad.to(dtype)), expected_grads):
            assert_near(ours, theirs)


def test_yarns_optional_keys_default_as_transformers_reads_them(tmp_path):
    """Betas left out (or 0) are transformers' 32 and 1; mscale, mscale_all_dim or attention_factor, which would
    change the rotation's magnitude in transformers, are refused by name rather than ignored."""
    rope = {key: value for key, value in hf_config()["rope_parameters"].items() if not key.startswith("beta")}
    hf = transformers_model(rope_parameters={**rope, "beta_fast": 0})
    hf.save_pretrained(tmp_path / "hf")
    options, _ = import_hf(tmp_path / "hf", describe(args()).hf)
    assert (options["beta_fast"], options["beta_slow"]) == (32.0, 1.0)
    ours = GptOss(gpt_oss_args(options, vocab_size=300, seq_len=32))
    load_hf_slices([ours], tmp_path / "hf", describe(ours.args).hf)
    with torch.no_grad():
        assert (ours(TOKENS) - hf(TOKENS).logits).abs().max().item() <= 1e-5
    for key, value in (("mscale", 1.0), ("mscale_all_dim", 0.5), ("attention_factor", 1.1)):
        with pytest.raises(ConfigError, match=f"config.json's YaRN sets {key}={value}, which titan-core's gpt-oss"):
            options_from_hf({**hf_config(), "rope_parameters": {**rope, key: value}})


def test_a_quantized_release_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        options_from_hf({**hf_config(), "model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}})
    assert error.value.field == "model.path" and "quantized (mxfp4)" in str(error.value)
    with pytest.raises(ConfigError) as error:  # a rounded YaRN ramp is another model
        options_from_hf({**hf_config(), "rope_parameters": {**hf_config()["rope_parameters"], "truncate": True}})
    assert "truncate=True" in str(error.value)


@pytest.mark.parametrize("override, field", [
    ("model.layer_types=[full_attention]", "model.layer_types"),
    ("model.sliding_window=0", "model.sliding_window"),
    ("model.expert_activation=gelu", "model.expert_activation"),
    ("model.num_key_value_heads=3", "model.num_key_value_heads"),
])
def test_bad_options_are_refused_in_one_line(override, field):
    error = config_error("model=gpt_oss_tiny", "tokenizer.path=bytes", override)
    assert error.field == field


# Each case trains the tiny model 5 steps and compares every loss and the final weights with one process. Measured
# too, by hand (docs/models/gpt-oss.md): fsdp 2, cp 2 without documents (the same gathered path as below), pp GPipe,
# ac full and selective, compile, float8, checkpoint fsdp 2 -> one.
test_gpt_oss_conformance = model_conformance(["model=gpt_oss_tiny"], cases=["pp2-interleaved1f1b"])


@pytest.mark.slow
@pytest.mark.parametrize("stack, shared", [
    (("+plugins=[fsdp,ep]", "plugins.fsdp.degree=2", "plugins.ep.degree=2"), ()),
    (("+plugins=[fsdp,tp]", "plugins.fsdp.degree=1", "plugins.tp.degree=2"), ()),
    (("+plugins=[cp]", "plugins.cp.degree=2"), ("training.attention_mask=block_causal",)),
], ids=["fsdp2-ep2", "tp2-sp-lp", "cp2-block-causal"])
def test_expert_tensor_and_masked_context_parallel_train_like_one_process(stack, shared, titan_parity):
    """ep moves the biased experts; tp splits the heads with their sinks (TensorParallelLayout.head_parameters) and
    the experts' tokens; cp gathers the keys and masks documents and windows, each query's sink joining its softmax
    once. ``shared``: options the reference takes too."""
    report = titan_parity(list(stack), reference_overrides=("model=gpt_oss_tiny", *shared))
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report


def test_peft_adapters_on_its_experts_are_refused_before_launch():
    """PEFT's adapters on experts follow a (experts, out, in) file tensor; gpt-oss's is transposed and interleaved.
    Without experts in the targets, a later refusal (mlp names no dense linear here) shows this one is about them."""
    error = config_error("model=gpt_oss_tiny", "tokenizer.path=bytes", "+plugins=[lora]",
                         "plugins.lora.targets=[attention,experts]")
    assert error.field == "plugins.lora.export" and "gate_up_proj transposed or interleaved" in str(error)
    other = config_error("model=gpt_oss_tiny", "tokenizer.path=bytes", "+plugins=[lora]", "plugins.lora.targets=[mlp]")
    assert other.field == "plugins.lora.targets"
