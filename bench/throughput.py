"""Tokens/s of titan-core against a bare hand-written PyTorch loop of the same model, one process.

    python bench/throughput.py [--steps 40]

Both train the debug Llama (seq 256, batch 8, AdamW, grad clipping) with the same threads, one after
the other in this run; the first logged interval (warm-up) is left out of both. Prints the ratio and
titan-core's MFU against the peak it measured. Not a test: this machine is shared and noisy, so compare
ratios from one run only.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from titan_core.data import document_opener, load_tokenizer
from titan_core.data.text import PackedLoader
from titan_core.initialization import init_weights
from titan_core.parameter_roles import param_groups
from titan_llama3.model import Transformer
from titan_llama3.plugin import llama_args, describe
from titan_core.train import cross_entropy_loss

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "titan_core" / "conf"


def titan_core_run(steps: int, interval: int, run_dir: Path) -> list[dict]:
    subprocess.run([sys.executable, "-m", "titan_core.run", f"training.steps={steps}",
                    f"metrics.log_every={interval}", "metrics.tensorboard=false", f"hydra.run.dir={run_dir}"],
                   check=True, capture_output=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def bare_loop(steps: int, interval: int) -> float:
    """The same model, data and optimizer as the default job, written as plainly as possible."""
    config = OmegaConf.load(CONF / "config.yaml")
    config.model = OmegaConf.load(ROOT / "plugins" / "llama3" / "titan_llama3" / "conf" / "model" / "debug.yaml")
    tokenizer = load_tokenizer(config.tokenizer)
    model = Transformer(llama_args(config.model, tokenizer.vocab_size, config.training.seq_len))
    description = describe(model.args)
    init_weights(model, description, 0)
    opt = config.optimizer
    groups = param_groups([model], description, opt.lr, opt.weight_decay, opt.no_weight_decay, opt.lr_multipliers)
    optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps)
    batches = PackedLoader(document_opener(config.data), tokenizer, config.training.seq_len,
                           config.training.global_batch_size, 0, 1)
    start = None
    for step in range(1, steps + 1):
        if step == interval + 1:
            start = time.perf_counter()
        inputs, labels = next(batches)
        optimizer.zero_grad()
        cross_entropy_loss(model(inputs), labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.training.max_norm)
        optimizer.step()
    tokens = (steps - interval) * config.training.global_batch_size * config.training.seq_len
    return tokens / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = titan_core_run(args.steps, args.interval, Path(tmp))
    steady = metrics[1:]
    titan_tps = sum(m["tokens_per_s"] for m in steady) / len(steady)
    mfu = sum(m["mfu"] for m in steady) / len(steady)
    bare_tps = bare_loop(args.steps, args.interval)
    print(f"titan-core {titan_tps:.0f} tok/s | bare PyTorch loop {bare_tps:.0f} tok/s | "
          f"ratio {titan_tps / bare_tps:.3f} | titan-core MFU {mfu:.1%} of the measured fp32 matmul peak "
          f"({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
