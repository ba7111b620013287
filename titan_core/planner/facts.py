"""What the planner measures of a model itself: its parameters and the activations autograd keeps, per token.

Nothing is allocated: the model plugin builds the model on the meta device, and one forward of a few tokens
and the core's loss runs on meta tensors while ``saved_tensors_hooks`` record each tensor autograd keeps for
backward (parameters and buffers left out). Attention is counted as the fused kernels GPUs run keep it
(query, key, value, output and one float per head and token), not as the score matrix meta tensors would
materialize, so every figure is linear in the tokens and a trace of a few tokens prices any sequence length.
The core's mixture-of-experts layer routes by value, which meta tensors lack: while tracing, each expert receives an
equal share of the token copies (the load balancing aims at), run as one batch per expert. Any model plugin is
measured this way: its description needs nothing more (a model with its own experts' layer must route without
values). A job under the core's autocast (float32 weights, products in a narrower dtype) is traced so, on fake
CPU tensors: meta tensors have no autocast.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import titan_core.attention as attention
from titan_core.description import ModelDescription
from titan_core.errors import ConfigError
from titan_core.metrics import trained_flops_per_token
from titan_core.moe.layer import MoE
from titan_core.parameter_roles import parameter_role
from titan_core.planner.cuda_autocast import cuda_autocast_policy

# Positions traced (at most): enough for every shape to be general, few enough to be instant for 405B.
TRACE_TOKENS = 64
MATMULS = ("mm", "_scaled_mm", "addmm")  # a linear's matmul: in full precision, in float8, with its bias
# Every matrix product's op (the linears' and the experts'), and which argument's last dimension it sums over.
PRODUCTS = {"mm": 0, "_scaled_mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1, "_grouped_mm": 0}
ALTERNATE_MATMULS = "every other matmul"  # block_made's key for the 1st, 3rd, ... matmul of a block


@dataclass(frozen=True)
class LinearSizes:
    """One linear of a block: elements per token of its input and of its result, its weight's elements."""

    inputs: float = 0.0
    outputs: float = 0.0
    weights: float = 0  # a rank's share of a split weight is fractional


