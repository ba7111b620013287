"""The ledger: what a plugin's pricing may read of a plan and write into it, and nothing else.

A plugin whose technique costs the devices something the core does not count (a buffer, a collective, extra
matrix products, copies through device memory, modules that keep other activations) says so here, in a few
entries. Where parameters, activations and micro-batches live (sharding, splitting, pipelining, recomputation) is
the planner's layout model, :class:`titan_core.planner.Estimate`, which the first-party parallelisms change and
docs/planner-internals.md describes; the ledger reads its result and never needs it.

An amount is a number, or a function of a ledger evaluated once every plugin has priced the plan, on each kind
of rank (pipeline stages differ): read inside it, :attr:`blocks`, :attr:`tokens`, :attr:`microbatches`,
:attr:`kept_params` and :attr:`trained_params` are that rank's, as every plugin left them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Union

from torch import nn

from titan_core.planner.estimate import Estimate
from titan_core.planner.facts import ModelFacts

__all__ = ["Amount", "Ledger"]

Amount = Union[float, Callable[["Ledger"], float]]
# Moments of weights a sharder gathers again in backward: they follow the sharder's units and prefetching.
LAYOUT_MOMENTS = ("regathered", "unreleased")


class Ledger:
    """One plugin's entries into one rank's estimate (the plugin's name is on each entry the plan prints)."""

    def __init__(self, estimate: Estimate, plugin: str):
        self._estimate, self._plugin = estimate, plugin

    # What the plan holds on this rank -------------------------------------------------------------------------

    @property
    def model(self) -> ModelFacts:
        """What the trace measured of the whole model, unsplit: parameters per block, bytes per token each block
        keeps for backward, the residual stream's bytes per token (``block_input``), ... (in the compute dtype)."""
        return self._estimate.facts

    @property
    def blocks(self) -> list[int]:
        """The indices of the blocks this rank runs (all of them unless a pipeline splits them)."""
        return list(self._estimate.blocks)

    @property
    def tokens(self) -> float:
        """Tokens of one micro-batch on this rank (after any split of the sequence)."""
        return self._estimate.microbatch_tokens

    @property
    def microbatches(self) -> float:
        """Micro-batches this rank runs per optimizer step."""
        return self._estimate.microbatches_per_step()

    @property
    def kept_params(self) -> float:
        """Parameter elements this rank keeps after every split and shard (what its weights' memory covers)."""
        return self._estimate.sharded_params()

    @property
    def trained_params(self) -> float:
        """Of :attr:`kept_params`, the elements that train: those with gradients and optimizer states."""
        return self._estimate.trained_params()

    # What the plugin adds -------------------------------------------------------------------------------------

    def add_memory(self, category: str, nbytes: Amount, what: str, when: str | None = None) -> None:
        """Bytes this plugin holds on the rank, of ``category`` (parameters, gradients, optimizer, activations,
        buffers), alive ``when``: None through forward and backward; ``"held"`` across steps, as the optimizer
        steps too; ``"start"`` as backward starts; ``"blocks"`` while the blocks run backward and after; ``"end"``
        after the blocks' backward; ``"accumulated"`` growing with the gradients; ``"cached"`` freed but kept by a
        GPU's caching allocator. A negative amount is a saving: what the technique frees of what the core counts."""
        if when in LAYOUT_MOMENTS:
            raise ValueError(f"moment '{when}' belongs to the planner's layout model (docs/planner-internals.md): "
                             "use None, 'held', 'start', 'blocks', 'end', 'accumulated' or 'cached'")
        self._estimate.add_memory(category, self._deferred(nbytes), what, self._plugin, when)

    def add_collective(self, name: str, dims: tuple[str, ...], nbytes: Amount, overlapped: bool,
                       calls: Amount | None = None) -> None:
        """A collective over the mesh dimensions ``dims``: ``nbytes`` one rank sends per optimizer step, in ``calls``
        calls per step (None: one per micro-batch), each paying the link's latency; ``overlapped`` if it runs
        behind computation (then only what is longer than the computation shows in the step time)."""
        self._estimate.add_collective(name, dims, self._deferred(nbytes), overlapped, self._plugin,
                                      None if calls is None else self._deferred(calls))

    def add_flops(self, flops: Amount, what: str) -> None:
        """Matrix-product FLOPs per optimizer step this plugin runs on the rank beyond the model's, at the card's
        bf16 matmul rate (not counted in MFU, which counts the model's)."""
        self._estimate.add_flops(self._deferred(flops), what, self._plugin)

    def add_traffic(self, nbytes: Amount, what: str) -> None:
        """Bytes per optimizer step this plugin reads and writes in device memory on the rank (casts, copies),
        at the card's memory bandwidth."""
        self._estimate.add_traffic(self._deferred(nbytes), what, self._plugin)

    def convert_for_trace(self, name: str, convert: Callable[[nn.Module], None]) -> None:
        """Have the trace measure the model as ``convert(model)`` leaves it, in place on the meta device: the
        conversion ``convert_modules`` runs (frozen weights keep no input for their gradient; new modules keep
        their own). ``name`` says which conversion with which options."""
        self._estimate.trace_conversions[name] = convert

    def _deferred(self, amount: Amount) -> float | Callable[[Estimate], float]:
        """The amount as the estimate evaluates it: a function of this plugin's ledger on the rank summed."""
        if not callable(amount):
            return float(amount)
        plugin = self._plugin
        return lambda estimate: float(amount(Ledger(estimate, plugin)))
