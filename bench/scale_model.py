"""Per-rank bytes at the seeds' scale, before and after the 512-GPU fixes, from the code's own shapes.

    python bench/scale_model.py

For each seed plan (Llama 3.1 8B on 128 GPUs, 8B with CP 8 at 262k tokens, 70B as FSDP 32 x TP 8, 405B as
FSDP 8 x TP 8 x PP 8) the model is built on the meta device by its plugin (nothing is allocated) and its
parameter shapes give, per rank: the keys and values context parallel moves per forward, the embedding and
output layer FSDP holds gathered, what an asynchronous save allocates, what Hugging Face import and export
hold in host memory, and how many times a rank reads the tokenizer and the checkpoint's metadata at start.
"Before" is the code before the fixes (K/V repeated to every head, embedding and output in the root unit,
a fresh pageable copy per save, whole-model import, export gathered on rank 0, every rank re-checking the
job); "after" is what the code does now. Bytes only: no time is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_core.plugins import build_meta_model, model_description
from titan_core.testing import compose

GB = 1e9
BF16, FP32 = 2, 4
TRAINING_STATE = 12  # bytes per parameter in a checkpoint: fp32 weights and AdamW's two fp32 moments
TOKENIZER_BYTES = 9.1e6  # Llama 3's tokenizer.json
START_READS_BEFORE = 3  # every rank: the launcher's checks under torchrun, the plan's validation, the worker


@dataclass(frozen=True)
class SeedPlan:
    name: str
    preset: str
    seq_len: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


PLANS = (SeedPlan("8B, FSDP 128", "8B", 8192, dp=128),
         SeedPlan("8B, FSDP 8 x CP 8, 262k tokens", "8B", 262144, dp=8, cp=8),
         SeedPlan("70B, FSDP 32 x TP 8", "70B", 8192, dp=32, tp=8),
         SeedPlan("405B, FSDP 8 x TP 8 x PP 8", "405B", 8192, dp=8, tp=8, pp=8))


def rows(plan: SeedPlan) -> list[tuple[str, float, float]]:
    """(what, bytes before, bytes after) per rank for ``plan``."""
    config = compose(f"model={plan.preset}", f"training.seq_len={plan.seq_len}", "tokenizer.path=builtin")
    description = model_description(config, vocab_size=int(config.model.vocab_size))
    model = build_meta_model(config, description)
    params = sum(p.numel() for p in model.parameters())
    args = description.args
    embedding = model.get_submodule(description.inputs[0]).weight.numel()
    output = model.get_submodule(description.outputs[-1]).weight.numel()
    head_dim = args.dim // args.n_heads
    shard = params / plan.world  # each rank's share of every parameter (FSDP x TP x PP)

    # Ring attention: each rank receives the other cp - 1 ranks' K and V of its layers' sequence shards.
    tokens = plan.seq_len // plan.cp
    layers = args.n_layers // plan.pp

    def kv_moved(heads: int) -> float:
        return 2 * tokens * heads // plan.tp * head_dim * BF16 * (plan.cp - 1) * layers
    return [
        ("CP: K/V received per forward", kv_moved(args.n_heads), kv_moved(args.n_kv_heads)),
        # Before, they sat in the root unit, gathered from the forward until the backward ended (a pipeline
        # stage holds one of them); now each is a unit resharded after its forward, regathered for its backward.
        ("FSDP: embedding/output gathered all step", (max if plan.pp > 1 else sum)((embedding, output))
         / plan.tp * BF16, 0.0),
        ("async save: host memory allocated per save", shard * TRAINING_STATE, 0.0),  # reused after the first
        ("HF import (bf16 files): host memory", params * BF16, shard * BF16),  # whole files, now own slices
        ("HF export (bf16): host memory", params * (FP32 + BF16), shard * (FP32 + BF16)),  # rank 0, now each
        ("start: tokenizer reads (other ranks)", START_READS_BEFORE * TOKENIZER_BYTES, 0.0),
    ]


def main() -> None:
    print(f"{'plan':<34} {'per rank':<44} {'before':>10} {'after':>10}")
    for plan in PLANS:
        for what, before, after in rows(plan):
            print(f"{plan.name:<34} {what:<44} {before / GB:>8.2f}GB {after / GB:>8.2f}GB")


if __name__ == "__main__":
    main()