@dataclass(frozen=True)
class ModelFacts:
    """One model's parameter counts and kept activations (bytes per token, in the dtype it was traced in).

    ``block_params[i]``/``block_saved[i]``: block ``i``; ``inputs_params``/``outputs_params``: the modules the
    description names as run before / after the blocks (embeddings; final norm and output); ``block_trained[i]``,
    ``inputs_trained``, ``outputs_trained``, ``other_trained``: those of each that train (``requires_grad``: a frozen
    model's adapters, a frozen stage's none), and ``trained_flops`` the training FLOPs per token it computes
    (:func:`titan_core.metrics.trained_flops_per_token`); ``outer_saved``:
    what the inputs, outputs and the loss keep (the logits, in float32 for the loss), of which ``outer_logits``
    have the logits' shape (what loss parallel splits by vocabulary); ``block_input``: the
    residual stream entering a block, what full checkpointing keeps of it; ``block_stream_saved[i]``: the part
    of ``block_saved[i]`` shaped like that stream, or flattened to rows of its width (what tensor parallel leaves
    whole: it splits heads and hidden units, not the stream); ``block_made[i]``: bytes per token of the results
    of each aten op of block ``i``, by op name (what selective checkpointing chooses among), and of its 1st,
    3rd, ... matmuls (:meth:`made_by` with ``every_other_matmul``); ``block_product_flops[i]``: forward FLOPs per
    token of block ``i``'s matrix products, by op name and likewise (what selective checkpointing runs again of
    them: :meth:`rerun_flops`);
    ``attention_kv``: bytes per token of one block's attention keys and values (what context parallel moves);
    ``attention_masks``: bytes per query and key of each mask the blocks' attention hands the fused kernels, which
    keep them for backward (each once, however many blocks share it; a boolean mask once per block, as the kernels
    convert it): per row when the job masks by document (traced with document ids), else one set for every
    micro-batch of that length;
    ``buffer_bytes``: the model's buffers (RoPE tables), as built, in bytes; ``block_backward[i]``: the most
    that block ``i``'s backward holds at once beyond what it started with (its ops' gradients, its input's);
    ``block_forward[i]``: the most block ``i``'s forward holds at once beyond what it keeps once it has run (results
    it has not let go yet, less what it has yet to keep): what a block recomputing in backward holds beyond
    its kept activations as its forward runs again;
    ``loss_backward``: the same for the loss and the outputs, as backward starts (the logits' gradients);
    ``output``: bytes per token of what the model's forward returns (the logits, in the traced dtype);
    ``block_ops[i]``: aten operators block ``i``'s forward and backward run, ``outer_ops``: those of the rest
    and the loss (what the host issues one by one, whatever the tokens); ``parameter_tensors``: the model's,
    ``largest_parameter``: the elements of the largest of them, ``largest_role``: those of the role with the most
    (the core's largest parameter group);
    ``parameter_roles``: the roles among them (the core's optimizer steps one parameter group per role).
    ``block_param_results[i]``: bytes per token of the results of block ``i``'s ops that read a parameter (its
    weights' matmuls, its norms' scales): the gradients a backward split in two keeps from its input half for its
    weight half.
    ``block_linears[i]``: block ``i``'s linears (its matmuls that read a weight) by the path of their module within
    the block, each's :class:`LinearSizes` (what a plugin converting linears casts; the result's shape is its
    gradient's; an input two linears read counts for each, as each casts it on its own).
    ``block_expert_params[i]``: the parameters of block ``i``'s experts module (``ModelDescription.experts``; 0 in a
    dense block), ``block_expert_input[i]``: bytes per token of the token copies entering it (what expert parallel
    sends to the experts' ranks and back), ``block_expert_copies[i]``: how many copies of each token enter it,
    ``block_expert_saved[i]``: the part of ``block_saved[i]`` its experts module keeps, all three evenly routed
    (what grows with uneven routing: ``Estimate.expert_load``).
    ``block_weight_casts[i]``/``outer_weight_casts``: bytes of the copies in the compute dtype that autocast makes of
    block ``i``'s weights and of the rest's (the output layer's) when traced under it (float32 weights; 0
    otherwise), which its cache keeps until the micro-batch's backward has run.
    """

    block_params: tuple[int, ...]
    inputs_params: int
    outputs_params: int
    other_params: int
    block_saved: tuple[float, ...]
    block_stream_saved: tuple[float, ...]
    block_input: float
    outer_saved: float
    outer_logits: float
    block_made: tuple[dict[str, float], ...]
    block_product_flops: tuple[dict[str, float], ...]
    attention_kv: float
    attention_masks: tuple[float, ...]
    buffer_bytes: int
    block_backward: tuple[float, ...]
    block_forward: tuple[float, ...]
    block_param_results: tuple[float, ...]
    block_linears: tuple[dict[str, LinearSizes], ...]
    loss_backward: float
    output: float
    block_ops: tuple[int, ...]
    outer_ops: int
    parameter_tensors: int
    largest_parameter: int
    largest_role: int
    parameter_roles: int
    block_expert_params: tuple[int, ...]
    block_expert_input: tuple[float, ...]
    block_expert_copies: tuple[float, ...]
    block_expert_saved: tuple[float, ...]
    block_trained: tuple[int, ...]
    inputs_trained: int
    outputs_trained: int
    other_trained: int
    trained_flops: float | None
    block_weight_casts: tuple[int, ...]
    outer_weight_casts: int

    @property
    def params(self) -> int:
        return sum(self.block_params) + self.inputs_params + self.outputs_params + self.other_params

    def made_by(self, index: int, ops, every_other_matmul: bool = False) -> float:
        """Bytes per token of block ``index``'s results of the named aten ops (``attention``: the attention's
        output and log-sum-exp, whichever kernel computes it); of its matmuls among them only the 1st, 3rd, ...
        with ``every_other_matmul``."""
        return _of(self.block_made[index], ops, every_other_matmul)

    def rerun_flops(self, index: int, ops, every_other_matmul: bool = False) -> float:
        """Forward FLOPs per token of block ``index``'s matrix products whose results a selective checkpoint
        keeping those of ``ops`` (as :meth:`made_by` takes them) does not keep, and so runs again in backward."""
        flops = self.block_product_flops[index]
        return sum(v for op, v in flops.items() if op != ALTERNATE_MATMULS) - _of(flops, ops, every_other_matmul)

    @functools.cached_property
    def with_fused_loss(self) -> ModelFacts:
        """The same model's facts with its loss compiled into fused kernels (by inductor; TorchTitan compiles its
        loss with its blocks since April 2025): the loss keeps the logits
        as the model returned them instead of their float32 log-probabilities, and its backward holds only their
        gradient, in that dtype, instead of float32 ones (measured on this CPU, tests/loss_memory.py: 2 and
        2 bytes per token and vocabulary entry for bf16 logits, against eager's 4 and 8)."""
        return replace(self, outer_saved=self.outer_saved - self.outer_logits + self.output,
                       outer_logits=self.output, loss_backward=self.output)


