"""Document-aware attention (training.attention_mask=block_causal): the mask from the tokens, the same
training under context, tensor and pipeline parallel as in one process, and the refusals."""

import json
import random

import pytest
import torch

from titan_core.attention import attention_mask, causal_attention, document_ids, masked_attention
from titan_core.testing import TINY, compare, error_line, install_plugins, run_job

LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # the parity harness's bounds


@pytest.fixture(scope="session")
def short_documents(tmp_path_factory):
    """Overrides for a corpus of documents of 2 to 12 bytes: most 32-token rows hold several of them."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("short-documents") / "documents.jsonl"
    path.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(2, 12)))})
                            + "\n" for _ in range(2000)))
    return ("data.source=local", f"data.path={path}")


def test_documents_start_at_every_bos():
    tokens = torch.tensor([[7, 1, 5, 5, 1, 6], [1, 2, 3, 1, 1, 4]])
    assert document_ids(tokens, bos_id=1).tolist() == [[0, 1, 1, 1, 2, 2], [1, 1, 1, 2, 3, 3]]
    mask = attention_mask(torch.arange(6), torch.arange(6), document_ids(tokens, 1), document_ids(tokens, 1))
    assert mask[0].int().tolist() == [[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0],
                                      [0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]


def test_one_document_is_plain_causal_attention():
    q, k, v = torch.randn(3, 2, 4, 9, 8).unbind(0)
    torch.testing.assert_close(causal_attention(q, k, v, torch.zeros(2, 9, dtype=torch.long)),
                               causal_attention(q, k, v), rtol=0, atol=1e-6)


def _kept_masks(calls) -> set[int]:
    """The storages of the masks autograd keeps over ``calls``: (batch, 1, queries, keys) tensors."""
    kept = set()

    def pack(tensor):
        if tensor.dim() == 4 and tensor.shape[1] == 1:
            kept.add(tensor.untyped_storage().data_ptr())
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        calls()
    return kept


def test_the_blocks_of_a_micro_batch_keep_one_mask_between_them():
    """The fused kernels keep the mask they are handed for backward, and turn a boolean one into a new tensor of the
    queries' dtype first, in every block (Llama 3 8B with documents at 2 x 8,192 tokens: 8 GiB over 32 blocks in
    bf16): four blocks' attention with documents keeps one mask, with a window in every other block two, with sinks
    too; the attention is the boolean mask's to the last bit, its gradients alike."""
    q, k, v = (torch.randn(2, 4, 9, 16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, requires_grad=True)
    documents = document_ids(torch.tensor([[1, 5, 1, 5, 5, 1, 5, 5, 5], [5, 5, 1, 5, 5, 5, 5, 1, 5]]), bos_id=1)

    def blocks(windows, sink):
        return [causal_attention(q, k, v, documents, window=window, sinks=sink) for window in windows]
    assert len(_kept_masks(lambda: blocks([None] * 4, None))) == 1
    assert len(_kept_masks(lambda: blocks([3, None, 3, None], sinks))) == 2
    assert len(_kept_masks(lambda: blocks([3, None, 3, None], None))) == 2
    positions = torch.arange(9)
    for window, sink in ((None, None), (3, sinks)):
        shared = causal_attention(q, k, v, documents, window=window, sinks=sink)
        alone = masked_attention(q, k, v, attention_mask(positions, positions, documents, documents, window), sink)
        assert torch.equal(shared, alone)
        leaves = [q, k, v] + ([sinks] if sink is not None else [])
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(shared.sum(), leaves),
                                                     torch.autograd.grad(alone.sum(), leaves)))


@pytest.fixture(scope="session")
def block_causal_reference(titan_reference, short_documents):
    reference = titan_reference((*short_documents, "training.attention_mask=block_causal"))
    causal = titan_reference(short_documents)
    # The mask matters on this data: the same model trained causally sees other documents.
    assert max(abs(a - b) for a, b in zip(reference.losses, causal.losses)) > 1e-2
    return reference


# A plugin written from docs/writing-plugins.md: the core's masked attention routed through a mask of its own,
# made once a micro-batch (shared_mask), counting the masks it makes.
MASK_ROUTER = """
import contextlib
from pathlib import Path

import torch

from titan_core import attention_mask, hookimpl, masked_attention, route_masked_attention, shared_mask


@hookimpl
def batch_context(plugin_config):
    \"\"\"maskrouter: each block's masked attention with the micro-batch's one mask; writes how many it made.\"\"\"
    made = []

    def attend(q, k, v, document_ids, window, sinks):
        positions = torch.arange(q.shape[2], device=q.device)

        def make():
            made.append(window)
            return attention_mask(positions, positions, document_ids, document_ids, window)
        return masked_attention(q, k, v, shared_mask(document_ids, (window,), make, sinks is not None, q.dtype), sinks)

    @contextlib.contextmanager
    def routed():
        with route_masked_attention(attend):
            yield
        with Path(plugin_config.out).open("a") as counts:
            counts.write(f"{len(made)}\\n")
    return routed()
"""


