"""Everything the cp plugin takes from torch's private context-parallel internals, pinned to torch 2.13.

The ring's options (rotation, load balancing) are process-wide private settings, and ring attention
for torch's CPU SDPA kernel, which torch 2.13's ``context_parallel`` has no rule for, is added here.
Under ``context_parallel`` SDPA receives DTensors sharded on the sequence, and DTensor dispatch looks
their op up in a table of context-parallel handlers. That table holds the CUDA flash, efficient and
cuDNN kernels only; on CPU, SDPA runs ``_scaled_dot_product_flash_attention_for_cpu`` and dispatch
fails for want of a sharding strategy. The handlers below fill that gap by handing the CPU kernel to
torch's own ring templates (the key/value rotation, the causal skipping of load balancing and the
log-sum-exp merge), so nothing of the algorithm is reimplemented here.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

PINNED_TORCH = "2.13."
# q, k, v and the output are (batch, heads, seq, head_dim), the log-sum-exp (batch, heads, seq).
SEQ_DIM = 2
aten = torch.ops.aten


def pinned_torch_problem() -> str | None:
    """Why this module cannot work with the installed torch, or None."""
    if torch.__version__.startswith(PINNED_TORCH):
        return None
    return (f"context parallel relies on private ring-attention internals of torch {PINNED_TORCH}x, "
            f"but torch {torch.__version__} is installed")


def _require_pinned_torch() -> None:
    problem = pinned_torch_problem()
    if problem:
        raise RuntimeError(problem)


def configure_ring(rotate_method: str, load_balance: bool) -> None:
    """Set the process-wide ring options that ``context_parallel`` reads when entered."""
    _require_pinned_torch()
    from torch.distributed.tensor.experimental._context_parallel import _cp_options, set_rotate_method

    set_rotate_method(rotate_method)
    _cp_options.enable_load_balance = load_balance


def register_cpu_ring_attention() -> None:
    """Add the CPU SDPA forward and backward to the context-parallel op table (idempotent)."""
    _require_pinned_torch()
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _ring_forward
    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _ring_backward


def _ring_forward(op, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    named, mesh = _local_named_args(op, args, kwargs)
    if named.pop("attn_mask", None) is not None:
        raise NotImplementedError("context parallel supports causal attention without a mask")
    out, logsumexp = _templated_ring_attention(mesh.get_group(), SEQ_DIM,
                                               aten._scaled_dot_product_flash_attention_for_cpu, **named)
    return _sequence_sharded(mesh, out, logsumexp)


def _ring_backward(op, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward)

    named, mesh = _local_named_args(op, args, kwargs)
    named.pop("attn_mask", None)  # the forward refused masks
    grads = _templated_ring_attention_backward(mesh.get_group(), SEQ_DIM, op, grad_out_name="grad_out", **named)
    return _sequence_sharded(mesh, *grads)


def _local_named_args(op, args, kwargs):
    """The op's arguments by schema name, DTensors replaced by their local shards, and their mesh."""
    named = {**dict(zip((a.name for a in op._schema.arguments), args)), **kwargs}
    mesh = named["query"].device_mesh
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in named.items()}, mesh


def _sequence_sharded(mesh, *tensors):
    return tuple(DTensor.from_local(t, mesh, (Shard(SEQ_DIM),), run_check=False) for t in tensors)
