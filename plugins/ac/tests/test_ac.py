"""Activation checkpointing: the memory it saves (measured), unchanged numerics, bad options refused."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import titan_ac
from titan_ac.plugin import apply_ac
from titan_core import canonical_name
from titan_core.testing import init_weights
from titan_llama3.model import LlamaArgs, Transformer
from titan_llama3.plugin import describe
from titan_core.testing import TINY, error_line, run_job

# The TINY model of the parity harness, with its global batch in one process.
ARGS = LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=264, multiple_of=32, max_seq_len=32)
SAVE_OPS = ["mm", "_scaled_dot_product_flash_attention_for_cpu"]


class OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Calls of one aten op."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket is self.op
        return func(*args, **(kwargs or {}))


def _step(mode: str | None, matmuls: str = "all"):
    """Peak bytes by kind (torch's MemTracker, which follows every tensor's storage) over one
    forward+backward, the loss, the gradients by canonical name, and the matmuls backward ran."""
    model = Transformer(ARGS)
    init_weights(model, describe(model.args), 0)
    if mode:
        apply_ac(model.layers, mode, every=2, save_ops=SAVE_OPS, matmuls=matmuls)
    tokens = torch.randint(0, ARGS.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    tracker, backward_matmuls = MemTracker(), OpCount(torch.ops.aten.mm)
    tracker.track_external(model)
    with tracker:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        with backward_matmuls:
            loss.backward()
    peak = {kind.name: n for kind, n in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()
            if kind != "Total"}
    grads = {canonical_name(n): p.grad for n, p in model.named_parameters()}
    return peak, loss.item(), grads, backward_matmuls.calls


def test_checkpointing_saves_activation_memory_and_changes_no_number():
    base_peak, base_loss, base_grads, _ = _step(None)
    acts = {"none": base_peak["ACT"]}
    for mode in ("full", "selective_op", "selective_layer"):
        peak, loss, grads, _ = _step(mode)
        acts[mode] = peak["ACT"]
        assert loss == base_loss, mode  # recomputation replays the same kernels: bitwise equal
        assert all(torch.equal(grads[n], base_grads[n]) for n in base_grads), mode
    print("peak activation bytes (tiny model, batch 8 x 31):",
          ", ".join(f"{m} {b / 2**20:.2f} MiB ({1 - b / acts['none']:.0%} saved)" for m, b in acts.items()))
    # full keeps only block inputs; every-2nd-layer checkpoints half the blocks; per-op keeps matmuls.
    assert acts["full"] < 0.35 * acts["none"]
    assert acts["full"] < acts["selective_layer"] < 0.75 * acts["none"]
    assert acts["full"] < acts["selective_op"] < 0.75 * acts["none"]


class ScaledMatmul(torch.autograd.Function):
    """A float8 linear's forward as torchao runs it on GPUs: operands cast to float8, one ``_scaled_mm``."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        one = torch.tensor(1.0)
        return torch._scaled_mm(x.to(torch.float8_e4m3fn), weight.to(torch.float8_e4m3fn).t(), scale_a=one,
                                scale_b=one, out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


def test_every_other_matmul_is_recomputed_as_torchtitan_does_and_no_number_changes():
    """matmuls=every_other keeps a block's 1st, 3rd, 5th and 7th matmul (query, value, gate, down) and reruns
    the 3 others in backward, in each of the 4 blocks; the numbers stay bitwise those of no checkpointing."""
    _, base_loss, base_grads, _ = _step(None)
    runs = {policy: _step("selective_op", policy) for policy in ("all", "every_other")}
    for peak, loss, grads, _ in runs.values():
        assert loss == base_loss and all(torch.equal(grads[n], base_grads[n]) for n in base_grads)
    assert runs["every_other"][3] - runs["all"][3] == 3 * ARGS.n_layers
    assert runs["every_other"][0]["ACT"] < runs["all"][0]["ACT"]


DEFAULT_SAVE_OPS = list(OmegaConf.load(Path(titan_ac.__file__).parent / "conf" / "plugins" / "ac.yaml").ac.save_ops)


def _recomputed(block: torch.nn.Module, op, save_ops) -> int:
    """Calls of ``op`` in the backward of ``block`` checkpointed with selective_op, keeping ``save_ops``."""
    layers = torch.nn.ModuleDict({"0": block})
    apply_ac(layers, "selective_op", save_ops=save_ops)
    out = layers["0"](torch.randn(8, 16, requires_grad=True))
    with OpCount(op) as count:
        out.sum().backward()
    return count.calls


class Float8Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, 16))

    def forward(self, x):
        return torch.relu(ScaledMatmul.apply(x, self.weight))


