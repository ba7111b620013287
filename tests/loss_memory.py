"""What the core's loss holds on this CPU, eager and compiled by the compile plugin: printed as one JSON line.

For bf16 logits of ``TOKENS`` x ``VOCABULARY``, in multiples of the logits' own bytes: ``kept`` (the storages the
loss hands autograd to keep for backward: the logits themselves if it keeps them) and ``backward`` (the most its
backward holds beyond what it started with, as a sampler of the process's resident memory sees it; that memory
follows every tensor here: each is larger than glibc's largest mmap threshold, 32 MiB, so allocated and freed
straight from the kernel).
Run in a fresh interpreter (tests/test_planner_memory.py does) so nothing else moves it.
"""

import gc
import json
import os
import threading
import time
from types import SimpleNamespace

import torch

from titan_compile.plugin import compiled_loss
from titan_core.train import cross_entropy_loss

TOKENS, VOCABULARY = 1024, 32768


def resident() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def holds(loss_fn) -> dict[str, float]:
    labels = torch.randint(0, VOCABULARY, (1, TOKENS))
    leaf = torch.randn(1, TOKENS, VOCABULARY, dtype=torch.bfloat16, requires_grad=True)
    loss_fn(leaf.clone(), labels).backward()  # compiles (the compiled loss) outside the measurement
    leaf.grad = None
    gc.collect()
    logits_bytes = leaf.nbytes
    kept = {}

    def pack(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_fn(leaf.clone(), labels)  # a tensor of the caller's, as the model's output is
    gc.collect()
    # Again without the hooks, under which the compiled backward lets go of what it kept before it makes the
    # gradient (measured: 0.0004x the logits held, for 1.0x without them).
    loss = loss_fn(leaf.clone(), labels)
    samples, done = [resident()], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(resident())
            time.sleep(0.0002)
    sampler = threading.Thread(target=sample)
    sampler.start()
    loss.backward()  # the kernels release the GIL: the sampler sees their buffers
    done.set()
    sampler.join()
    return {"kept": sum(kept.values()) / logits_bytes, "backward": (max(samples) - samples[0]) / logits_bytes}


if __name__ == "__main__":
    torch.manual_seed(0)
    compiled = compiled_loss(cross_entropy_loss, SimpleNamespace(compile_loss=True, backend="inductor",
                                                                 fullgraph=True, mode="default"))
    print(json.dumps({"eager": holds(cross_entropy_loss), "compiled": holds(compiled)}))
