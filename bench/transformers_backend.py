"""What the generic path costs: step time of one Llama folder trained through the native plugin (model=hf, llama3)
and through the transformers backend (model=transformers), same weights, data and plan, one run of each.

    flock /tmp/titan-cpu.lock python bench/transformers_backend.py [--world 2] [--compile]

Step time is the median over the steps after the first (which holds compilation and warm-up). On this CPU the
figures are a CPU's (the two paths' attention kernels differ on GPUs: the native plugin's core attention against
transformers' SDPA call), so the ratio says what the backend's module and forward cost beside the native model's.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import transformers

from titan_core.testing import run_job, write_hf_folder


def measure(model: list[str], plan: list[str], common: list[str], run_dir: Path) -> dict:
    metrics = run_job([*model, "+plugins=[checkpoint]", *plan, *common], run_dir).metrics
    return {"step_s": statistics.median(m["step_time_s"] for m in metrics[1:]), "first_step_s": metrics[0]["step_time_s"],
            "losses": [m["loss"] for m in metrics]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="FSDP degree (1: one process)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="also compile every block, in both runs")
    args = parser.parse_args()
    common = [f"training.steps={args.steps}", "training.seq_len=128", "training.global_batch_size=8",
              "metrics.log_every=1", "metrics.tensorboard=false", "metrics.peak_tflops=1", "lr_scheduler.warmup_steps=2"]
    plan = ([f"+plugins=[fsdp{',compile' if args.compile else ''}]", f"plugins.fsdp.degree={args.world}"]
            if args.world > 1 else ["+plugins=[compile]"] if args.compile else [])
    config = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                                      intermediate_size=768, vocab_size=2048, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_hf_folder(transformers.LlamaForCausalLM(config), Path(tmp) / "llama")
        native = measure(["model=hf", f"model.path={folder}"], plan, common, Path(tmp) / "native")
        backend = measure(["model=transformers", f"model.path={folder}"], plan, common, Path(tmp) / "backend")
    diff = max(abs(a - b) for a, b in zip(native["losses"], backend["losses"]))
    print(f"Llama (hidden 256, 6 layers), world {args.world}, {args.steps} steps"
          f"{', compiled' if args.compile else ', eager'}")
    for name, r in (("native llama3", native), ("transformers", backend)):
        print(f"  {name:<14} step {r['step_s'] * 1e3:7.1f} ms (first {r['first_step_s']:.1f} s)")
    print(f"  transformers / native: step time {backend['step_s'] / native['step_s']:.2f}x, max loss diff {diff:.1e}")


if __name__ == "__main__":
    main()
