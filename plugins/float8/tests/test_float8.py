"""Float8 on CPU: which Linear layers are converted, real training against fp32, FSDP's float8
all-gather with the scale precompute, MXFP8 emulated, and what is refused before launch."""

import logging
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from titan_core import TORCHAO_LOGGERS, ConfigError, library_logs_at_debug
from titan_core.testing import init_weights
from titan_llama3.model import LlamaArgs, Transformer
from titan_llama3.plugin import describe
from titan_core.testing import TINY, run_job
from titan_float8 import measured, plugin

TINY_ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264, multiple_of=32, max_seq_len=32)
BLOCK_LINEARS = {"attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"}
# float8 (e4m3 forward, e5m2 gradients) on the tiny model, max loss diff vs fp32 over 5 steps, measured:
# 1.9e-4 (tensorwise), 3.4e-4 (tensorwise + FSDP float8 all-gather), 1.0e-4 (MXFP8 emulated); params
# after 5 Adam steps 5.8e-3. Bounds at ~5x what was measured; a diff of 0 would mean nothing was converted.
FLOAT8_LOSS_TOL, MXFP8_LOSS_TOL, PARAM_TOL = 2e-3, 2e-3, 3e-2


def _convert(recipe="tensorwise", filter_fqns=(), all_gather=False, **args):
    with torch.device("meta"):
        model = Transformer(LlamaArgs(**{**TINY_ARGS, **args}))
    options = OmegaConf.create({"recipe": recipe, "filter_fqns": list(filter_fqns),
                                "fsdp_float8_all_gather": all_gather})
    plugin.convert_modules(model, OmegaConf.create({"launch": {"device": "cpu"}}), options,
                           type("Plan", (), {"model": describe(model.args)})())
    return model


def _converted(model) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    return {name for name, m in model.named_modules()
            if isinstance(m, Float8Linear) or isinstance(getattr(m, "weight", None), MXFP8TrainingWeightWrapperTensor)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8_emulated_rceil"])
def test_every_block_linear_but_not_the_output_layer(recipe):
    # TINY: dim 64, kv 2 x head 16 = 32, SwiGLU hidden 192: all multiples of 16 and of 32.
    model = _convert(recipe)
    assert _converted(model) == {f"layers.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS}


def test_user_filter_and_untileable_dimensions_stay_high_precision():
    model = _convert(filter_fqns=["attention.wk"], multiple_of=20)  # SwiGLU hidden 180: not a multiple of 16
    assert _converted(model) == {f"layers.{i}.attention.{n}" for i in range(2) for n in ("wq", "wv", "wo")}
    assert plugin.converts(nn.Linear(64, 48, device="meta"), "layers.0.x", [], 16)
    assert not plugin.converts(nn.Linear(64, 48, device="meta"), "layers.0.x", [], 32)  # MXFP8 blocks of 32


def test_a_skipped_fragment_names_whole_parts_of_a_linears_name():
    """A router's "mlp.gate" skips the router, not the dense feed-forward's "mlp.gate_proj" beside it (a substring
    match left DeepSeek-V3's and Qwen3-MoE's dense blocks' gates in bf16); fragments of several parts still match."""
    skipped = ("mlp.gate", "attention.wk")
    assert not plugin.convertible("layers.1.mlp.gate", 64, 16, skipped, 16)
    assert plugin.convertible("layers.0.mlp.gate_proj", 64, 128, skipped, 16)
    assert not plugin.convertible("layers.0.attention.wk", 64, 32, skipped, 16)
    assert plugin.convertible("layers.0.attention.wkv", 64, 32, skipped, 16)


# Tensorwise float8 alone is a case of every model's conformance run (titan_core.testing.model_conformance).


def test_mxfp8_emulated_trains_close_to_fp32(titan_reference, tmp_path):
    # Losses only: MXFP8 weights are torchao tensor subclasses, which torch.load(weights_only=True) of
    # the harness's final-weights file refuses.
    result = run_job([*TINY, "testing.save_final_weights=false", "+plugins=[float8]",
                      "plugins.float8.recipe=mxfp8_emulated_rceil"], tmp_path / "run")
    diff = max(abs(a - b) for a, b in zip(result.losses, titan_reference().losses, strict=True))
    print(f"mxfp8_emulated_rceil: max loss diff vs fp32 {diff:.2e}")
    assert 0 < diff <= MXFP8_LOSS_TOL
    output = result.stdout + result.stderr
    assert "torchao" not in output and "register_constant" not in output, output  # no library noise


def test_torchao_start_up_noise_is_kept_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="titan_core")
    with library_logs_at_debug(*TORCHAO_LOGGERS):
        logging.getLogger("torchao.kernel.intmm").warning("Detected no triton")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("titan_core", logging.DEBUG, "torchao.kernel.intmm: Detected no triton")]
    logging.getLogger("torchao.kernel.intmm").warning("after")  # outside, torchao logs as it always did
    assert caplog.records[-1].name == "torchao.kernel.intmm"


@pytest.mark.slow
def test_fsdp_float8_all_gather(titan_parity):
    report = titan_parity(["+plugins=[float8,fsdp]", "plugins.fsdp.degree=2", "plugins.float8.fsdp_float8_all_gather=true"])
    assert 0 < report.max_loss_diff <= FLOAT8_LOSS_TOL
    assert report.max_param_diff <= PARAM_TOL


