"""The planner against torch's memory tracker on plans no test was written around: stacks drawn at random.

Each draw is a stack of the first-party plugins and options (fsdp and its resharding and reduction policies, tp
with and without sequence and loss parallel, cp, ep beside a model with experts, every checkpointing mode,
chunked_loss, float8, LoRA or Muon, AdamW's implementations and bfloat16 states, accumulation), on one of the
five tiny model families, at 16, 64 or 256 tokens (at 16 the optimizer's step often makes the peak), with Llama
3's vocabulary or one of 16,384 entries (where the loss and the embeddings weigh as at 8B), masked by document or
not. Rank 0 of the plan runs one real step of the worker's own code on a fake process group
(tests/tracked_rank.py, as the tracker tests run it) and the prediction, at the expert load the step measured, is
printed beside it; a stack the job checks refuse is counted apart. Run: python bench/planner_vs_tracker.py
[DRAWS] [SEED] (40 draws: about 6 minutes on this machine).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan_core.errors import ConfigError
from titan_core.planner.costs import planned_job
from titan_core.planner.hardware import Hardware
from titan_core.plugins import Registry

_spec = importlib.util.spec_from_file_location("tracked_rank", Path(__file__).parents[1] / "tests" / "tracked_rank.py")
tracked_rank = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tracked_rank)

CPU = Hardware("cpu-test", "", bf16_tflops=0.1, memory_gib=16.0, device_type="cpu", achievable=1.0)
MODELS = ("tiny", "tiny", "qwen3_tiny", "qwen3_moe_tiny", "deepseek_v3_tiny", "gpt_oss_tiny")
WITH_EXPERTS = ("qwen3_moe_tiny", "deepseek_v3_tiny", "gpt_oss_tiny")


def draw(rng: random.Random) -> list[str]:
    """One stack's overrides."""
    model = rng.choice(MODELS)
    overrides = [f"model={model}", f"training.seq_len={rng.choice([16, 64, 256])}"]
    if rng.random() < 0.5:
        overrides.append("model.vocab_size=16384")
    if rng.random() < 0.2:
        overrides.append("training.attention_mask=block_causal")
    plugins, world = [], 1
    if rng.random() < 0.6:
        degree = rng.choice([2, 4])
        plugins.append("fsdp")
        overrides.append(f"plugins.fsdp.degree={degree}")
        world *= degree
        if rng.random() < 0.3:
            overrides.append("plugins.fsdp.reduce_gradients=last_micro_batch")
        if rng.random() < 0.3:
            overrides.append(f"plugins.fsdp.reshard_after_forward={rng.choice(['always', 'never'])}")
        if rng.random() < 0.3:
            overrides.append("plugins.fsdp.param_dtype=bfloat16")
    if rng.random() < 0.5 and world <= 2:
        plugins.append("tp")
        overrides.append("plugins.tp.degree=2")
        world *= 2
        for option in ("sequence_parallel", "loss_parallel"):
            if rng.random() < 0.3:
                overrides.append(f"plugins.tp.{option}=false")
    if rng.random() < 0.3 and world <= 2 and model not in WITH_EXPERTS:
        plugins.append("cp")
        overrides.append("plugins.cp.degree=2")
        world *= 2
    if model in WITH_EXPERTS and world >= 2 and rng.random() < 0.5:
        plugins.append("ep")
        overrides.append("plugins.ep.degree=2")
    if rng.random() < 0.5:
        mode = rng.choice(["full", "selective_op", "selective_layer"])
        plugins.append("ac")
        overrides.append(f"plugins.ac.mode={mode}")
        if mode == "selective_op" and rng.random() < 0.5:
            overrides.append("plugins.ac.matmuls=every_other")
    if rng.random() < 0.25:
        plugins.append("chunked_loss")
        overrides.append("plugins.chunked_loss.chunk_tokens=128")
    if rng.random() < 0.2 and model not in WITH_EXPERTS:
        plugins.append("float8")
    choice = rng.random()
    if choice < 0.15:
        plugins.append("lora")
    elif choice < 0.3:
        plugins.append("muon")
    elif choice < 0.5:
        overrides.append(rng.choice(["optimizer.implementation=for_loop", "optimizer.implementation=fused",
                                     "optimizer.state_dtype=bfloat16"]))
    if plugins:
        overrides.append(f"+plugins=[{','.join(plugins)}]")
    if rng.random() < 0.4:
        overrides.append(f"training.grad_accum_steps={rng.choice([2, 4])}")
    batch = 8 * (4 if "training.grad_accum_steps=4" in overrides else 1)
    return [*overrides, f"training.global_batch_size={batch}"]


def tracked_error(overrides: list[str]) -> float:
    """Rank 0's prediction against its tracked step, as predicted / tracked - 1; the job composed and checked as
    ``python -m titan_core.run`` does (ConfigError)."""
    plan, result = planned_job(["tokenizer.path=bytes", "launch.device=cpu", *overrides], CPU)
    config = result.config
    registry = Registry(config)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        measured = tracked_rank.tracked_step(config, registry, plan)
    finally:
        dist.destroy_process_group()
    rank = dataclasses.replace(result.each_rank()[0], expert_load=max(1.0, measured["expert_load"]),
                               expert_load_peak=max(1.0, measured["expert_load_peak"]))
    return sum(rank.memory().values()) / measured["Total"] - 1


def main(draws: int = 40, seed: int = 1) -> None:
    start, rng, errors, refused = time.perf_counter(), random.Random(seed), [], 0
    print("| predicted / tracked - 1 | stack |\n|---:|---|")
    for _ in range(draws):
        overrides = draw(rng)
        try:
            error = tracked_error(overrides)
        except ConfigError:
            refused += 1
            continue
        except RuntimeError as failure:  # torch's module tracker hooks every input: a frozen model's refuse
            print(f"| not tracked ({str(failure).splitlines()[0]}) | {' '.join(overrides)} |", flush=True)
            continue
        errors.append(error)
        print(f"| {error:+.1%} | {' '.join(overrides)} |", flush=True)
    worst = max(errors, key=abs)
    within = sum(abs(e) <= 0.05 for e in errors)
    print(f"\n{len(errors)} stacks tracked ({refused} refused before launch): mean |error| "
          f"{sum(map(abs, errors)) / len(errors):.1%}, worst {worst:+.1%}, {within} within 5%")
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