def test_selective_op_keeps_float8_matmuls_as_it_keeps_matmuls():
    """With the default save_ops no ``_scaled_mm`` runs again in backward; with ``mm`` alone (the old default)
    the checkpointed block recomputed it."""
    assert [_recomputed(Float8Block(), torch.ops.aten._scaled_mm, ops) for ops in (DEFAULT_SAVE_OPS, ["mm"])] == [0, 1]


def test_selective_op_keeps_a_biased_linears_matmul():
    """A linear with a bias computes one ``addmm`` (gpt-oss's attention): with the default save_ops none runs again
    in backward, as its float8 version keeps its ``mm``; with the matmuls alone (the old default) the checkpointed
    block recomputed it, so that a float8 block kept what the same block in bf16 did not."""
    def linear():
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
    assert [_recomputed(linear(), torch.ops.aten.addmm, ops)
            for ops in (DEFAULT_SAVE_OPS, ["mm", "_scaled_mm"])] == [0, 1]



def test_selective_op_keeps_a_tensor_parallel_biased_linears_matmul():
    """Under tensor parallelism the policy sees the DTensor's ``addmm`` (a fake two-rank world: the local shards
    compute, the collectives move nothing): the column-wise biased linear's is kept with the default save_ops and
    runs again in backward without the matmuls."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def sharded():
            block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
            return parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        recomputed = [_recomputed(sharded(), torch.ops.aten.addmm, ops) for ops in (DEFAULT_SAVE_OPS, ["_scaled_mm"])]
        assert recomputed == [0, 1]
    finally:
        dist.destroy_process_group()


def test_parameter_names_stay_canonical():
    model = Transformer(ARGS)
    plain = {n for n, _ in model.named_parameters()}
    apply_ac(model.layers, "selective_layer", every=3)
    wrapped = [n for n, _ in model.named_parameters()]
    assert {canonical_name(n) for n in wrapped} == plain
    assert sorted({n.split(".")[1] for n in wrapped if "_checkpoint_wrapped_module" in n}) == ["0", "3"]


def test_full_checkpointing_trains_like_no_checkpointing(titan_parity):
    report = titan_parity(["+plugins=[ac]", "plugins.ac.mode=full"])
    assert report.max_loss_diff == 0.0
    assert report.max_param_diff == 0.0


@pytest.mark.slow
def test_selective_op_with_fsdp(titan_parity):
    report = titan_parity(["+plugins=[ac,fsdp]", "plugins.fsdp.degree=2"])
    # FSDP alone differs from one process by 1 ulp of the loss (its gradient reduction sums in
    # another order); checkpointing adds nothing to that.
    assert report.max_loss_diff <= 1e-5
    assert report.max_param_diff <= 1e-4


def test_selective_op_under_a_split_backward_is_refused(tmp_path):
    # Crashed after launch ("Trying to backward an extra time"): found by bench/stack_matrix.py.
    result = run_job([*TINY, "launch.dry_run=true", "+plugins=[pp,ac]", "plugins.pp.degree=2",
                      "plugins.pp.schedule=ZBVZeroBubble", "plugins.ac.mode=selective_op"], tmp_path, expect_success=False)
    assert "plugins.ac.mode: selective_op cannot run under a pipeline schedule that splits backward" in error_line(result)


@pytest.mark.parametrize("override, message", [
    ("plugins.ac.mode=some", "plugins.ac.mode: unknown mode 'some'"),
    ("plugins.ac.save_ops=[mm,matmull]", "plugins.ac.save_ops: 'matmull' is not an aten op"),
    ("plugins.ac.every=0", "plugins.ac.every: 0 is not a positive integer"),
    ("plugins.ac.matmuls=half", "plugins.ac.matmuls: unknown policy 'half'; fix: use one of all, every_other"),
])
def test_bad_options_fail_before_launch(tmp_path, override, message):
    extra = ["plugins.ac.mode=selective_layer"] if "every" in override else []
    result = run_job([*TINY, "+plugins=[ac]", *extra, override], tmp_path / "run", expect_success=False)
    assert result.returncode == 2
    assert message in result.stderr
