"""The planner against TorchTitan's published Llama 3.1 runs (benchmarks/llama3_h100_202412_torchtitan.md), and
against published runs of Llama 3 8B and 70B on A100, H100, H200, MI300X and B200, and of Qwen3 30B-A3B on B200
(sources at ``CARDS``).

Each row is the published job as titan-core overrides, planned on the one profile of the hardware they ran
on (h100_sxm_96gb: H100 SXM with 96 GB of HBM2e, 8 per node, 400 Gb/s per GPU between nodes), with no
per-row tuning; printed with the published memory (GiB, the most loaded rank) and TPS/GPU beside the
prediction and the error of each; every job as it ran, AsyncTP included (planned for the card's CUDA device from
this machine). Run: python bench/planner_vs_seeds.py
"""

from __future__ import annotations

import sys
import time

from titan_core.planner.cli import job_estimate
from titan_core.planner.estimate import GIB
from titan_core.planner.hardware import hardware_profile

HARDWARE = "h100_sxm_96gb"
FLOAT8 = "plugins.float8.fsdp_float8_all_gather=true"
ASYNC_TP = "plugins.tp.async_tp=true"
# 126 blocks in 8 or 16 stages: one fewer on the first and on the last stage, which run the embedding and output.
# Tables 5 and 6 name no micro-batch count: TorchTitan then split the local batch into as many micro-batches as
# pipeline ranks (`experimental.pipeline_parallel_microbatches`, default None -> pp degree, torchtitan@9dec370
# torchtitan/parallelisms/pipeline_llama.py), so table 5's 32 sequences run as 8 micro-batches of 4.
FEWER = ("plugins.pp.first_stage_fewer_layers=1", "plugins.pp.last_stage_fewer_layers=1")


def job(model, world, seq, batch, plugins, *extra, ac="selective_op"):
    """Overrides of one published job: ``batch`` is the global batch in sequences. Selective checkpointing is
    TorchTitan's policy, as the jobs ran: every other matmul kept."""
    policy = ["plugins.ac.matmuls=every_other"] if ac == "selective_op" else []
    return [f"model={model}", f"launch.world_size={world}", f"training.seq_len={seq}",
            f"training.global_batch_size={batch}", f"+plugins=[{','.join([*plugins, 'ac'])}]",
            f"plugins.ac.mode={ac}", *policy, *extra]


ROWS = [  # (table, row, overrides, published TPS/GPU, published memory GiB)
    ("1: 8B, 8 GPUs", "FSDP", job("8B", 8, 8192, 16, ["fsdp"]), 5762, 82.4),
    ("1: 8B, 8 GPUs", "FSDP + compile", job("8B", 8, 8192, 16, ["fsdp", "compile"]), 6667, 77.0),
    ("1: 8B, 8 GPUs", "FSDP + compile + float8", job("8B", 8, 8192, 16, ["fsdp", "compile", "float8"], FLOAT8),
     8532, 76.8),
    *[("2: 8B, 8 GPUs, CP", f"FSDP {8 // cp}, CP {cp}, seq {seq}",
       job("8B", 8, seq, 8 // cp, ["fsdp", "compile", "float8", *(["cp"] if cp > 1 else [])], FLOAT8,
           *([f"plugins.cp.degree={cp}"] if cp > 1 else []), ac="full"), tps, mem)
      for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                (8, 262144, 548, 84.5))],
    ("3: 8B, 128 GPUs", "FSDP", job("8B", 128, 8192, 256, ["fsdp"]), 5605, 67.0),
    ("3: 8B, 128 GPUs", "FSDP + compile", job("8B", 128, 8192, 256, ["fsdp", "compile"]), 6514, 62.0),
    ("3: 8B, 128 GPUs", "FSDP + compile + float8", job("8B", 128, 8192, 256, ["fsdp", "compile", "float8"], FLOAT8),
     8380, 61.8),
    *[("4: 70B, 256 GPUs", f"FSDP 32, TP 8{name}", job("70B", 256, 8192, 512, ["fsdp", "tp", "compile", "float8"],
                                                    FLOAT8, "plugins.tp.degree=8", *flags, ac="full"), tps, mem)
      for name, flags, tps, mem in (("", (), 829, 71.9), (", AsyncTP", (ASYNC_TP,), 876, 67.6))],
    *[("5: 405B, 512 GPUs", f"FSDP 8, TP 8, PP 8, {schedule}",
       job("405B", 512, 8192, 256, ["fsdp", "tp", "pp", "compile", "float8"], FLOAT8, "plugins.tp.degree=8", ASYNC_TP,
           "plugins.pp.degree=8", f"plugins.pp.schedule={schedule}", "plugins.pp.microbatches=8", *FEWER, ac="full"), tps, mem)
      for schedule, tps, mem in (("1F1B", 100, 82.5), ("Interleaved1F1B", 128, 72.7))],
    *[("6: 405B, 512 GPUs, CP", f"FSDP {8 // cp}, CP {cp}, seq {seq}",
       job("405B", 512, seq, 8 * (8 // cp), ["fsdp", "tp", "pp", "compile", "float8", *(["cp"] if cp > 1 else [])],
           FLOAT8, "plugins.tp.degree=8", ASYNC_TP, "plugins.pp.degree=8", "plugins.pp.schedule=1F1B", "plugins.pp.microbatches=8", *FEWER,
           *([f"plugins.cp.degree={cp}"] if cp > 1 else []), ac="full"), tps, mem)
      for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                (8, 262144, 16, 84.9))],
]


