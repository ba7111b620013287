"""One rank's memory and step time for a plan, as the enabled plugins say they change them.

The core starts an :class:`Estimate` from the model alone (one process, float32, every block, no
recomputation), calls every enabled plugin's ``estimate_costs`` hook in plan order, and sums. A plugin
changes the fields below that its technique changes (sharding divides, checkpointing trades, pipelining keeps
micro-batches in flight) and adds what it alone costs (its collectives, its buffers) with :meth:`add_memory`
and :meth:`add_collective`. The core knows no plugin: a plugin that does not implement the hook is listed as
not counted, so an estimate never silently leaves a technique out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from omegaconf import DictConfig
from torch import nn

from titan_core.capabilities import MIXED_PRECISION
from titan_core.mesh import cpu_threads
from titan_core.plan import Plan
from titan_core.planner.facts import LinearSizes, ModelFacts
from titan_core.planner.hardware import Hardware

GIB = 2**30
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers")
# When a memory term is held.
MOMENTS = (None, "held", "start", "blocks", "end", "accumulated", "regathered", "unreleased", "cached")
HOLDINGS = ("blocks", "holds_inputs", "holds_outputs")  # the fields an entry of Estimate.ranks may set
# The dimension a collective between replica groups (Plan.replica_group: jobs of their own) spans, outside the mesh.
ACROSS_JOBS = "replica groups"


@dataclass(frozen=True)
class Collective:
    """A collective one rank takes part in: ``bytes`` it sends per optimizer step over the ranks of ``dims``, in
    ``calls`` calls (each paying the link's latency; None: one per micro-batch).

    ``overlapped``: it runs behind computation (prefetched all-gathers, the ring's exchanges), so only the
    part longer than the computation shows in the step time; otherwise the step waits for it.
    """

    name: str
    dims: tuple[str, ...]
    bytes: float
    overlapped: bool
    plugin: str
    calls: float | Callable | None = None


def evaluated(amount, estimate: Estimate) -> float:
    """A plugin's number of bytes: as given, or its function of the estimate evaluated now."""
    return float(amount(estimate) if callable(amount) else amount)


@dataclass
class Estimate:
    """One rank's costs, the most loaded rank where ranks differ. Plugins change these fields:

    Where parameters live: ``weight_split`` (ranks each weight is split over: tensor parallel, which leaves a
    mixture of experts' weights whole and splits its tokens instead), ``expert_split`` (ranks each block's experts
    are divided among: expert parallel), ``sparse_units`` (for each module of a mixture-of-experts block that a
    plugin split over some ranks only and marked ``replicate_only_over``, the mesh dimensions it named: a
    data-parallel sharder makes each a unit of its own, gathered and reduced over those ranks; tensor parallel's
    experts' layer, expert parallel's experts), ``grad_whole_params`` (parameters, a number or a function of the
    estimate, whose gradient this rank makes beyond its split of their weights: tensor parallel's
    vocabulary-split embedding, whose backward makes the whole table's gradient; kept whole across micro-batches
    unless a sharder that holds the gradients reduces it), ``sharder_holds_gradients`` (a data-parallel sharder
    holds the gradients and counts what it keeps of them, reduced or whole: FSDP, SimpleFSDP; False: autograd
    accumulates each gradient into its parameter, so that over several micro-batches the core counts the whole
    gradients of ``grad_whole_params`` beside the split ones),
    ``state_shards`` (ranks the parameters, gradients and optimizer states are sharded over: FSDP),
    ``blocks`` (indices of the blocks this rank holds; ``holds_inputs``/``holds_outputs``: whether it runs the
    embeddings and the output: pipeline stages), ``ranks`` (where ranks differ, one dict per kind of rank of
    those three fields, which :meth:`each_rank` gives each rank's estimate, its index there as ``rank``; any
    other field that differs by rank is a function of the estimate reading ``e.rank``, so that later plugins
    can wrap it), ``compute_dtype`` (what activations and gathered weights are
    in), ``gather_bytes`` (bytes per element of the blocks' weights moved by a weight all-gather, a number or a
    function of the estimate; None: ``compute_dtype``'s; the embeddings and the output layer gather in
    ``compute_dtype``: :meth:`gathered_weight_bytes`),
    ``casts_block_weights`` (whether the core's autocast copies the blocks' weights into ``compute_dtype`` for
    their products, copies it caches until the micro-batch's backward ends; False: the blocks' linears cast the
    float32 weights themselves, float8's straight to float8).

    Activations, per micro-batch of ``microbatch_rows`` rows of ``seq_len`` tokens: ``sequence_split`` (ranks
    a sequence is split over: context parallel), ``activation_split`` / ``outer_split`` (ranks the blocks' /
    the outputs' and loss's activations are split over: tensor and sequence parallel, loss parallel),
    ``linear_splits`` (by the path of a linear within its block, the ranks its input and its result are split over;
    a linear not named has both whole: tensor parallel gathers a column-wise linear's input whole and splits its
    result, and the other way round for a row-wise one; read as :meth:`rank_linears`),
    ``gathered_itemsize(e, index, path)`` (bytes per element in which the linear at ``path`` of block ``index`` asks
    tensor parallel's gathers to bring its input and its output's gradient, as ``GatherCasts`` does at run time:
    float8's tensorwise linears, 1; None, or a function returning None for a linear: the compute dtype's),
    ``cast_shares(e, index, path)`` (the shares of that linear's input and of its output's gradient, as
    :meth:`rank_linears` sizes them, that the linear casts itself; None: both whole. Tensor parallel sets it where
    it casts the shards before gathering them: a region's input once, a row-wise linear's output gradient on its
    shard), ``saved_narrower(e, index)`` (bytes per token of what block ``index`` keeps on this rank that a plugin
    keeps narrower than the trace saw it, taken from :meth:`saved`: tensor parallel's gathered inputs cast before
    their gather; a block's working sets in backward keep the traced widths, and so does a block that recomputes:
    tracked under tp 2 with float8 and full checkpointing, rank 0 was 5.9% under with it counted narrow, 0.1% over
    with it counted wide, for reasons not found),
    ``stream_split`` (ranks the residual stream between blocks is split over besides ``sequence_split``:
    sequence parallel), ``logits_split`` (ranks the logits are split over by vocabulary: loss parallel),
    ``microbatches_in_flight`` (micro-batches whose activations are alive at once, in units of all this rank's
    blocks, a number or a function of the estimate: pipeline schedules),
    ``weight_halves_waiting`` (of those, the ones whose backward ran its input half and keeps the gradients its
    weight half needs, in the same units: zero-bubble schedules), both at the rank's worst backward once earlier
    micro-batches' gradients exist, ``gradients_made`` (the share of the rank's gradients that exist there: a
    looped pipeline rank's stages that have run no backward yet have none), and ``first_backward`` (the two at
    the rank's first backward of a step, before any gradient exists, when it keeps more: a pipeline's warm-up;
    None: none does; each of these a value or a function of the estimate), ``backward_regathers`` (whether a forward runs before the rank's worst later
    backward since its previous one, so that weights resharded after forward are gathered again as that backward
    reaches them; False: an earlier backward left them gathered, a pipeline's cool-down; a value or a function
    of the estimate), ``backward_prefetch`` (blocks ahead of the one running backward whose weights a sharder
    gathers early, of the weights of terms added ``when="regathered"``) and ``prefetched_gathered(e, index)``
    (what that prefetch gathers of block ``index``; None: all of :meth:`block_gathered`), ``logits_tokens`` (tokens
    whose logits exist at once, None: a micro-batch's; a loss that computes them chunk by chunk keeps none from
    forward and makes one chunk's again in backward), ``fused_loss`` (the loss runs as fused kernels, which keep the
    logits in the model's dtype and make only their gradient: a compiled loss; :attr:`facts` are then
    :attr:`ModelFacts.with_fused_loss` when :attr:`loss_keeps_logits`), ``output_kept`` (bytes per token that each
    micro-batch keeps until its backward ends beside what its blocks keep: a pipeline stage's output, which
    torch's stage holds as that backward's root, less its input, a tensor held elsewhere that its first block
    keeps; a value or a
    function of the estimate),
    ``keep(index, saved, stream)`` (bytes per token block ``index`` keeps on this rank, from what it would keep
    there without checkpointing and its input stream there, both already split: activation checkpointing; a
    block recomputes in backward what it did not keep), ``attention_kept`` (a block that recomputes keeps its
    attention's results, which it does not run again: selective checkpointing that saves attention),
    ``expert_load`` (rows the busiest rank's experts compute
    per token copy it routes, 1 when evenly routed: the busiest rank's experts compute that much more; a run
    logs it as ``expert_rank_load_max``, the plan command takes it as ``--expert-load``), ``expert_load_peak``
    (the same over the busiest micro-batch, which a step's memory peak meets: its experts keep that much more;
    logged as ``expert_rank_load_peak``, taken as ``--expert-load-peak``; None: ``expert_load``; read it as
    :attr:`peak_expert_load`),
    ``expert_copies_held`` (copies of a block's token copies, at the peak load, that a plugin's experts call holds
    beside the core layer's while the experts compute: expert parallel's arrived copies, 1; what a block
    recomputing in backward holds beside what it keeps).

    Time: ``recomputed_fraction`` (forward FLOPs run again, as a fraction of the model's training FLOPs),
    ``matmul_speedup`` (float8; a number or a function of the estimate), ``elementwise_passes`` (times each activation crosses device memory in a
    step: recomputation adds to it), ``fusion`` (the share of that traffic left once a compiler fuses
    the elementwise ops), ``bubble`` (fraction of the step a rank idles: pipeline schedules),
    ``dispatch_cost`` (the host's time per operator relative to eager PyTorch's: DTensor's sharding propagation
    multiplies it); what a plugin moves through device memory besides is a term of its own
    (:meth:`add_traffic`: float8's casts), and so are the matrix products it runs besides the model's
    (:meth:`add_flops`: Muon's Newton–Schulz). The core sets ``optimizer_bytes`` (bytes per parameter element its
    optimizer step moves) and ``optimizer_state_bytes`` (bytes per parameter element its optimizer keeps), both
    measured by stepping the job's own optimizer on one parameter; an optimizer plugin whose state depends on a
    parameter's shape (Muon for matrices, AdamW for the rest) sets the latter to its average in its
    ``estimate_costs``; ``optimizer_step_bytes`` (bytes its step holds at once on this rank beyond the states, a
    number or a function of the estimate: the core measures them on one parameter, by the group and by the
    largest tensor, and an optimizer plugin whose step holds otherwise, exchanging matrices, sets them), and
    ``optimizer_operators`` (operators its step issues, a
    number or a function of the estimate: the core counts them per parameter group and tensor). ``trained_whole``:
    elements of what trains that this rank keeps beyond its split share (a number or a function of the estimate:
    LoRA's factors that a split of their linears leaves whole; the core counts the rest from the traced model's
    ``requires_grad``, :meth:`trained_share`);
    ``trace_conversions`` (by plugin name, functions converting the meta model in place, which the model's trace
    applies after building it: what a plugin changes in what the blocks keep by converting modules, LoRA's frozen
    weights and adapters; :attr:`facts` are then those of the converted model).
    """

    config: DictConfig
    plan: Plan
    hardware: Hardware
    facts_in: Callable[[torch.dtype, dict, bool], ModelFacts]
    device_type: str = "cuda"
    weight_split: int = 1
    expert_split: int = 1
    sparse_units: list[tuple[str, ...]] = field(default_factory=list)
    grad_whole_params: float | Callable[[Estimate], float] = 0.0
    sharder_holds_gradients: bool = False
    state_shards: int = 1
    blocks: list[int] = field(default_factory=list)
    holds_inputs: bool = True
    holds_outputs: bool = True
    compute_dtype: torch.dtype = torch.float32
    gather_bytes: float | Callable[[Estimate], float] | None = None
    casts_block_weights: bool = True
    microbatch_rows: int = 1
    sequence_split: int = 1
    stream_split: int = 1
    activation_split: int = 1
    outer_split: int = 1
    logits_split: int = 1
    linear_splits: dict[str, tuple[int, int]] = field(default_factory=dict)
    gathered_itemsize: Callable[[Estimate, int, str], float | None] | None = None
    cast_shares: Callable[[Estimate, int, str], tuple[float, float]] | None = None
    saved_narrower: Callable[[Estimate, int], float] | None = None
    microbatches_in_flight: float | Callable[[Estimate], float] = 1
    weight_halves_waiting: float | Callable[[Estimate], float] = 0
    gradients_made: float | Callable[[Estimate], float] = 1.0
    first_backward: tuple[float, float] | Callable[[Estimate], tuple[float, float] | None] | None = None
    backward_regathers: bool | Callable[[Estimate], bool] = True
    backward_prefetch: int = 0
    prefetched_gathered: Callable[[Estimate, int], float] | None = None
    logits_tokens: int | None = None
    fused_loss: bool = False
    output_kept: float | Callable[[Estimate], float] = 0.0
    keep: Callable[[int, float, float], float] = lambda index, saved, stream: saved
    attention_kept: bool = False
    expert_load: float = 1.0
    expert_load_peak: float | None = None
    expert_copies_held: float = 0.0
    recomputed_fraction: float = 0.0
    matmul_speedup: float | Callable[[Estimate], float] = 1.0
    elementwise_passes: float = 4.0
    fusion: float = 1.0
    bubble: float = 0.0
    dispatch_cost: float = 1.0
    optimizer_bytes: float = 0.0
    optimizer_state_bytes: float = 8.0
    optimizer_step_bytes: float | Callable[[Estimate], float] = 0.0
    optimizer_operators: float | Callable[[Estimate], float] = 0.0
    trained_whole: float | Callable[[Estimate], float] = 0.0
    ranks: list[dict] = field(default_factory=list)
    rank: int = 0  # which of ``ranks`` this estimate is
    memory_terms: list[tuple] = field(default_factory=list)  # (category, what, bytes, plugin, when)
    traffic_terms: list[tuple] = field(default_factory=list)  # (what, bytes, plugin)
    flops_terms: list[tuple] = field(default_factory=list)  # (what, FLOPs, plugin)
    collectives: list[Collective] = field(default_factory=list)
    counted: list[str] = field(default_factory=list)
    not_counted: list[str] = field(default_factory=list)
    trace_conversions: dict[str, Callable[[nn.Module], None]] = field(default_factory=dict)

    @property
    def facts(self) -> ModelFacts:
        facts = self.facts_in(self.compute_dtype, self.trace_conversions, self.autocasts)
        return facts.with_fused_loss if self.loss_keeps_logits else facts

    @property
    def loss_keeps_logits(self) -> bool:
        """Whether the loss keeps for backward the logits the model returned, not a float32 copy: a fused loss over
        whole logits (one that makes them chunk by chunk is counted as eager: its compiled form is not measured)."""
        return self.fused_loss and self.logits_tokens is None

    @property
    def makes_whole_eager_loss(self) -> bool:
        """Whether this rank's loss runs eagerly over whole logits: it holds the outputs, makes the logits at once
        and keeps their float32 log-probabilities (the tensors of their shape it makes are counted by the trace)."""
        return self.holds_outputs and self.logits_tokens is None and not self.loss_keeps_logits

    @property
    def leaves_logits_room(self) -> bool:
        """Whether this rank's eager loss frees the logits the model returned once it has made their float32 copy
        (they are narrower): the loss's float32 tensors, larger, do not fit where they were, so the caching
        allocator keeps that room, and any block freed beside it, as backward starts."""
        return self.makes_whole_eager_loss and self.facts.outer_logits > self.facts.output

    @property
    def autocasts(self) -> bool:
        """Whether the core's autocast computes in ``compute_dtype`` with float32 weights (no plugin provides
        mixed precision its own way)."""
        return self.compute_dtype != torch.float32 and not self.plan.provides(MIXED_PRECISION)

    @property
    def made_gradient_bytes(self) -> int:
        """Bytes per element of a weight's gradient as backward makes it: a plugin providing mixed precision keeps
        the weights it computes with in the compute dtype, and their gradients come out in it; otherwise the weights
        stay float32 (the core's autocast casts each where it is used) and so do their gradients."""
        return self.compute_dtype.itemsize if self.plan.provides(MIXED_PRECISION) else 4

    @property
    def logits_at_once(self) -> float:
        """Tokens of one micro-batch whose logits exist at once on this rank: all of them, or a chunk's
        (``logits_tokens``)."""
        tokens = self.microbatch_tokens
        return tokens if self.logits_tokens is None else min(tokens, self.logits_tokens)

    @property
    def seq_len(self) -> int:
        return self.config.training.seq_len

    @property
    def grad_accum(self) -> int:
        return self.config.training.grad_accum_steps

    def add_memory(self, category: str, nbytes, what: str, plugin: str, when: str | None = None) -> None:
        """Memory this plugin alone holds (``buffers`` for communication buffers): throughout forward and backward,
        or ``when`` it is ``"held"``, across steps (as the optimizer steps too: a pipeline's receive buffers,
        weights stored narrower), or only ``"start"`` (as backward starts), ``"blocks"`` (while the blocks run
        backward and after),
        ``"end"`` (after the blocks' backward: the embeddings', every gradient made), ``"accumulated"`` (growing
        as the gradients are made and kept across micro-batches: none before the step's first backward) or
        ``"regathered"`` (weights resharded after forward that backward gathers again and keeps: each block's as
        backward reaches or prefetches it, ``backward_prefetch``, the rest of the rank's from its start; all of
        them at a later backward with no forward since the previous one, see ``backward_regathers``) or
        ``"unreleased"`` (weights gathered since forward, each unit's let go once backward has run it: all of them
        as backward starts, the output's once the loss's backward has run, then each block's after its own), the
        moments :meth:`memory` weighs for the peak; or ``"cached"``: not allocated at the peak but held by a GPU's
        caching allocator then (what :meth:`reserved` adds).

        ``nbytes`` may be a function of the estimate, called when it is summed: it then sees the fields as every
        plugin left them (the dtype FSDP computes in, the blocks each pipeline rank holds)."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category '{category}': use one of {', '.join(CATEGORIES)}")
        if when not in MOMENTS:
            raise ValueError(f"unknown moment '{when}': use None (through forward and backward), 'held', 'start', "
                             "'blocks', 'end', 'accumulated', 'regathered', 'unreleased' or 'cached'")
        self.memory_terms.append((category, what, nbytes, plugin, when))

    def add_collective(self, name: str, dims: tuple[str, ...], nbytes, overlapped: bool, plugin: str,
                       calls=None) -> None:
        """A collective this plugin runs: ``nbytes`` sent by one rank per optimizer step over ``dims`` in
        ``calls`` calls per step (None: one per micro-batch); each a number, or a function of the estimate,
        called when it is summed, as in :meth:`add_memory`."""
        self.collectives.append(Collective(name, tuple(dims), nbytes, overlapped, plugin, calls))

    def add_traffic(self, nbytes, what: str, plugin: str) -> None:
        """Bytes this plugin reads and writes in device memory per optimizer step on this rank beyond the
        activations' elementwise passes (casts, copies), a number or a function of the estimate as in
        :meth:`add_memory`; priced at the hardware's memory bandwidth with the step's elementwise work."""
        self.traffic_terms.append((what, nbytes, plugin))

    def add_flops(self, flops, what: str, plugin: str) -> None:
        """Matrix-product FLOPs per optimizer step this plugin runs on this rank beyond the model's, a number or a
        function of the estimate as in :meth:`add_memory`; priced at the hardware's matmul rate."""
        self.flops_terms.append((what, flops, plugin))

    def each_rank(self) -> list[Estimate]:
        """One estimate per kind of rank in ``ranks``, in their order (this estimate when all ranks are alike)."""
        for fields in self.ranks:
            if not set(fields) <= set(HOLDINGS):
                other = sorted(set(fields) - set(HOLDINGS))[0]
                raise ValueError(f"Estimate.ranks may say only what a rank holds ({', '.join(HOLDINGS)}), not "
                                 f"'{other}': give {other} as a function of the estimate reading e.rank, so that "
                                 f"plugins after yours can change it")
        return [replace(self, ranks=[], rank=index, **fields) for index, fields in enumerate(self.ranks)] or [self]

    def most_loaded(self) -> Estimate:
        """The rank with the most memory."""
        return max(self.each_rank(), key=lambda rank: sum(rank.memory().values()))

    # What the fields add up to --------------------------------------------------------------------------------

    def held_params(self) -> float:
        """Parameters of the model parts this rank holds, before any split."""
        facts = self.facts
        return (sum(facts.block_params[i] for i in self.blocks) + facts.other_params
                + facts.inputs_params * self.holds_inputs + facts.outputs_params * self.holds_outputs)

    def largest_block_params(self) -> int:
        return max((self.facts.block_params[i] for i in self.blocks), default=0)

    def rank_linears(self, index: int) -> dict[str, LinearSizes]:
        """Block ``index``'s linears as this rank computes them: their inputs and results per token divided by the
        ranks ``linear_splits`` splits them over, their weights by ``weight_split``."""
        def split(path: str, linear: LinearSizes) -> LinearSizes:
            inputs, outputs = self.linear_splits.get(path, (1, 1))
            return LinearSizes(linear.inputs / inputs, linear.outputs / outputs, linear.weights / self.weight_split)
        return {path: split(path, linear) for path, linear in self.facts.block_linears[index].items()}

    def sparse_blocks(self) -> list[int]:
        """The indices of this rank's blocks that hold experts (mixture-of-experts blocks)."""
        return [i for i in self.blocks if self.facts.block_expert_params[i]]

    def block_gathered(self, index: int) -> float:
        """Parameters of block ``index`` this rank computes with, once gathered from any sharding: its share of the
        split weights and of the experts."""
        return ((self.facts.block_params[index] - self.facts.block_expert_params[index]) / self.weight_split
                + self.experts_gathered(index))

    def experts_gathered(self, index: int) -> float:
        """Parameters of block ``index``'s experts this rank computes with: its share of them."""
        return self.facts.block_expert_params[index] / self.expert_split

    def sharded_params(self) -> float:
        """Parameters of the parts this rank holds that it keeps after every split: what its optimizer states and its
        gradients, once reduced, cover."""
        return self.held_params() / (self.weight_split * self.state_shards)

    def trained_params(self) -> float:
        """Elements of what this rank keeps (:meth:`sharded_params`) that train: what gradients, optimizer states and
        the optimizer's traffic cover. Counted per block from the traced model (a pipeline rank holding only frozen
        blocks trains nothing), plus ``trained_whole``."""
        facts = self.facts
        trained = (sum(facts.block_trained[i] for i in self.blocks) + facts.other_trained
                   + facts.inputs_trained * self.holds_inputs + facts.outputs_trained * self.holds_outputs)
        return trained / (self.weight_split * self.state_shards) + evaluated(self.trained_whole, self)

    @property
    def trained_share(self) -> float:
        """Of the parameters this rank keeps (:meth:`sharded_params`), the share that trains: :meth:`trained_params`."""
        kept = self.sharded_params()
        return self.trained_params() / kept if kept else 0.0

    def held_gathered(self) -> float:
        """Parameters of the parts this rank holds that it computes with, once gathered (what a sharder gathers
        and reduces)."""
        blocks = sum(self.block_gathered(i) for i in self.blocks)
        return blocks + (self.held_params() - sum(self.facts.block_params[i] for i in self.blocks)) / self.weight_split

    def largest_block_gathered(self) -> float:
        return max((self.block_gathered(i) for i in self.blocks), default=0.0)

    def block_gather_bytes(self) -> float:
        """Bytes per element of the blocks' weights as an all-gather moves them (``gather_bytes``)."""
        return self.compute_dtype.itemsize if self.gather_bytes is None else evaluated(self.gather_bytes, self)

    def gathered_weight_bytes(self, blocks: float, outer: float = 0.0) -> float:
        """Bytes of ``blocks`` elements of the blocks' weights and ``outer`` of the others' (embeddings, output) as
        gathered."""
        return blocks * self.block_gather_bytes() + outer * self.compute_dtype.itemsize

    def held_gathered_bytes(self) -> float:
        """Bytes of what :meth:`held_gathered` counts, as gathered."""
        blocks = sum(self.block_gathered(i) for i in self.blocks)
        return self.gathered_weight_bytes(blocks, self.held_gathered() - blocks)

    @property
    def microbatch_tokens(self) -> float:
        """Tokens of one micro-batch on this rank."""
        return self.microbatch_rows * self.seq_len / self.sequence_split

    @property
    def peak_expert_load(self) -> float:
        """The expert load memory is planned at: the busiest micro-batch's, or ``expert_load`` when not given."""
        return self.expert_load if self.expert_load_peak is None else self.expert_load_peak

    def saved(self, index: int, expert_load: float | None = None) -> float:
        """Bytes per token block ``index`` would keep on this rank without activation checkpointing: its experts'
        share grown by ``expert_load`` (the peak's when not given)."""
        facts = self.facts
        experts_more = ((self.peak_expert_load if expert_load is None else expert_load) - 1
                        ) * facts.block_expert_saved[index]
        wide = (facts.block_saved[index] + experts_more) / self.activation_split
        if self.saved_narrower is None or self.keep(index, wide, facts.block_input / self.stream_split) < wide:
            return wide
        return wide - self.saved_narrower(self, index)

    def kept(self, index: int) -> float:
        """Bytes per token block ``index`` keeps on this rank until its backward."""
        return self.keep(index, self.saved(index), self.facts.block_input / self.stream_split)

    def recomputed(self, index: int) -> float:
        """Bytes per token block ``index`` makes again in backward: what it would keep without activation
        checkpointing, less what it keeps."""
        return self.saved(index) - self.kept(index)

    def forward_held(self, index: int) -> float:
        """Bytes per token block ``index``'s forward holds at once on this rank beyond what it keeps: what it holds
        beside that when it runs again in backward."""
        facts = self.facts
        copies = self.expert_copies_held * self.peak_expert_load * facts.block_expert_input[index]
        return (facts.block_forward[index] + copies) / self.activation_split

    def uneven_expert_flops(self) -> float:
        """Training FLOPs per step this rank's experts run beyond their even share (``expert_load``): the busiest
        rank's, which the others wait for at the exchange."""
        facts, experts = self.facts, self.plan.model.experts
        if experts is None or self.expert_load == 1:
            return 0.0
        per_token = sum(6 * facts.block_expert_copies[i] * facts.block_expert_params[i] / experts.count
                        for i in self.blocks)
        tokens = self.microbatch_tokens * self.microbatches_per_step() / self.activation_split
        return (self.expert_load - 1) * per_token * tokens

    def recomputes(self, index: int) -> bool:
        """Whether block ``index`` runs its forward again in backward: a plugin whose forward exchanges data pays
        that exchange again."""
        return self.recomputed(index) > 0

    def recomputes_attention(self, index: int) -> bool:
        """Whether block ``index`` runs its attention again in backward: a plugin whose attention exchanges data
        pays that exchange again."""
        return self.recomputes(index) and not self.attention_kept

    def kept_per_token(self) -> float:
        """Activation bytes per token of one micro-batch this rank keeps until its backward."""
        return sum(self.kept(i) for i in self.blocks) + self.outer_kept() + evaluated(self.output_kept, self)

    def loss_backward_bytes(self) -> float:
        """Bytes of one micro-batch that the outputs and the loss hold on this rank at the peak of their backward,
        as the step's backward starts: what they kept and the logits' gradients (a chunked loss's one chunk's
        logits made again, and their gradients); their weights' gradients left out."""
        facts, tokens = self.facts, self.microbatch_tokens
        if not self.holds_outputs:
            return 0.0
        if self.logits_tokens is None:
            return tokens * (self.outer_kept() + facts.loss_backward / self.logits_split)
        return tokens * self.outer_kept() + self.logits_at_once * (facts.outer_logits + facts.loss_backward
                                                                   ) / self.logits_split

    def outer_kept(self) -> float:
        """Bytes per token the outputs and the loss keep until backward on this rank (the logits' only when the
        loss computes them all at once)."""
        if not self.holds_outputs:
            return 0.0
        chunked = self.logits_tokens is not None
        return (self.facts.outer_saved - chunked * self.facts.outer_logits) / self.outer_split

    @property
    def masks_by_document(self) -> bool:
        """Whether the attention masks by document, each micro-batch's rows with masks of their own."""
        return self.config.training.attention_mask == "block_causal"

    def mask_bytes(self, largest: bool = False) -> float:
        """Bytes of the attention masks the fused kernels keep for this rank's blocks (or of the ``largest`` one): a
        micro-batch's (its queries on this rank, every key) when it masks by document, else those every micro-batch
        shares."""
        masks = self.facts.attention_masks
        if not self.blocks or not masks:
            return 0.0
        rows = self.microbatch_rows if self.masks_by_document else 1
        return (max(masks) if largest else sum(masks)) * rows * self.seq_len / self.sequence_split * self.seq_len

    def param_results_per_token(self) -> float:
        """Bytes per token of one micro-batch of the gradients a split backward keeps for its weight half here."""
        return sum(self.facts.block_param_results[i] for i in self.blocks) / self.activation_split

    def gradients_at_peak(self) -> bool:
        """Whether every gradient exists throughout backward: a step of several micro-batches accumulates them."""
        return self.microbatches_per_step() > 1

    def memory(self) -> dict[str, float]:
        """Bytes per category at the step's peak: the most of a backward once the earlier micro-batches'
        gradients exist (the last one's) and, when ``first_backward`` says the rank's first backward of a step
        keeps more micro-batches, of that one, before any gradient exists (unless an earlier accumulation step
        made them); or the optimizer's step, if it holds more."""
        later = (evaluated(self.microbatches_in_flight, self), evaluated(self.weight_halves_waiting, self))
        made = evaluated(self.gradients_made, self) if self.gradients_at_peak() else 0.0
        regathers = bool(evaluated(self.backward_regathers, self))
        moments: list[tuple[float, float, float, bool]] = [(*later, made, regathers)]
        first = self.first_backward(self) if callable(self.first_backward) else self.first_backward
        if first is not None and (first[0] > later[0] or first[1] > later[1]):  # else it keeps no more, no gradient
            moments.append((*first, float(self.grad_accum > 1), True))  # the step's first backward follows a forward
        peaks = [*(self._backward_peak(*moment) for moment in moments), self.step_peak()]
        return max(peaks, key=lambda memory: sum(memory.values()))

    def reserved(self) -> float:
        """Bytes a GPU's caching allocator holds at the step's peak (what TorchTitan and ``nvidia-smi`` report):
        what is allocated then (:meth:`memory`) and what the terms added ``when="cached"`` say it keeps beyond
        that, freed blocks no allocation of that moment can use (another stream's, or too small). On a CPU, what
        is allocated: its allocator returns what is freed."""
        allocated = sum(self.memory().values())
        if self.device_type == "cpu":
            return allocated
        return allocated + sum(evaluated(nbytes, self) for *_, nbytes, _, when in self.memory_terms if when == "cached")

    def step_peak(self) -> dict[str, float]:
        """Bytes per category as the optimizer steps: no activation is left; the parameters, their gradients
        (without a sharder holding them, a split weight's whole: tensor parallel's embedding), the states and
        what the step holds beyond them; the terms held across steps."""
        state, trained = self.sharded_params(), self.trained_share
        whole = 0.0 if self.sharder_holds_gradients else evaluated(self.grad_whole_params, self)
        states = self.optimizer_state_bytes * state * trained
        memory = {"parameters": 4 * state, "gradients": (4 * state + whole * self.made_gradient_bytes) * trained,
                  "activations": 0.0, "optimizer": states + evaluated(self.optimizer_step_bytes, self),
                  "buffers": float(self.facts.buffer_bytes)}
        for category, _, nbytes, _, when in self.memory_terms:
            if when == "held":
                memory[category] += evaluated(nbytes, self)
        return memory

    def _backward_peak(self, in_flight: float, waiting: float, accumulated: float, regathers: bool) -> dict[str, float]:
        """Bytes per category at the peak of one micro-batch's backward, with ``in_flight`` micro-batches'
        activations kept and ``waiting`` weight halves, that share of the gradients existing throughout
        (``accumulated``; the rest made as its backward reaches them),
        the weights of terms added ``when="regathered"`` gathered as backward reaches them if ``regathers``, else
        all of them.

        As backward starts, every block keeps its activations and the loss and outputs make their gradients (the
        logits'). Then block by block, last first: the blocks before it still keep theirs, it recomputes what it
        did not keep and holds its output's gradient and what its backward makes (measured by the trace), and
        the blocks after it have made their weights' gradients. Terms added ``when="accumulated"`` grow as the
        gradients do.
        """
        facts, tokens = self.facts, self.microbatch_tokens
        shards = self.weight_split * self.state_shards
        state = self.sharded_params()
        # The other micro-batches in flight, and this one's output, held until its backward ends; the attention's
        # masks: one set for every micro-batch, or each micro-batch's own (by document) while a block that does not
        # recompute keeps them, else made again by each block that does.
        masks, remade = self.mask_bytes(), 0.0
        if self.masks_by_document:
            masks_kept = any(not self.recomputes(i) for i in self.blocks)
            masks, remade = (masks * in_flight, 0.0) if masks_kept else (0.0, self.mask_bytes(largest=True))
        others = (tokens * ((in_flight - 1) * self.kept_per_token() + waiting * self.param_results_per_token()
                            + evaluated(self.output_kept, self)) + masks)
        kept = [tokens * self.kept(i) for i in self.blocks]
        trained = self.trained_share
        all_gradients = 4 * state * trained
        made = 4 * trained * (state - sum(facts.block_params[i] for i in self.blocks) / shards)  # blocks' come later
        start, blocks, end, grown, regathered, unreleased = ({category: 0.0 for category in CATEGORIES}
                                                             for _ in range(6))
        memory = {category: 0.0 for category in CATEGORIES}
        for category, _, nbytes, _, when in self.memory_terms:
            if when != "cached":
                {"start": start, "blocks": blocks, "end": end, "accumulated": grown, "regathered": regathered,
                 "unreleased": unreleased, None: memory, "held": memory}[when][category] += evaluated(nbytes, self)
        # Of the rank's gathered weights, those backward has reached as it starts (all but the blocks'), then as
        # each block runs (it, the blocks after it and those prefetched before it), and at the end.
        whole = self.held_gathered() or 1.0

        def not_reached(position: int) -> float:
            ahead = self.blocks[max(0, position - self.backward_prefetch):position]
            prefetched = self.prefetched_gathered or Estimate.block_gathered
            return sum(map(self.block_gathered, self.blocks[:position])) - sum(prefetched(self, i) for i in ahead)
        reached = [1 - not_reached(len(self.blocks)) / whole if regathers else 1.0]
        reached += [1 - not_reached(position) / whole if regathers else 1.0
                    for position in reversed(range(len(self.blocks)))] + [1.0]
        # Of them, those not let go yet: all as backward starts; the output's go once the loss's backward has run,
        # each block's once its own has.
        output = self.facts.outputs_params * self.holds_outputs / self.weight_split
        released = [0.0, *(output + sum(map(self.block_gathered, self.blocks[position + 1:]))
                           for position in reversed(range(len(self.blocks)))),
                    output + sum(map(self.block_gathered, self.blocks))]
        kept_gathered = [1 - share / whole for share in released]
        # (activations, gradients, this moment's own terms)
        phases = [(others + sum(kept) + self.loss_backward_bytes(), 0.0, start)]
        for position in reversed(range(len(self.blocks))):
            i = self.blocks[position]
            # Its output's gradient has the stream's shape and split; beside what it keeps, what its backward
            # makes or, if more, what its forward made and let go as it ran again.
            held = self.forward_held(i) if self.recomputes(i) else 0.0
            working = (facts.block_input / self.stream_split + self.recomputed(i)
                       + max(facts.block_backward[i] / self.activation_split, held))
            phases.append((others + sum(kept[:position + 1]) + tokens * working + remade, made, blocks))
            made += 4 * trained * facts.block_params[i] / shards
        phases.append((others, all_gradients, {category: blocks[category] + end[category] for category in CATEGORIES}))
        if accumulated:
            phases = [(activations, max(gradients, accumulated * all_gradients), own)
                      for activations, gradients, own in phases]
        phases = [(activations, gradients, {category: own[category] + grown[category] * gradients / (all_gradients or 1)
                                            + regathered[category] * share + unreleased[category] * unlet
                                            for category in CATEGORIES})
                  for (activations, gradients, own), share, unlet in zip(phases, reached, kept_gathered)]
        activations, gradients, own = max(phases, key=lambda phase: phase[0] + phase[1] + sum(phase[2].values()))
        memory["parameters"] += 4 * state
        memory["gradients"] += gradients
        memory["activations"] += activations
        memory["optimizer"] += self.optimizer_state_bytes * state * trained
        memory["buffers"] += facts.buffer_bytes
        return {category: memory[category] + own[category] for category in CATEGORIES}

    def step_flops(self, frozen_too: bool = False) -> float:
        """The model's training FLOPs per optimizer step on one rank (recomputation not counted, as MFU), less the
        gradients its frozen weights never make unless ``frozen_too`` (what a share of the FLOPs is a share of)."""
        training = self.config.training
        tokens = training.global_batch_size * training.seq_len
        trained = self.facts.trained_flops
        per_token = self.plan.model.flops_per_token(training.seq_len) if frozen_too or trained is None else trained
        return per_token * tokens / self.plan.world_size

    def link_gbps(self, dims: tuple[str, ...]) -> float:
        """The bandwidth of a group over ``dims``: NVLink-class when its ranks fit in one node; the network between
        nodes over :data:`ACROSS_JOBS` (replica groups are jobs of their own, whose ranks never share a node's links)."""
        if ACROSS_JOBS in dims:
            return self.hardware.inter_node_gbps
        order = list(self.plan.mesh_shape)  # outermost first
        outermost = min((order.index(d) for d in dims if d in order), default=len(order))
        span = math.prod(self.plan.mesh_shape.get(d, 1) for d in order[outermost:])
        return self.hardware.intra_node_gbps if span <= self.hardware.devices_per_node else self.hardware.inter_node_gbps

    def collective_calls(self, collective: Collective) -> float:
        return self.microbatches_per_step() if collective.calls is None else evaluated(collective.calls, self)

    def collective_seconds(self, collective: Collective) -> float:
        return (evaluated(collective.bytes, self) / (self.link_gbps(collective.dims) * 1e9)
                + self.collective_calls(collective) * self.hardware.collective_latency_us * 1e-6)

    def host_seconds(self) -> float:
        """The host's time to issue the step's operators one by one (forward and backward per micro-batch, the
        optimizer's once)."""
        facts = self.facts
        ops: float
        ops = sum(facts.block_ops[i] for i in self.blocks) + facts.outer_ops * (self.holds_inputs or self.holds_outputs)
        ops = ops * self.microbatches_per_step() + evaluated(self.optimizer_operators, self)
        return ops * self.hardware.op_overhead_us * 1e-6 * self.dispatch_cost

    def step_seconds(self) -> dict[str, float]:
        """Seconds of one optimizer step on one rank, by part, and the total."""
        hardware = self.hardware
        matmul = ((self.step_flops() + self.step_flops(frozen_too=True) * self.recomputed_fraction
                   + self.uneven_expert_flops())
                  / evaluated(self.matmul_speedup, self)
                  + sum(evaluated(flops, self) for _, flops, _ in self.flops_terms)) / (hardware.matmul_tflops() * 1e12)
        facts = self.facts
        produced = (sum(self.saved(i, self.expert_load) for i in self.blocks)
                    + (facts.outer_saved / self.outer_split if self.holds_outputs else 0.0))
        tokens = self.microbatch_tokens * self.microbatches_per_step()
        traffic = sum(evaluated(nbytes, self) for _, nbytes, _ in self.traffic_terms)
        elementwise = ((self.elementwise_passes * self.fusion * produced * tokens + traffic)
                       / (hardware.memory_gbps * 1e9))
        optimizer = self.optimizer_bytes * self.trained_params() / (hardware.memory_gbps * 1e9)
        host = self.host_seconds()
        hidden = sum(self.collective_seconds(c) for c in self.collectives if c.overlapped)
        waited = sum(self.collective_seconds(c) for c in self.collectives if not c.overlapped)
        if hardware.cores:
            speed = self.worker_threads()
            matmul, elementwise, optimizer = matmul / speed, elementwise / speed, optimizer / speed
            host /= min(1.0, speed)  # one thread issues the operators
            compute = matmul + elementwise + optimizer + host  # the same threads issue and compute
            # Collectives run on the cores that compute (no copy engine, no separate stream): nothing hides;
            # a call waits for every worker, each running its share of the time.
            hidden, waited = 0.0, (hidden + waited) / min(1.0, speed)
        else:  # the host issues operators ahead of the device, which waits only for a slower host
            compute = max(matmul + elementwise + optimizer, host)
        busy = max(compute, hidden) + waited
        total = busy / (1 - self.bubble)
        return {"matmul": matmul, "elementwise": elementwise, "optimizer": optimizer,
                "host": host if hardware.cores else max(0.0, host - (matmul + elementwise + optimizer)),
                "exposed communication": busy - compute, "pipeline bubble": total - busy, "step": total}

    def worker_threads(self) -> float:
        """A CPU profile is measured on one thread: a worker runs on its threads, at most its share of the cores."""
        cores = self.hardware.cores
        assert cores, "asked of CPU profiles only, which count their cores"
        workers = min(self.plan.world_size, self.hardware.devices_per_node)
        threads = cpu_threads(self.config.launch, self.plan.world_size) or cores
        return min(threads, cores / workers)

    def peak_tflops(self) -> float:
        """The dense bf16 peak of what one rank computes on: a device, or a CPU worker's threads."""
        return self.hardware.peak_tflops() * (self.worker_threads() if self.hardware.cores else 1)

    def tokens_per_device(self) -> float:
        """Predicted training tokens per second per device (TPS/GPU)."""
        training = self.config.training
        return training.global_batch_size * training.seq_len / self.step_seconds()["step"] / self.plan.world_size

    def microbatches_per_step(self) -> float:
        """Micro-batches this rank runs per optimizer step."""
        rows = self.config.training.global_batch_size / self.plan.dp_size
        return rows / self.microbatch_rows