def test_an_outsiders_masked_attention_makes_one_mask_a_micro_batch(short_documents, tmp_path):
    """shared_mask, used by a plugin written from docs/writing-plugins.md that routes the core's masked attention:
    the tiny Llama's four blocks share one mask a micro-batch (two micro-batches a step), and it trains like the
    core's own masked attention."""
    counts = tmp_path / "counts"
    env = install_plugins(tmp_path / "site", {"maskrouter": (MASK_ROUTER, f"out: {counts}\n")}, "maskrouter-plugin")
    result = run_job([*TINY, *short_documents, "training.attention_mask=block_causal", "+plugins=[maskrouter]",
                      "training.grad_accum_steps=2"], tmp_path / "run", env=env)
    assert counts.read_text().split() == ["1"] * 10  # 5 steps of 2 micro-batches
    reference = run_job([*TINY, *short_documents, "training.attention_mask=block_causal",
                         "training.grad_accum_steps=2"], tmp_path / "reference")
    report = compare(result, reference)
    assert report.max_loss_diff == 0 and report.max_param_diff == 0, report


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["+plugins=[cp]", "plugins.cp.degree=2"],
    ["+plugins=[pp,tp,ac,compile]", "plugins.pp.degree=2", "plugins.pp.schedule=1F1B", "plugins.tp.degree=2"],
], ids=["cp2", "pp2-tp2-ac-compile"])
def test_block_causal_under_parallelism_matches_one_process(overrides, block_causal_reference, short_documents,
                                                          tmp_path):
    result = run_job([*TINY, *short_documents, "training.attention_mask=block_causal", *overrides], tmp_path / "run")
    report = compare(result, block_causal_reference)
    print(f"block_causal {' '.join(overrides)}: {report}")
    assert report.max_loss_diff <= LOSS_TOL and report.max_param_diff <= PARAM_TOL, report


@pytest.mark.parametrize("overrides, message", [
    (["training.attention_mask=per_document"],
     "training.attention_mask: unknown mask 'per_document'; fix: use one of causal, block_causal"),
    (["model=gpt2_tiny", "training.attention_mask=block_causal"],
     "training.attention_mask: model 'gpt2' attends through 'sdpa_causal', which cannot mask documents "
     "(block_causal needs ModelDescription.attention = 'titan_core.attention'); fix: set "
     "training.attention_mask=causal"),
])
def test_refused_before_launch(tmp_path, overrides, message):
    result = run_job([*TINY, *overrides, "launch.dry_run=true"], tmp_path / "run", expect_success=False)
    assert error_line(result) == f"titan-core: error: {message}"


def eager_attention(q, k, v, mask, sinks=None):
    """transformers' eager reference: grouped keys repeated, the sink as one more softmax column, dropped after."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)], dim=-1)
    return scores.softmax(-1)[..., :k.shape[2]] @ v


def test_sliding_windows_and_sinks_match_eager_attention_with_their_gradients():
    torch.manual_seed(0)
    q = torch.randn(2, 8, 12, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(8, requires_grad=True)
    documents = torch.tensor([[0] * 5 + [1] * 7, [1] * 12])
    positions = torch.arange(12)
    for window, docs in ((4, None), (None, documents), (3, documents)):
        mask = attention_mask(positions, positions, docs, docs, window)
        ours = causal_attention(q, k, v, docs, window=window, sinks=sinks)
        reference = eager_attention(q, k, v, mask, sinks)
        torch.testing.assert_close(ours, reference, rtol=0, atol=2e-6)
        grad = torch.randn_like(ours)
        for a, b in zip(torch.autograd.grad(ours, (q, k, v, sinks), grad),
                        torch.autograd.grad(reference, (q, k, v, sinks), grad)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # Each knob changes the result well beyond those bounds (a mask or a sink left out would show).
    plain = causal_attention(q, k, v)
    assert (causal_attention(q, k, v, window=4) - plain).abs().max() > 0.1
    assert (causal_attention(q, k, v, sinks=sinks) - plain).abs().max() > 0.1
    assert attention_mask(positions, positions, window=3)[0, 5].nonzero().flatten().tolist() == [3, 4, 5]