# Published runs on other cards, each planned on its card's one profile. The Llama 3 8B rows of TorchTitan's
# own harness (8192 tokens a sequence, one per GPU unless said, FSDP over every GPU, bf16 mixed precision):
# A100 80GB: pytorch/torchtitan docs/performance.md @157a12c (April 2024, 64 GPUs, no compile), tokens/s/GPU
# only; H100, MI300X: pytorch/ao torchao/float8/README.md @9519beb, "Training benchmarks" (8 GPUs, compile,
# per-op selective checkpointing; PR #2736 for MI300X); H200: pytorch/torchtitan
# benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (4 and 8 nodes, 2 sequences a GPU, float8).
# The seeds' H100s (h100_sxm_96gb, TorchTitan's Grand Teton hosts), beyond the seeds' tables, tokens/s/GPU only:
# Llama 3.1 405B on 128 GPUs, FSDP 16 x TP 8, 2 sequences a data-parallel rank, full checkpointing, compile (the
# 405B preset of then), pytorch/torchtitan docs/performance.md @3faaa1a (August 2024); Llama 3 70B on 256 GPUs
# (FSDP 32 x TP 8, 16 sequences a data-parallel rank, full checkpointing) and 8B on 64 (FSDP 8 x TP 8, 12
# sequences, per-op selective checkpointing), compile, TP with and without AsyncTP,
# pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (June 2025; their loss
# was compiled, which the compile plugin refuses under tensor parallel: planned eager; float8 with FSDP's bf16
# all-gathers, their presets' default). TorchTitan's tensorwise float8 gathered sequence parallel's inputs in
# float8 (Float8ColwiseParallel), titan-core's in bf16.
# B200: pytorch/ao docs/source/workflows/training.md @36027d8, "Training e2e benchmarks on NVIDIA B200" (the same
# table in torchao/prototype/mx_formats/README.md and torchtitan's mxfp8.md): Llama 3 8B on 8 B200s limited to 750 W
# (ao@d8bb51f's wording), sequence 8192, batch 1 a GPU, FSDP 8, compile, per-op selective checkpointing, torchtitan
# 6fc499f (August 2025: the loss compiled), median tokens/s/GPU and peak memory; bf16, float8 tensorwise (float8
# all-gathers), rowwise, and MXFP8 with cuBLAS and RCEIL scales (torchao's mxfp8_cublas_rceil, titan-core's
# mxfp8_rceil). Its mxfp8_cublas row (floor scales) has no titan-core recipe and is left out.
# Memory is the peak reserved by the caching allocator, as TorchTitan logs it.
# TorchTitan compiled its loss with its blocks (`training.compile`) until 2024-12-18 (e8977b0 turned that off: the
# seeds' tables, 9dec370, and torchao's H100 rows of 2025-03-12 ran it eager) and again from 2025-04-02 (bbb1b61,
# `build_cross_entropy_loss`): the MI300X rows (torchtitan 2c8b594, August 2025) and the H200 rows (e7c0cae, June
# 2025) ran it compiled.
LOSS_COMPILED = "plugins.compile.compile_loss=true"
CARDS = [  # (card's profile, source and job, overrides, published TPS/GPU, published memory GiB or None)
    ("a100", "torchtitan A100: 8B, 64 GPUs, selective layer", job("8B", 64, 8192, 64, ["fsdp"], ac="selective_layer"),
     2904, None),
    ("a100", "torchtitan A100: 8B, 64 GPUs, selective op", job("8B", 64, 8192, 64, ["fsdp"]), 2973, None),
    ("a100", "torchtitan A100: 70B, 64 GPUs, full AC", job("70B", 64, 8192, 64, ["fsdp"], ac="full"), 331, None),
    ("h100_sxm", "torchao H100: 8B, 8 GPUs, bf16", job("8B", 8, 8192, 8, ["fsdp", "compile"]), 6150, 47.65),
    ("h100_sxm", "torchao H100: 8B, 8 GPUs, float8 tensorwise", job("8B", 8, 8192, 8, ["fsdp", "compile", "float8"],
                                                                     FLOAT8), 7689.5, 47.77),
    ("h100_sxm", "torchao H100: 8B, 8 GPUs, float8 rowwise", job("8B", 8, 8192, 8, ["fsdp", "compile", "float8"],
                                                                  "plugins.float8.recipe=rowwise"), 6768, 47.79),
    ("mi300x", "torchao MI300X: 8B, 8 GPUs, bf16", job("8B", 8, 8192, 8, ["fsdp", "compile"], LOSS_COMPILED), 5376.5,
     39.09),
    ("mi300x", "torchao MI300X: 8B, 8 GPUs, float8 tensorwise", job("8B", 8, 8192, 8, ["fsdp", "compile", "float8"],
                                                                     FLOAT8, LOSS_COMPILED), 6166.0, 39.07),
    ("mi300x", "torchao MI300X: 8B, 8 GPUs, float8 rowwise, weight gradient bf16",
     job("8B", 8, 8192, 8, ["fsdp", "compile", "float8"], "plugins.float8.recipe=rowwise_with_gw_hp", LOSS_COMPILED),
     6100.0, 39.32),
    ("mi300x", "torchao MI300X: 8B, 8 GPUs, float8 rowwise", job("8B", 8, 8192, 8, ["fsdp", "compile", "float8"],
                                                                  "plugins.float8.recipe=rowwise", LOSS_COMPILED),
     5891.0, 39.32),
    *[("b200", f"torchao B200: 8B, 8 GPUs, {kind}", job("8B", 8, 8192, 8, ["fsdp", "compile", *extra], *flags,
                                                          LOSS_COMPILED), tps, memory)
      for kind, extra, flags, tps, memory in (
          ("bf16", [], [], 8307.5, 33.71), ("float8 tensorwise", ["float8"], [FLOAT8], 10417.0, 33.38),
          ("float8 rowwise", ["float8"], ["plugins.float8.recipe=rowwise"], 8640.5, 33.72),
          ("MXFP8", ["float8"], ["plugins.float8.recipe=mxfp8_rceil"], 9642.0, 33.88))],
    # TorchTitan's default expert parallelism beside DeepEP's (PR 2237, torchtitan@1ab3be4
    # torchtitan/distributed/deepep/README.md: "14,796 vs 9,930 tok/s/GPU at EP=8" on 8 B200s), the job its
    # qwen3_30b_a3b_with_deepep.toml runs with flavor 30B-A3B: routing forced even, full checkpointing, model and loss
    # compiled, 8 sequences of 4,096 a rank. Its memory is published for DeepEP's runs only.
    ("b200", "torchtitan B200: Qwen3 30B-A3B, 8 GPUs, FSDP 8, EP 8",
     job("qwen3_30B_A3B", 8, 4096, 64, ["fsdp", "ep", "compile"], "plugins.ep.degree=8", LOSS_COMPILED, ac="full"),
     9930, None),
    ("h200", "torchtitan H200: 8B, 32 GPUs, float8", job("8B", 32, 8192, 64, ["fsdp", "compile", "float8"], FLOAT8,
                                                              LOSS_COMPILED), 10938, 47.96),
    ("h200", "torchtitan H200: 8B, 64 GPUs, float8", job("8B", 64, 8192, 128, ["fsdp", "compile", "float8"], FLOAT8,
                                                              LOSS_COMPILED), 10753, 46.97),
    *[(HARDWARE, f"torchtitan H100: 405B, 128 GPUs, FSDP 16, TP 8, {kind}",
       job("405B", 128, 8192, 32, ["fsdp", "tp", "compile", *extra], *flags, "plugins.tp.degree=8", ac="full"), tps,
       None)
      for kind, extra, flags, tps in (("bf16", [], [], 109), ("float8", ["float8"], [FLOAT8], 177),
                                      ("float8, AsyncTP", ["float8"], [FLOAT8, ASYNC_TP], 185))],
    *[(HARDWARE, f"torchtitan H100: {model}, {world} GPUs, FSDP {world // 8}, TP 8, {kind}{asynchronous}",
       job(model, world, 8192, world // 8 * rows, ["fsdp", "tp", "compile", *extra], *flags, "plugins.tp.degree=8",
           *async_flags, ac=ac), tps, None)
      for model, world, rows, ac, runs in (("70B", 256, 16, "full", ((597.3, 652.4), (809.8, 942.4), (599.6, 624.8))),
                                           ("8B", 64, 12, "selective_op",
                                            ((4378, 4809.4), (5078.1, 5570.1), (3708.5, 3914.9))))
      for (kind, extra, flags), pair in zip((("bf16", [], []), ("float8 tensorwise", ["float8"], []),
                                             ("float8 rowwise", ["float8"], ["plugins.float8.recipe=rowwise"])), runs)
      for (asynchronous, async_flags), tps in zip((("", ()), (", AsyncTP", (ASYNC_TP,))), pair)],
]
# Published as out of memory: TorchTitan's 405B on 128 H100s with FSDP alone (docs/performance.md @3faaa1a).
OUT_OF_MEMORY = [(HARDWARE, "torchtitan H100: 405B, 128 GPUs, FSDP 128, bf16",
                  job("405B", 128, 8192, 256, ["fsdp", "compile"], ac="full"))]


