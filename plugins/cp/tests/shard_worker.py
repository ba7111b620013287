"""One rank of the two-rank check that cp splits tokens, labels and RoPE rows alike (run by torchrun).

Writes what this rank held inside the context to <out>/rank<r>.json; RoPE rows are identified by
matching them against the full table, so the file says which positions the rank held.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from titan_core import ParallelMesh, Plan
from titan_core.testing import init_weights
from titan_cp import plugin
from titan_llama3.model import LlamaArgs, Transformer
from titan_llama3.plugin import describe

SEQ = 16


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mesh = ParallelMesh({"cp": 2}, "cpu")
        with torch.device("meta"):
            model = Transformer(LlamaArgs(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=SEQ))
        plan = Plan((), {"cp": 2}, 2, describe(model.args))
        plugin.apply_parallelism(mesh=mesh, plugin_config=OmegaConf.create({"rotate_method": "allgather",
                                                                            "load_balance": True}))
        model.to_empty(device="cpu")
        init_weights(model, describe(model.args), 0)
        full_rope = model.rope.clone()
        inputs = torch.arange(SEQ).expand(2, SEQ).clone()
        labels = inputs + 100
        with plugin.batch_context(inputs=inputs, labels=labels, model_kwargs={}, model_parts=[model], mesh=mesh,
                                  plan=plan):
            rope_rows = [next(p for p in range(SEQ) if torch.equal(row, full_rope[p])) for row in model.rope]
            seen = {"inputs": inputs.tolist(), "labels": labels.tolist(), "rope_rows": rope_rows}
        seen["rope_restored"] = torch.equal(model.rope, full_rope)
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