def test_scales_are_precomputed_after_the_optimizer_step():
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _convert(all_gather=True)
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        init_weights(model, describe(model.args), 0)
        weight = model.layers["0"].attention.wq.weight._local_tensor
        assert type(weight).__name__ == "WeightWithDynamicFloat8CastTensor" and weight._precomputed_scale is None
        model(torch.zeros(2, 32, dtype=torch.long)).sum().backward()
        plugin.after_optimizer_step(model_parts=[model], plugin_config=OmegaConf.create({"fsdp_float8_all_gather": True}))
        assert weight._precomputed_scale is not None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("overrides, message", [
    (["plugins.float8.recipe=fp4"], "plugins.float8.recipe: unknown recipe 'fp4'"),
    (["plugins.float8.recipe=mxfp8_rceil"], "plugins.float8.recipe: mxfp8_rceil needs a CUDA device with triton"),
    (["plugins.float8.fsdp_float8_all_gather=true"], "no enabled plugin shards parameters over data-parallel ranks"),
    (["+plugins=[fsdp]", "plugins.fsdp.degree=2", "plugins.float8.recipe=rowwise",
      "plugins.float8.fsdp_float8_all_gather=true"], "fsdp_float8_all_gather: needs recipe=tensorwise, not rowwise"),
])
def test_refused_before_launch(tmp_path, overrides, message):
    result = run_job([*TINY, "+plugins=[float8]", *overrides], tmp_path / "run", expect_success=False)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


MXFP8_ON_HOPPER = ("plugins.float8.recipe: mxfp8_rceil needs an NVIDIA Blackwell card (compute capability 10.0 or "
                   "later) for MXFP8's block-scaled matmuls, and {} is not one; fix: plan for b200 or gb200{}")


@pytest.mark.parametrize("hardware, recipe, refusal", [
    ("h100", "mxfp8_rceil", MXFP8_ON_HOPPER.format("h100_sxm", ", or set plugins.float8.recipe=tensorwise")),
    ("a100", "mxfp8_rceil", MXFP8_ON_HOPPER.format("a100", "")),
    ("b200", "mxfp8_emulated_rceil", "plugins.float8.recipe: mxfp8_emulated_rceil emulates MXFP8 in high precision "
     "(a recipe for CPU tests), which the planner does not price on b200; fix: plan mxfp8_rceil on b200 or gb200, or "
     "tensorwise"),
    ("b200", "mxfp8_rceil", None),
], ids=["h100", "a100", "emulated", "b200"])
def test_the_planner_prices_mxfp8_on_blackwell_only(hardware, recipe, refusal):
    """MXFP8's block-scaled matmuls are Blackwell's: a plan for an earlier card is refused in one line, naming the
    option, the card and the fix (for an A100, which lacks float8's matmuls too, no float8 recipe); the emulated
    recipe, a CPU test's, is priced on no GPU."""
    planned = subprocess.run([sys.executable, "-m", "titan_core.planner", "--hardware", hardware, "model=debug",
                              "training.seq_len=128", "training.global_batch_size=2", "launch.world_size=1",
                              "+plugins=[float8]", f"plugins.float8.recipe={recipe}"],
                             capture_output=True, text=True, timeout=300)
    if refusal is None:
        assert planned.returncode == 0, planned.stderr
        assert "casts to float8 (mxfp8_rceil)" in planned.stdout
    else:
        assert planned.returncode == 2
        assert planned.stderr.strip().splitlines() == [f"titan-core: error: {refusal}"]


@pytest.mark.parametrize("capability, recipe, refusal", [
    ((9, 0), "mxfp8_rceil", "this machine's has 9.0; fix: run it on a B200 or GB200, or set plugins.float8.recipe="
                            "tensorwise"),
    ((8, 0), "mxfp8_rceil_wgrad_with_hp", "this machine's has 8.0; fix: run it on a B200 or GB200"),
    ((9, 0), "mxfp8_emulated_rceil", None),  # computed in high precision: it runs on any device
    ((10, 0), "mxfp8_emulated_rceil", None),
], ids=["hopper", "ampere", "emulated", "blackwell"])
def test_mxfp8_on_a_gpu_before_blackwell_is_refused_before_launch(monkeypatch, capability, recipe, refusal):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    config = OmegaConf.create({"launch": {"device": "cuda"}})
    options = OmegaConf.create({"recipe": recipe, "filter_fqns": [], "fsdp_float8_all_gather": False})
    if refusal is None:
        plugin.validate(config=config, plugin_config=options, plan=None)
        return
    with pytest.raises(ConfigError) as refused:
        plugin.validate(config=config, plugin_config=options, plan=None)
    line = str(refused.value)
    assert line.startswith(f"plugins.float8.recipe: {recipe} needs an NVIDIA Blackwell GPU") and "\n" not in line
    assert line.endswith(refusal)


def test_the_measured_table_reads_back_its_shapes_and_interpolates_in_their_logarithms():
    """A measured shape reads back its cell; a shape halfway (geometrically) between two reads their mean; shapes
    beyond the table read its edge."""
    table = measured.H100_ROWWISE
    assert measured.speedup(table, 32768, 4096, 1024) == pytest.approx(0.59)
    assert measured.speedup(table, 8192, 16384, 2048) == pytest.approx(0.82)
    assert measured.speedup(table, 8192, 4096, 2 ** 12.5) == pytest.approx((1.00 + 1.13) / 2)
    assert measured.speedup(table, 2 ** 13.5, 2 ** 12.5, 4096) == pytest.approx((1.00 + 1.05 + 1.02 + 1.08) / 4)
    assert measured.speedup(table, 131072, 4096, 128) == pytest.approx(0.59)