def _of(table: dict[str, float], ops, every_other_matmul: bool) -> float:
    if every_other_matmul and set(ops) & set(MATMULS):
        ops = [op for op in ops if op not in MATMULS] + [ALTERNATE_MATMULS]
    return sum(value for op, value in table.items() if op in ops)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storages(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


class _Tracer(TorchDispatchMode):
    """Records, per block, what autograd keeps and what each aten op makes, as bytes per token."""

    active: _Tracer | None = None

    def __init__(self, positions: int, parameters: dict[int, str], buffers: set[int], n_blocks: int, autocast: bool):
        super().__init__()
        # Each parameter's storage, and the path of its module within its block ("" outside the blocks).
        self.positions, self.parameters, self.learned = positions, parameters, set(parameters) | buffers
        self.autocast = autocast  # the weights' copies are autocast's, held whatever the tokens
        self.block: int | None = None  # the block running, None outside the blocks
        self.counting: int | None = None  # the block whose forward or backward runs, None outside the blocks
        self.ops = [0] * (n_blocks + 1)  # per block, and last the operators outside the blocks
        self.kept_alive: list[torch.Tensor] = []  # so that no other storage reuses a recorded one's address
        self.saved: dict[int, tuple[int | None, int, tuple[int, ...]]] = {}  # storage -> block, bytes, shape
        self.made: list[dict[str, float]] = [{} for _ in range(n_blocks)]
        self.product_flops: list[dict[str, float]] = [{} for _ in range(n_blocks)]
        self.param_results = [0.0] * n_blocks
        self.linears: list[dict[str, LinearSizes]] = [{} for _ in range(n_blocks)]
        self.matmuls = 0  # of the block being traced
        self.block_input = 0.0
        self.stream_shape: tuple[int, ...] = ()
        self.attention_kv = 0.0
        self.masks: dict[int, float] = {}  # the masks the kernels keep: by storage, bytes per query and key
        self.mask_keys: set[int] = set()  # their allocations, which no block's forward holds as its own
        self.expert_input = [0.0] * n_blocks
        self.expert_copies = [0.0] * n_blocks
        self.expert_saved = [0.0] * n_blocks
        self.in_experts = False  # an experts module runs: what autograd keeps now is theirs
        self.weight_casts = [0] * (n_blocks + 1)  # per block, and last outside the blocks
        self.copies: list[torch.Tensor] = []
        # Every allocation and free in order, and where each block's forward and backward start and end.
        self.timeline: list[tuple[str, int, int]] = []
        self.ends_with_backward: set[int] = set()  # blocks whose inputs need no gradient
        self.alive: dict[int, int] = {}  # id of a live storage -> its key
        self.next_key = 0
        self.saved_keys: set[int] = set()  # the allocations autograd keeps

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Autograd detached the tensor to hand it to this hook, an operator a step without the hook does not run.
        self.ops[-1 if self.counting is None else self.counting] -= 1
        storage = tensor.untyped_storage()
        if id(storage) in self.alive:
            self.saved_keys.add(self.alive[id(storage)])
        if storage._cdata not in self.learned and storage._cdata not in self.saved:
            self.kept_alive.append(tensor)
            self.saved[storage._cdata] = (self.block, storage.nbytes(), tuple(tensor.shape))
            if self.in_experts:
                self.expert_saved[self._running_block()] += storage.nbytes() / self.positions
        return tensor

    def record(self, name: str, args, *results: torch.Tensor, reads_parameter: bool = False) -> None:
        if self.block is not None:
            made, nbytes = self.made[self.block], sum(map(_nbytes, results)) / self.positions
            flops = self.product_flops[self.block]
            # A product's FLOPs: two per output element and summed term (a grouped product's row is in one group).
            product = (2 * results[0].numel() * args[PRODUCTS[name]].shape[-1] / self.positions
                       if name in PRODUCTS else 0.0)
            keys = [name]
            if name in MATMULS:
                self.matmuls += 1
                if self.matmuls % 2:
                    keys.append(ALTERNATE_MATMULS)
            for key in keys:
                made[key] = made.get(key, 0.0) + nbytes
                if product:
                    flops[key] = flops.get(key, 0.0) + product
            if name in MATMULS and reads_parameter:
                weight = args[PRODUCTS[name] + 1]
                path = self.parameters.get(weight.untyped_storage()._cdata, "")
                linears = self.linears[self.block]
                seen = linears.get(path, LinearSizes())
                linears[path] = LinearSizes(seen.inputs + args[PRODUCTS[name]].numel() / self.positions,
                                            seen.outputs + results[0].numel() / self.positions,
                                            seen.weights + weight.numel())

    def _reads_parameter(self, args) -> bool:
        return any(isinstance(a, torch.Tensor) and a.untyped_storage()._cdata in self.parameters
                   for a in pytree.tree_leaves(args))

    def enter(self, index: int, module, args) -> None:
        if not args[0].requires_grad:  # a frozen model's (LoRA's) first block: its backward runs to the end
            self.ends_with_backward.add(index)
        self.block = self.counting = index
        self.matmuls = 0
        self.block_input = _nbytes(args[0]) / self.positions
        self.stream_shape = tuple(args[0].shape)
        self.timeline.append(("forward", index, 0))

    def _running_block(self) -> int:
        """The block running, where only a block runs (its experts, the end of its forward)."""
        assert self.block is not None, "no block is running"
        return self.block

    def enter_experts(self, copies: int, nbytes: int) -> None:
        """The token copies entering the running block's experts: how many, and their bytes."""
        block = self._running_block()
        self.expert_copies[block] += copies / self.positions
        self.expert_input[block] += nbytes / self.positions
        self.in_experts = True

    def leave_experts(self, *_) -> None:
        self.in_experts = False

    def leave(self, module, args, output) -> None:
        self.timeline.append(("left", self._running_block(), 0))
        self.block = self.counting = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[-1 if self.counting is None else self.counting] += 1
        if (self.autocast and func is torch.ops.aten._to_copy.default
                and args[0].untyped_storage()._cdata in self.parameters):
            # Autocast's copy of a weight in the compute dtype: a weight to the rest of the trace, whatever the tokens
            # (kept so that no later tensor takes its storage's address).
            self.copies.append(out)
            copy = out.untyped_storage()
            self.parameters[copy._cdata] = self.parameters[args[0].untyped_storage()._cdata]
            self.learned.add(copy._cdata)
            self.weight_casts[-1 if self.block is None else self.block] += copy.nbytes()
        results = [r for r in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(r, torch.Tensor)]
        reads_parameter = self.block is not None and self._reads_parameter(args)
        self.record(func.overloadpacket.__name__, args, *results, reads_parameter=reads_parameter)
        if reads_parameter and self.block is not None:  # (reads_parameter implies a block: for the type checker)
            self.param_results[self.block] += sum(_nbytes(r) for r in results
                                                  if r.untyped_storage()._cdata not in self.learned) / self.positions
        for result in results:
            self.allocated(result.untyped_storage())
        return out

    def allocated(self, storage) -> None:
        if id(storage) in self.alive or storage._cdata in self.learned:
            return
        key, nbytes = self.next_key, storage.nbytes()
        self.next_key += 1
        self.alive[id(storage)] = key
        self.timeline.append(("+", key, nbytes))
        weakref.finalize(storage, self.freed, id(storage), key, nbytes)

    def freed(self, storage_id: int, key: int, nbytes: int) -> None:
        self.alive.pop(storage_id, None)
        self.timeline.append(("-", key, nbytes))

    def kept_mask(self, mask: torch.Tensor, q: torch.Tensor) -> None:
        """A mask handed to the fused kernel, which keeps it for backward: a boolean one converted into a new one
        of the queries' dtype (every call), another as it is (once, however many calls share it)."""
        pairs = mask.shape[0] * mask.shape[-2] * mask.shape[-1]
        if mask.dtype == torch.bool:
            self.masks[-len(self.masks) - 1] = q.element_size()
            return
        storage = mask.untyped_storage()
        self.masks[storage._cdata] = storage.nbytes() / pairs
        if id(storage) in self.alive:
            self.mask_keys.add(self.alive[id(storage)])

    def mark(self, what: str, index: int, *_) -> None:
        if what == "end" and index in self.ends_with_backward:
            return  # its full backward hook fires as its backward starts: no input of it needs a gradient
        self.timeline.append((what, index, 0))
        self.counting = index if what == "start" else None

    def backward_ended(self) -> None:
        """The end of the backward of the blocks whose inputs need no gradient."""
        self.timeline += [("end", index, 0) for index in sorted(self.ends_with_backward)]
        self.counting = None

    def forward_peaks(self, n_blocks: int) -> list[float]:
        """Per block, the most its forward held at once beyond what autograd keeps of it once it has run."""
        made: set[int]
        peaks, current, made, live, most, kept = [0.0] * n_blocks, None, set(), 0, 0, 0
        for what, key, nbytes in self.timeline:
            if what == "forward":
                current, made, live, most, kept = key, set(), 0, 0, 0
            elif current is not None and what == "left":
                peaks[current] = max(peaks[current], most - kept)
                current = None
            elif current is not None and what == "+" and key not in self.mask_keys:
                made.add(key)
                live += nbytes
                kept += nbytes if key in self.saved_keys else 0
                most = max(most, live)
            elif current is not None and what == "-" and key in made:
                live -= nbytes
        return [p / self.positions for p in peaks]

    def backward_peaks(self, gradients: set[int], n_blocks: int) -> tuple[list[float], float]:
        """Per block, the most its backward held at once beyond what it started with, and the same for what
        runs before the last block's backward (the loss and the outputs); weights' gradients left out."""
        live, start, peaks, current = 0, 0, [0.0] * n_blocks, None
        loss_peak, before_blocks = 0, True
        for what, key, nbytes in self.timeline:
            if what in "+-":
                if key not in gradients:
                    live += nbytes if what == "+" else -nbytes
            elif what == "start":
                if before_blocks:
                    loss_peak, before_blocks = loss_peak - start, False
                current, start = key, live
            elif what == "end":
                current = None
            elif what == "backward":
                start = loss_peak = live
            if current is not None:
                peaks[current] = max(peaks[current], live - start)
            elif before_blocks:
                loss_peak = max(loss_peak, live)
        return [p / self.positions for p in peaks], (loss_peak if not before_blocks else 0) / self.positions


class _FusedAttention(torch.autograd.Function):
    """What a GPU's fused attention keeps for backward, on meta tensors: q, k, v, the output, the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask = mask  # held as the kernel holds it, counted apart (Tracer.kept_mask): blocks share one
        tracer = _Tracer.active
        assert tracer is not None  # the fused attention is swapped in only while a tracer runs
        tracer.record("attention", (q, k, v), out, lse)
        tracer.attention_kv = max(tracer.attention_kv, (_nbytes(k) + _nbytes(v)) / tracer.positions)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _fused_attention(q, k, v, *args, attn_mask=None, **kwargs):
    if attn_mask is not None:
        tracer = _Tracer.active
        assert tracer is not None  # swapped in only while a tracer runs
        tracer.kept_mask(attn_mask, q)
    return _FusedAttention.apply(q, k, v, attn_mask)


def _evenly_routed(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The core MoE's forward with every expert given an equal share of the token copies (rounded up)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    weights, experts, _ = moe.gate(x)
    copies = experts.numel()
    share = -(-copies // moe.num_experts)
    token = torch.arange(copies, device=x.device) // experts.shape[1]
    routed = x[token]  # held while the experts compute, as the layer's call holds its argument
    tracer = _Tracer.active
    assert tracer is not None, "the MoE runs evenly routed only while a tracer traces it"
    tracer.enter_experts(copies, _nbytes(routed))
    padded = routed[torch.arange(moe.num_experts * share, device=x.device) % copies]
    out = moe.experts.batched(padded.unflatten(0, (moe.num_experts, share))).flatten(0, 1)[:copies]
    tracer.leave_experts()
    out = torch.zeros_like(x).index_add(0, token, out * weights.flatten()[:, None])
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out.reshape(shape)


@contextlib.contextmanager
def _patched(owner, name, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _tracing_patches():
    """Attention counted as the fused kernels keep it (plain causal, and the seam's masked kernel); the core's
    experts evenly loaded."""
    return (_patched(F, "scaled_dot_product_attention", _fused_attention),
            _patched(attention, "_local_sdpa", _fused_attention), _patched(MoE, "forward", _evenly_routed))


def model_facts(description: ModelDescription, build, dtype: torch.dtype, seq_len: int,
                documents: bool = False, autocast: bool = False, device_type: str = "cpu") -> ModelFacts:
    """The facts of the model ``description`` describes, built by ``build(description=...)`` (the model
    plugin's ``build_model`` hook) and traced in ``dtype`` on at most ``TRACE_TOKENS`` of ``seq_len`` positions;
    with ``documents``, its forward given document ids as a job masking by document gives them; with
    ``autocast``, its weights left float32 and its forward run under autocast to ``dtype``, as the core's step
    runs it without a plugin providing mixed precision, with the ops a ``device_type`` autocasts otherwise than
    the CPU run as it runs them (:mod:`titan_core.planner.cuda_autocast`)."""
    with FakeTensorMode() if autocast else contextlib.nullcontext():
        return _traced_facts(description, build, dtype, seq_len, documents, device_type if autocast else None)


def _hooked_tracer(model, description, blocks: list, seq_len: int, autocast: bool) -> _Tracer:
    """A tracer of ``model`` whose blocks (and a model's own experts modules) tell it when they run."""
    paths = {p.untyped_storage()._cdata: "" for p in model.parameters()}
    for block in blocks:
        paths.update((p.untyped_storage()._cdata, name.rpartition(".")[0]) for name, p in block.named_parameters())
    tracer = _Tracer(min(TRACE_TOKENS, seq_len), paths, _storages(model.buffers()), len(blocks), autocast)
    for index, block in enumerate(blocks):
        block.register_forward_pre_hook(functools.partial(tracer.enter, index))
        block.register_forward_hook(tracer.leave)
        block.register_full_backward_pre_hook(functools.partial(tracer.mark, "start", index))
        block.register_full_backward_hook(functools.partial(tracer.mark, "end", index))
        experts = description.experts_of(block)
        if experts is not None:  # a model's own experts module (the core's runs evenly routed, below)
            experts.register_forward_pre_hook(lambda module, args: tracer.enter_experts(len(args[0]), _nbytes(args[0])))
            experts.register_forward_hook(tracer.leave_experts)
    return tracer


def _saved_per_token(tracer: _Tracer, blocks: int, logits) -> tuple[list[float], list[float], float, float]:
    """Bytes per token kept for backward: by each block, of it the residual stream, outside the blocks, and of that
    the logits."""
    per_block, streams, outer, outer_logits = [0.0] * blocks, [0.0] * blocks, 0.0, 0.0
    for block, nbytes, shape in tracer.saved.values():
        if block is None:
            outer += nbytes / tracer.positions
            outer_logits += nbytes / tracer.positions if shape[-1:] == logits.shape[-1:] else 0.0
        else:
            per_block[block] += nbytes / tracer.positions
            # The stream as saved: its shape, or flattened to rows of its width (a linear's input).
            stream = shape[-1:] == tracer.stream_shape[-1:] and math.prod(shape) == math.prod(tracer.stream_shape)
            streams[block] += nbytes / tracer.positions if stream else 0.0
    return per_block, streams, outer, outer_logits


def _parameter_counts(model, description, blocks: list, seq_len: int) -> dict:
    """The :class:`ModelFacts` fields that count parameters: by block and outer part, all of them and those that
    train, and the training FLOPs per token without frozen weights' gradients."""
    ends = {group: [p for path in paths or () for p in model.get_submodule(path).parameters()]
            for group, paths in (("inputs", description.inputs), ("outputs", description.outputs))}
    counts = {group: sum(p.numel() for p in parameters) for group, parameters in ends.items()}
    trained = {group: sum(p.numel() for p in parameters if p.requires_grad) for group, parameters in ends.items()}
    block_params = tuple(sum(p.numel() for p in block.parameters()) for block in blocks)
    block_trained = tuple(sum(p.numel() for p in block.parameters() if p.requires_grad) for block in blocks)
    other = sum(p.numel() for p in model.parameters()) - sum(block_params) - counts["inputs"] - counts["outputs"]
    other_trained = (sum(p.numel() for p in model.parameters() if p.requires_grad) - sum(block_trained)
                     - trained["inputs"] - trained["outputs"])
    return dict(block_params=block_params, inputs_params=counts["inputs"], outputs_params=counts["outputs"],
                other_params=other, block_trained=block_trained, inputs_trained=trained["inputs"],
                outputs_trained=trained["outputs"], other_trained=other_trained,
                trained_flops=trained_flops_per_token(model, description, seq_len)[0])


def _traced_facts(description, build, dtype: torch.dtype, seq_len: int, documents: bool,
                  autocast: str | None) -> ModelFacts:
    """``autocast``: the device type whose autocast the forward runs under (on fake CPU tensors), or None."""
    device = "meta" if autocast is None else "cpu"  # fake CPU tensors under autocast
    with torch.device(device):
        model = build(description=description)
    buffer_bytes = sum(_nbytes(b) for b in model.buffers())
    roles: dict[str, int] = {}
    for name, parameter in model.named_parameters():
        role = parameter_role(description, name, parameter)
        roles[role] = roles.get(role, 0) + parameter.numel()
    if autocast is None:
        model.to(dtype)
    blocks = list(description.blocks_of(model).values()) if description.blocks else []
    tracer = _hooked_tracer(model, description, blocks, seq_len, autocast is not None)
    tokens = torch.zeros(1, tracer.positions, dtype=torch.long, device=device)
    _Tracer.active = tracer
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t))
            for patch in _tracing_patches():
                stack.enter_context(patch)
            stack.enter_context(tracer)
            if autocast is not None:
                stack.enter_context(torch.autocast("cpu", dtype=dtype))
            if autocast == "cuda":
                stack.enter_context(cuda_autocast_policy())
            try:
                logits = model(tokens, document_ids=attention.document_ids(tokens, 0)) if documents else model(tokens)
            except (NotImplementedError, RuntimeError) as error:
                # A layer of the model's own that needs values (counting its tokens per expert) cannot run.
                raise ConfigError("model.name", f"model '{description.family}' cannot run on the meta device, which "
                                  f"the planner traces it on: {str(error).splitlines()[0]}",
                                  "plan a model whose forward needs no values (the core's MoE layer routes "
                                  "without them while planned)") from None
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        # Backward frees what forward kept as it goes: only autograd holds those tensors from here.
        tracer.kept_alive.clear()
        with contextlib.ExitStack() as stack:
            for patch in _tracing_patches():
                stack.enter_context(patch)
            stack.enter_context(tracer)
            tracer.mark("backward", -1)
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)  # handled: backward_ended
            loss.backward()
            tracer.backward_ended()
    finally:
        _Tracer.active = None
    gradients = {tracer.alive[id(p.grad.untyped_storage())] for p in model.parameters()
                 if p.grad is not None and id(p.grad.untyped_storage()) in tracer.alive}
    block_backward, loss_backward = tracer.backward_peaks(gradients, len(blocks))
    per_block, streams, outer, outer_logits = _saved_per_token(tracer, len(blocks), logits)
    return ModelFacts(**_parameter_counts(model, description, blocks, seq_len),
                      block_saved=tuple(per_block), block_stream_saved=tuple(streams), block_input=tracer.block_input,
                      outer_saved=outer, outer_logits=outer_logits, block_made=tuple(tracer.made),
                      block_product_flops=tuple(tracer.product_flops), attention_kv=tracer.attention_kv,
                      attention_masks=tuple(tracer.masks.values()),
                      buffer_bytes=buffer_bytes, block_backward=tuple(block_backward), loss_backward=loss_backward,
                      output=_nbytes(logits) / tracer.positions,
                      block_forward=tuple(tracer.forward_peaks(len(blocks))),
                      block_param_results=tuple(tracer.param_results),
                      block_linears=tuple(tracer.linears),
                      block_ops=tuple(tracer.ops[:-1]), outer_ops=tracer.ops[-1],
                      parameter_tensors=len(list(model.parameters())),
                      largest_parameter=max(p.numel() for p in model.parameters()),
                      parameter_roles=len(roles), largest_role=max(roles.values()),
                      block_expert_params=tuple(sum(p.numel() for p in experts.parameters()) if experts is not None else 0
                                                for experts in map(description.experts_of, blocks)),
                      block_expert_input=tuple(tracer.expert_input), block_expert_copies=tuple(tracer.expert_copies),
                      block_expert_saved=tuple(tracer.expert_saved),
                      block_weight_casts=tuple(tracer.weight_casts[:-1]), outer_weight_casts=tracer.weight_casts[-1])


class OperatorCounter(TorchDispatchMode):
    """Counts the aten operators run below it that ``counted(operator)`` accepts (all by default); a DTensor's
    operators reach it as their local ones and its collectives."""

    def __init__(self, counted=lambda operator: True):
        super().__init__()
        self.counted, self.calls = counted, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += bool(self.counted(func))
        return func(*args, **(kwargs or {}))


def timed_step(step, repeats: int) -> tuple[float, int]:
    """Seconds of one call of ``step`` (after a first, untimed one that also counts them) and the aten operators
    it runs: the host's cost of a forward and backward where arithmetic is negligible."""
    counter = OperatorCounter()
    with counter:
        step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats, counter.calls


class _Traffic(TorchDispatchMode):
    """Bytes the operators below it read (every tensor argument) and write (their results and the arguments
    they modify in place), and how many they are."""

    def __init__(self):
        super().__init__()
        self.bytes = self.operators = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.operators += 1
        written = {argument.name for argument in func._schema.arguments
                   if argument.alias_info is not None and argument.alias_info.is_write}
        named = dict(zip((argument.name for argument in func._schema.arguments), args)) | (kwargs or {})
        for name, value in named.items():
            for tensor in pytree.tree_leaves(value):
                if isinstance(tensor, torch.Tensor):
                    self.bytes += _nbytes(tensor) * (2 if name in written else 1)
        self.bytes += sum(_nbytes(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


class _Temporaries(TorchDispatchMode):
    """The most bytes the operators below it hold at once in tensors they made, beside the storages of
    ``existing`` tensors."""

    def __init__(self, existing):
        super().__init__()
        self.existing = {t.untyped_storage()._cdata for t in existing}
        self.live = self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in self.existing:
                    self.existing.add(storage._cdata)
                    self.live += storage.nbytes()
                    self.most = max(self.most, self.live)
                    weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.existing.discard(key)
        self.live -= nbytes


@dataclass(frozen=True)
class OptimizerFacts:
    """What the job's optimizer costs per parameter element: ``state`` bytes it keeps (AdamW's two float32
    moments: 8), ``traffic`` bytes one step moves through memory (its operators' reads and writes); the operators
    its step runs per parameter group and per parameter tensor (torch's batched AdamW: about 11 and 2); and what
    its step holds at once beyond the states, per element of a parameter group (torch's batched AdamW: one
    float32 copy of the group, 4) and per element of its largest tensor (an update one tensor at a time)."""

    state: float
    traffic: float
    operators_per_group: float
    operators_per_tensor: float
    temporaries_per_group: float
    temporaries_per_tensor: float

    def operators(self, groups: int, tensors: int) -> float:
        return self.operators_per_group * groups + self.operators_per_tensor * tensors

    def temporaries(self, group: float, largest_tensor: float) -> float:
        """Bytes the step holds at once beyond its states, over a group of ``group`` elements whose largest tensor
        has ``largest_tensor``."""
        return self.temporaries_per_group * group + self.temporaries_per_tensor * largest_tensor


def optimizer_facts(build_optimizer, config, elements: int = 1 << 14) -> OptimizerFacts:
    """The state and the traffic per parameter element of the job's optimizer (``build_optimizer``: the core's
    hook, as a worker calls it), measured on one float32 parameter, and its operators and its temporaries per
    group and per tensor, on one parameter, two and three: whatever plugin builds it is priced."""
    (traffic, one_tensor, state, _), (_, two_tensors, _, two_held), (*_, three_held) = (
        _stepped(build_optimizer, config, [elements] * tensors) for tensors in (1, 2, 3))
    per_tensor = two_tensors - one_tensor
    # What grows with the group, and what does not: an update one tensor at a time may still hold the previous
    # tensor's temporaries as it makes the next one's, so its tensors are counted from two on.
    held_per_group = (three_held - two_held) / elements
    return OptimizerFacts(state=state / elements, traffic=traffic / elements,
                          operators_per_group=one_tensor - per_tensor, operators_per_tensor=per_tensor,
                          temporaries_per_group=held_per_group,
                          temporaries_per_tensor=max(0.0, two_held / elements - 2 * held_per_group))


def _stepped(build_optimizer, config, sizes: list[int]) -> tuple[int, int, int, int]:
    """The bytes the second step of the job's optimizer moves over parameters of ``sizes`` elements (one group),
    the operators it runs, the bytes of per-element states it keeps, and the most bytes its third step holds at
    once beyond them."""
    holder = torch.nn.Module()
    for index, elements in enumerate(sizes):
        holder.register_parameter(f"weight{index}", torch.nn.Parameter(torch.zeros(elements)))
    try:
        optimizer = build_optimizer(model_parts=[holder], config=config)
        for param in holder.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()  # the states are made in the first step
        traffic = _Traffic()
        with traffic:
            optimizer.step()
        states = [v for slots in optimizer.state.values() for v in slots.values() if isinstance(v, torch.Tensor)]
        temporaries = _Temporaries([*holder.parameters(), *(p.grad for p in holder.parameters()), *states])
        with temporaries:
            optimizer.step()
    except Exception as error:  # an outsider's optimizer: say which, not a traceback
        raise ConfigError("optimizer", f"the planner prices the optimizer's step on one float32 parameter, and "
                          f"the job's optimizer failed there: {str(error).splitlines()[0]}",
                          "let the optimizer plugin's build_optimizer take a module holding one plain parameter") from None
    # Per-element states only: scalar ones (a step counter) do not grow with the model.
    state = sum(value.numel() * value.element_size() for slots in optimizer.state.values() for value in slots.values()
                if isinstance(value, torch.Tensor) and value.numel() in sizes)
    return traffic.bytes, traffic.operators, state, temporaries.most
