"""Llama 3.1 70B and 405B, built and initialized under the seeds' sharded plans in one process.

A fake process group stands in for the 256 or 512 ranks and fake tensors for the weights: the real tensor
parallel and FSDP plugins shard the meta model, and the core's per-shard init runs on this rank's shards,
so every placement and box of the real plan is exercised without allocating a byte of the weights.
"""

import resource

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_core.testing import init_weights
from titan_core import ParallelMesh
from titan_fsdp import plugin as fsdp
from titan_llama3.model import Transformer
from titan_llama3.plugin import describe, llama_args
from titan_tp import plugin as tp

CONF = __import__("pathlib").Path(__file__).resolve().parents[1] / "titan_llama3" / "conf" / "model"


@pytest.mark.slow
@pytest.mark.parametrize("name, dp_shard, tp_degree", [("70B", 32, 8), ("405B", 64, 8)])
def test_sharded_plan_builds_and_initializes_without_allocating(name, dp_shard, tp_degree):
    from torch._subclasses.fake_tensor import FakeTensorMode

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp_shard * tp_degree)
    try:
        description = describe(llama_args(OmegaConf.load(CONF / f"{name}.yaml"), vocab_size=128256, seq_len=8192))
        mesh = ParallelMesh({"dp_shard": dp_shard, "tp": tp_degree}, "cpu")
        with torch.device("meta"):
            model = Transformer(description.args)
        plan = type("Plan", (), {"model": description})()
        tp.apply_parallelism(model_parts=[model], mesh=mesh, plan=plan, plugin_config=OmegaConf.create(
            {"sequence_parallel": True, "loss_parallel": True, "async_tp": False}))
        fsdp.apply_parallelism(model_parts=[model], mesh=mesh, plan=plan, plugin_config=OmegaConf.create(
            {"param_dtype": "bfloat16", "reduce_dtype": "float32", "cpu_offload": False,
             "reshard_after_forward": "default", "prefetch": 0}))
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            init_weights(model, description, seed=0)
        grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 2**20
        total = sum(p.numel() for p in model.parameters())
        local = sum(p.to_local().numel() for p in model.parameters())
        assert all(isinstance(p, DTensor) for p in model.parameters())
        # The embedding and the norm with the output layer are units of their own, gathered only while they
        # run, not kept whole by the root unit for the step (4.2 GB in bf16 at 405B on every GPU).
        assert all(isinstance(m, FSDPModule) for m in (model.tok_embeddings, model.norm, model.output))
        assert model._get_fsdp_state()._fsdp_param_group is None, "the root unit still manages parameters"
        print(f"{name}: {total / 1e9:.1f}B parameters, {local / 1e6:.0f}M on this rank of {dp_shard * tp_degree}; "
              f"peak RSS grew {grown_gib:.2f} GiB")
        assert local <= total / (dp_shard * tp_degree) * 1.02  # a shard, not the whole (a few padded rows)
        assert grown_gib < 1.0  # this rank's fp32 shards alone would be 1.1 GB (70B) / 3.2 GB (405B)
    finally:
        dist.destroy_process_group()
