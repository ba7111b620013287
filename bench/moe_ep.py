"""A MoE model with and without expert parallel at equal world size: step time, memory, all-to-all share.

    flock /tmp/titan-cpu.lock python bench/moe_ep.py [--model qwen3_moe|deepseek_v3] [--world 2] [--steps 12]

1. Two training jobs of one MoE model on ``world`` CPU ranks: FSDP over all of them (every rank gathers
   every expert in turn), then FSDP with ep = world (each rank keeps 1/world of the experts whole, the
   tokens travel to them by all-to-all). Step time is the median after the first step; memory is rank 0's
   peak resident set (the interpreter and torch take most of it on a CPU), and the parameters a rank holds
   come from its log.
2. The all-to-all share: one MoE layer of the same size under expert parallel, forward and backward,
   profiled on every rank; the share is the time of the all-to-all collectives (counts, tokens out, tokens
   back, and the two in backward) over the layer's whole time on rank 0.
Not a test and not a GPU figure: compare ratios from one run only (the machine is shared).
"""

import argparse
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_core.testing import run_job

EXPERTS = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512, "moe_intermediate_size": 256,
           "num_experts": 32, "num_experts_per_tok": 4}
# Each model: its preset and the options (beside EXPERTS) that make every block a MoE block of the same size.
MODELS = {"qwen3_moe": ("qwen3_moe_tiny", {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                                           "mlp_only_layers": "[]"}),
          # DeepSeek-V3's routing (sigmoid, 4 groups of 8 choosing within the best 2, a shared expert, the bias).
          "deepseek_v3": ("deepseek_v3_debug", {"first_k_dense_replace": 0})}
SEQ, BATCH = 256, 8


def model_options(model: str) -> dict:
    return {**EXPERTS, **MODELS[model][1]}


def job(model: str, plugins: list[str], world: int, steps: int, run_dir: Path) -> dict:
    result = run_job([f"model={MODELS[model][0]}", *(f"model.{k}={v}" for k, v in model_options(model).items()),
                      "tokenizer.path=bytes",
                      f"training.seq_len={SEQ}", f"training.global_batch_size={BATCH}", f"training.steps={steps}",
                      "metrics.log_every=1", "metrics.tensorboard=false", "metrics.peak_tflops=1",
                      f"+plugins=[{','.join(plugins)}]", *(f"plugins.{p}.degree={world}" for p in plugins)],
                     run_dir)
    held = re.search(r"([\d.]+)M parameters held locally", (run_dir / "logs" / "rank0.log").read_text())
    return {"step_s": statistics.median(m["step_time_s"] for m in result.metrics[1:]),
            "memory_gib": max(m["memory_gib"] for m in result.metrics), "params_m": float(held.group(1))}


def _layer_worker(rank: int, world: int, port: int, model: str, shares) -> None:
    from torch.profiler import ProfilerActivity, profile

    from titan_ep.plugin import shard_by_expert
    from titan_core.mesh import ParallelMesh
    from titan_core import MoE, model_description
    from titan_core.testing import compose

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = compose(f"model={MODELS[model][0]}", *(f"model.{k}={v}" for k, v in model_options(model).items()),
                     "tokenizer.path=bytes", f"training.seq_len={SEQ}")
    args = model_description(config, 256).args
    torch.manual_seed(0)
    moe = MoE(args)
    for param in moe.parameters():
        param.data.normal_(0, 0.02)
    mesh = ParallelMesh({"dp_shard": world}, "cpu", {"ep": (world, ("dp_shard",))})
    shard_by_expert(moe.experts, mesh.submesh("ep"))
    x = torch.randn(BATCH // world, SEQ, args.hidden_size, requires_grad=True)
    for _ in range(2):  # warm-up
        moe(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(5):
            moe(x).sum().backward()
        wall_us = (time.perf_counter() - start) * 1e6
    # gloo's collectives run on the calling thread, so their CPU time is the time the layer waits on them.
    collective = sum(e.self_cpu_time_total for e in prof.key_averages() if re.search(r"all_?to_?all", e.key, re.I))
    shares[rank] = collective / wall_us
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="qwen3_moe")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fsdp = job(args.model, ["fsdp"], args.world, args.steps, Path(tmp) / "fsdp")
        ep = job(args.model, ["fsdp", "ep"], args.world, args.steps, Path(tmp) / "ep")
    shares = mp.Manager().dict()
    mp.spawn(_layer_worker, args=(args.world, 29517, args.model, shares), nprocs=args.world)
    print(f"{args.model} {EXPERTS['num_experts']} experts, top {EXPERTS['num_experts_per_tok']}, hidden "
          f"{EXPERTS['hidden_size']}, {args.world} CPU ranks, {SEQ}x{BATCH} tokens per step")
    for name, r in (("fsdp", fsdp), ("fsdp + ep", ep)):
        print(f"  {name:<10} step {r['step_s'] * 1e3:7.1f} ms  peak memory {r['memory_gib']:.3f} GiB  "
              f"parameters held {r['params_m']:.3g}M")
    print(f"  ep / fsdp: step time {ep['step_s'] / fsdp['step_s']:.2f}x, peak memory "
          f"{ep['memory_gib'] / fsdp['memory_gib']:.2f}x, parameters held {ep['params_m'] / fsdp['params_m']:.2f}x")
    print(f"  all-to-all share of an expert-parallel MoE layer's forward + backward: "
          f"{', '.join(f'rank {r} {shares[r]:.1%}' for r in sorted(shares))}")


if __name__ == "__main__":
    main()
