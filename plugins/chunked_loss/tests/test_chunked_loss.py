"""Chunked cross entropy: the plain loss and its gradients to 1e-6, never more than one chunk of logits
alive, and the same training under tensor parallel (loss parallel on and off), pipeline stages and FSDP."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titan_chunked_loss.plugin import LogitsWeight, chunked_cross_entropy
from titan_core import IGNORE_INDEX
from titan_core.testing import TINY, error_line, run_job

LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # the parity harness's bounds for a parallel run
VOCAB, DIM = 50, 4  # DIM below every chunk: the transposed weight (DIM x VOCAB) is no logits chunk


class LargestLogits(TorchDispatchMode):
    """Records the most rows any tensor with ``VOCAB`` columns had, forward and backward."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[-1] == VOCAB:
                self.rows = max(self.rows, tensor.shape[0])
        return out


def _plain_and_chunked(chunk_tokens: int):
    torch.manual_seed(0)
    hidden = torch.randn(3, 20, DIM, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(VOCAB, DIM))
    labels = torch.randint(0, VOCAB, (3, 20))
    labels[1, 4:13] = IGNORE_INDEX  # tokens the loss skips (a prompt, under chat fine-tuning)
    plain = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten(), reduction="sum")
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    saved = []  # what forward keeps for backward, outside the per-chunk checkpoints

    def keep(tensor):
        saved.append(tensor.shape)
        return tensor
    with LargestLogits() as largest:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            chunked = chunked_cross_entropy(hidden, labels, torch.nn.Module(), LogitsWeight(weight), chunk_tokens)
        chunked_grads = torch.autograd.grad(chunked, (hidden, weight))
    assert not [shape for shape in saved if shape[-1] == VOCAB]  # no chunk's logits wait for backward
    return plain, plain_grads, chunked, chunked_grads, largest.rows


@pytest.mark.parametrize("chunk_tokens", [7, 60, 1000])  # a remainder chunk, one chunk exactly, one short chunk
def test_equals_plain_cross_entropy_and_holds_one_chunk_of_logits(chunk_tokens):
    plain, plain_grads, chunked, chunked_grads, rows = _plain_and_chunked(chunk_tokens)
    trained = 3 * 20 - 9  # sums over the trained tokens: 1e-6 per token, as for a mean
    assert abs(chunked.item() - plain.item()) <= 1e-6 * trained
    for ours, reference in zip(chunked_grads, plain_grads):
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6 * trained)
    assert rows == min(chunk_tokens, 60)  # forward and the recomputation in backward alike


def test_trains_like_the_plain_loss(titan_parity):
    # 256 tokens per step in chunks of 48: five full chunks and a remainder.
    report = titan_parity(["+plugins=[chunked_loss]", "plugins.chunked_loss.chunk_tokens=48"])
    assert report.max_loss_diff <= 1e-6 and report.max_param_diff <= PARAM_TOL, report


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["+plugins=[pp,tp,chunked_loss]", "plugins.pp.degree=2", "plugins.tp.degree=2"],
    ["+plugins=[fsdp,tp,chunked_loss]", "plugins.fsdp.degree=2", "plugins.fsdp.reshard_after_forward=always",
     "plugins.tp.degree=2", "plugins.tp.loss_parallel=false"],
    ["+plugins=[fsdp,chunked_loss,compile]", "plugins.fsdp.degree=2", "plugins.compile.compile_loss=true"],
], ids=["pp-tp-loss-parallel", "fsdp-reshard-always-tp-no-loss-parallel", "fsdp-compiled-loss"])
def test_composes_with_parallelism(titan_parity, overrides):
    report = titan_parity([*overrides, "plugins.chunked_loss.chunk_tokens=40"])
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report


@pytest.mark.parametrize("overrides, message", [
    (["model=qwen3_tiny", "model.tie_word_embeddings=true"],
     "plugins.chunked_loss: model 'qwen3' does not describe logits, which chunked cross entropy needs "
     "(ModelDescription.logits is None); fix: remove chunked_loss from +plugins=[...]"),
    (["plugins.chunked_loss.chunk_tokens=0"],
     "plugins.chunked_loss.chunk_tokens: 0 is not a positive integer; fix: set the number of tokens whose "
     "logits are computed at once, e.g. 1024"),
])
def test_refused_before_launch(tmp_path, overrides, message):
    result = run_job([*TINY, "+plugins=[chunked_loss]", *overrides, "launch.dry_run=true"], tmp_path / "run",
                     expect_success=False)
    assert error_line(result) == f"titan-core: error: {message}"