def predicted(overrides: list[str], hardware: str = HARDWARE) -> tuple[float, float, float]:
    """TPS/GPU and GiB allocated and reserved by the most loaded rank, as the planner predicts them."""
    _, estimate = job_estimate(["--hardware", hardware, *overrides])
    rank = estimate.most_loaded()
    return rank.tokens_per_device(), sum(rank.memory().values()) / GIB, rank.reserved() / GIB


def table(rows) -> dict[str, dict[str, list[float]]]:
    """Prints each row beside its prediction; returns the errors by card and kind."""
    print("| card | job | TPS/GPU published | predicted | error | memory GiB published (reserved) | allocated | "
          "reserved | error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    errors: dict[str, dict[str, list[float]]] = {}
    for card, name, overrides, tps, memory in rows:
        got_tps, allocated, got_memory = predicted(overrides, card)
        card_errors = errors.setdefault(card, {"tps": [], "memory": [], "planned unfit": []})
        if allocated > hardware_profile(card).usable_gib:  # it ran: a plan saying it does not fit is wrong
            card_errors["planned unfit"].append(name)
        card_errors["tps"].append(got_tps / tps - 1)
        memory_error = "" if memory is None else f"{got_memory / memory - 1:+.0%}"
        if memory is not None:
            card_errors["memory"].append(got_memory / memory - 1)
        print(f"| {card} | {name} | {tps:,} | {got_tps:,.0f} | {got_tps / tps - 1:+.0%} | {memory or 'not given'} | "
              f"{allocated:.1f} | {got_memory:.1f} | {memory_error} |", flush=True)
    return errors


def summary(errors: dict[str, dict[str, list[float]]]) -> None:
    """Mean and worst error per card and kind (what titan_core/planner/accuracy.py prints beside estimates)."""
    for card, kinds in errors.items():
        for what, values in kinds.items():
            if values:
                mean = sum(abs(v) for v in values) / len(values)
                print(f"{card} {what}: mean |error| {mean:.1%}, worst {max(values, key=abs):+.1%}, "
                      f"{sum(abs(v) <= (0.15 if what == 'tps' else 0.1) for v in values)}/{len(values)} rows within "
                      f"{'15' if what == 'tps' else '10'}%")


def main() -> None:
    start = time.perf_counter()
    print("TorchTitan's Llama 3.1 tables (benchmarks/llama3_h100_202412_torchtitan.md):\n")
    seeds = table([(HARDWARE, f"{number}: {name}", overrides, tps, memory) for number, name, overrides, tps, memory in ROWS])
    summary(seeds)
    print("\nOther published runs, other cards:\n")
    cards = table(CARDS)
    summary(cards)
    print("\nPublished as out of memory:\n")
    for card, name, overrides in OUT_OF_MEMORY:
        _, allocated, reserved = predicted(overrides, card)
        usable = hardware_profile(card).usable_gib
        print(f"{name}: {allocated:.1f} GiB allocated, {'does not fit' if allocated > usable else 'FITS'} in "
              f"{usable:.1f}")
    unfit = [name for errors in (seeds, cards) for kinds in errors.values() for name in kinds["planned unfit"]]
    print(f"\nPublished runs that ran, planned as not fitting: {', '.join(unfit) or 'none'}")
    print("\nEvery H100 row, and every row of every card:\n")
    by_card = [seeds, cards]
    summary({"h100": {what: [v for errors in by_card for card, kinds in errors.items() if card.startswith("h100")
                             for v in kinds[what]] for what in ("tps", "memory")},
             "every card": {what: [v for errors in by_card for kinds in errors.values() for v in kinds[what]]
                            for what in ("tps", "memory")}})
    print(f"\n({time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
