"""Tensor parallel trains exactly like one process, its plan shards what it says, bad settings fail before launch."""

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_core import ConfigError
from titan_core import ParallelMesh
from titan_core.testing import init_weights
from titan_llama3.model import LlamaArgs, Transformer
from titan_llama3.plugin import describe
from titan_core.testing import TINY, error_line, run_job
from titan_tp import plugin

LOSS_TOL = 1e-5
# An Adam step moves each weight by about lr (1e-3 in TINY) whatever its gradient's size, so a gradient of the
# wrong sign or scale shows up as ~1e-3 in the weights. 1e-4 is 10x below that and 30x above the measured
# ulp-level noise (<= 3e-6 over all combinations).
PARAM_TOL = 1e-4
ON_CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of AsyncTP off CUDA")


@pytest.mark.slow
# tp 2 with sequence and loss parallel is a case of every model's conformance run.
@pytest.mark.parametrize("overrides", [
    ["+plugins=[tp]", "plugins.tp.degree=2", "plugins.tp.sequence_parallel=false"],
    ["+plugins=[tp]", "plugins.tp.degree=2", "plugins.tp.loss_parallel=false"],
    ["+plugins=[fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2"],
], ids=["tp2-no-sp", "tp2-no-loss-parallel", "fsdp2xtp2"])
def test_parity(titan_parity, overrides):
    report = titan_parity(overrides)
    assert report.max_loss_diff <= LOSS_TOL, report
    assert report.max_param_diff <= PARAM_TOL, report
    assert not report.stderr, report.stderr  # torch's advice on FSDP2 views and 2-D norms stays off the console


@pytest.fixture
def one_rank_tp_mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ParallelMesh({"tp": 1}, "cpu")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sp", [True, False])
def test_plan_shards_heads_hidden_units_and_vocabulary(one_rank_tp_mesh, sp):
    with torch.device("meta"):
        model = Transformer(LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32))
    options = OmegaConf.create({"sequence_parallel": sp, "loss_parallel": True, "async_tp": False})
    plan = type("Plan", (), {"model": describe(model.args)})()
    plugin.apply_parallelism(model_parts=[model], mesh=one_rank_tp_mesh, plugin_config=options, plan=plan)

    expected = {"wq": Shard(0), "wk": Shard(0), "wv": Shard(0), "w1": Shard(0), "w3": Shard(0),
                "wo": Shard(1), "w2": Shard(1), "tok_embeddings": Shard(0), "output": Shard(0), "norm": Replicate()}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is a plain tensor"  # clipping and FSDP refuse a mix
        key = next(k for k in expected if k in name)
        assert param.placements == (expected[key],), name
    model.to_empty(device="cpu")
    init_weights(model, describe(model.args), 0)
    tokens = torch.randint(0, 64, (2, 8))
    assert isinstance(model(tokens), DTensor)  # loss parallel keeps the vocabulary-sharded logits


def _config(degree=2, n_heads=4, n_kv_heads=2, seq_len=32, cp=1, **tp):
    options = {"degree": degree, "sequence_parallel": True, "loss_parallel": True, "async_tp": False, **tp}
    model = describe(LlamaArgs(dim=16 * n_heads, n_heads=n_heads, n_kv_heads=n_kv_heads))
    return (OmegaConf.create({"training": {"seq_len": seq_len}, "launch": {"backend": None, "device": None},
                              "plugins": {"tp": options}}),
            type("Plan", (), {"degree": lambda self, dim: {"tp": degree, "cp": cp}.get(dim, 1), "model": model})())


@pytest.mark.parametrize("settings, message", [
    (dict(degree=3), "model.n_heads: 4 does not split over tp degree 3"),
    (dict(n_kv_heads=1), "model.n_kv_heads: 1 does not split over tp degree 2"),
    (dict(n_kv_heads=None, n_heads=6, degree=4), "model.n_heads: 6 does not split over tp degree 4"),
    (dict(seq_len=30, cp=2), "training.seq_len: sequence parallel splits 15 tokens"),
    pytest.param(dict(async_tp=True), "plugins.tp.async_tp: AsyncTP needs CUDA GPUs with NCCL symmetric memory",
                 marks=ON_CPU_ONLY),
])
def test_validate_refuses(settings, message):
    config, plan = _config(**settings)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        plugin.validate(config=config, plugin_config=config.plugins.tp, plan=plan)


def test_async_tp_requires_compile():
    config, _ = _config(async_tp=True)
    assert plugin.declare(plugin_config=config.plugins.tp).requires == {"compile"}
    assert not plugin.declare(plugin_config=_config()[0].plugins.tp).requires


@pytest.mark.parametrize("overrides, message", [
    (["+plugins=[tp]", "plugins.tp.degree=2", "model.n_kv_heads=1"],
     "model.n_kv_heads: 1 does not split over tp degree 2"),
    (["+plugins=[tp]", "plugins.tp.async_tp=true"], "plugins.tp: requires 'compile', which no enabled plugin provides"),
    pytest.param(["+plugins=[tp,compile]", "plugins.tp.async_tp=true"],
                 "plugins.tp.async_tp: AsyncTP needs CUDA GPUs with NCCL symmetric memory, which this job does not "
                 "have; fix: set plugins.tp.async_tp=false", marks=ON_CPU_ONLY),
], ids=["kv-heads", "async-tp-without-compile", "async-tp-on-cpu"])
def test_launcher_refuses_before_any_worker_starts(tmp_path, overrides, message):
    result = run_job([*TINY, *overrides], tmp_path, expect_success=False)
    assert message in error_line(result)
    assert not (tmp_path / "logs").exists()
