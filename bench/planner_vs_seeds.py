"""The planner against TorchTitan's published Llama 3.1 runs (benchmarks/llama3_h100_202412_torchtitan.md).

Each row is the published job as titan-core overrides, planned on the one profile of the hardware they ran
on (h100_sxm_96gb: H100 SXM with 96 GB of HBM2e, 8 per node, 400 Gb/s per GPU between nodes), with no
per-row tuning; printed with the published memory (GiB, the most loaded rank) and TPS/GPU beside the
prediction and the error of each. AsyncTP needs CUDA to be configured here, so the rows that used it are
planned without it (marked). Run: python bench/planner_vs_seeds.py
"""

from __future__ import annotations

import sys
import time

from titan_core.planner.cli import job_estimate
from titan_core.planner.estimate import GIB

HARDWARE = "h100_sxm_96gb"
FLOAT8 = "plugins.float8.fsdp_float8_all_gather=true"
# 126 blocks in 8 or 16 stages: one fewer on the first and on the last stage, which run the embedding and output.
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
    ("4: 70B, 256 GPUs", "FSDP 32, TP 8", job("70B", 256, 8192, 512, ["fsdp", "tp", "compile", "float8"], FLOAT8,
                                              "plugins.tp.degree=8", ac="full"), 829, 71.9),
    *[("5: 405B, 512 GPUs", f"FSDP 8, TP 8, PP 8, {schedule} (no AsyncTP)",
       job("405B", 512, 8192, 256, ["fsdp", "tp", "pp", "compile", "float8"], FLOAT8, "plugins.tp.degree=8",
           "plugins.pp.degree=8", f"plugins.pp.schedule={schedule}", "plugins.pp.microbatches=32", *FEWER, ac="full"), tps, mem)
      for schedule, tps, mem in (("1F1B", 100, 82.5), ("Interleaved1F1B", 128, 72.7))],
    *[("6: 405B, 512 GPUs, CP", f"FSDP {8 // cp}, CP {cp}, seq {seq} (no AsyncTP)",
       job("405B", 512, seq, 8 * (8 // cp), ["fsdp", "tp", "pp", "compile", "float8", *(["cp"] if cp > 1 else [])],
           FLOAT8, "plugins.tp.degree=8", "plugins.pp.degree=8", "plugins.pp.schedule=1F1B", "plugins.pp.microbatches=8", *FEWER,
           *([f"plugins.cp.degree={cp}"] if cp > 1 else []), ac="full"), tps, mem)
      for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                (8, 262144, 16, 84.9))],
]


def predicted(overrides: list[str]) -> tuple[float, float]:
    """TPS/GPU and GiB of the most loaded rank, as the planner predicts them."""
    _, estimate = job_estimate(["--hardware", HARDWARE, *overrides])
    rank = estimate.most_loaded()
    return rank.tokens_per_device(), sum(rank.memory().values()) / GIB


def main() -> None:
    start = time.perf_counter()
    print(f"hardware profile: {HARDWARE}\n")
    print("| table | job | TPS/GPU published | predicted | error | memory GiB published | predicted | error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    errors = {"tps": [], "memory": []}
    for table, name, overrides, tps, memory in ROWS:
        got_tps, got_memory = predicted(overrides)
        errors["tps"].append(got_tps / tps - 1)
        errors["memory"].append(got_memory / memory - 1)
        print(f"| {table} | {name} | {tps:,} | {got_tps:,.0f} | {got_tps / tps - 1:+.0%} | {memory} | "
              f"{got_memory:.1f} | {got_memory / memory - 1:+.0%} |", flush=True)
    for what, values in errors.items():
        mean = sum(abs(v) for v in values) / len(values)
        print(f"\n{what}: mean |error| {mean:.0%}, worst {max(values, key=abs):+.0%}, "
              f"{sum(abs(v) <= (0.2 if what == 'tps' else 0.1) for v in values)}/{len(values)} rows within "
              f"{'20' if what == 'tps' else '10'}%", end="")
    print(f"\n\n({time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
