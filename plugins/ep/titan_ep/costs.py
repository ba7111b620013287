"""Expert parallel's pricing: each rank's slice of the experts, and the all-to-all taking the token copies to
their experts' ranks and back."""

from __future__ import annotations

from titan_core import TP, hookimpl, rest_of
from titan_ep.plugin import EP


@hookimpl
def estimate_costs(estimate, plan):
    """ep: each rank computes with (and its sharder gathers and reduces) only its slice of each block's experts; per
    mixture-of-experts block and micro-batch, the token copies travel to their experts' ranks and back, in forward,
    in backward, and in the forward a checkpointed block runs again, and the step waits for them: the busiest rank's,
    which receives ``expert_load`` times an even share (and sends as much back)."""
    degree = plan.degree(EP)
    estimate.expert_split *= degree
    estimate.sparse_units.append((rest_of(EP),))
    estimate.expert_copies_held += 1  # the arrived copies, sorted by expert, beside the routed ones
    tp = plan.degree(TP)  # tensor parallel gives each of its ranks a share of a MoE layer's tokens

    def forwards(e, index: int) -> int:  # a checkpointed block exchanges its copies again to recompute
        return 2 if e.recomputes(index) else 1

    def sent(e):  # bytes one rank sends per step: copies out and results back, in each forward and in backward
        copies = sum((2 * forwards(e, i) + 2) * e.facts.block_expert_input[i] for i in e.sparse_blocks())
        return copies * e.expert_load * e.microbatch_tokens / tp * e.microbatches_per_step() * (degree - 1) / degree

    def calls(e):  # per MoE block and micro-batch: each forward's counts, copies and results; backward's two
        return sum(3 * forwards(e, i) + 2 for i in e.sparse_blocks()) * e.microbatches_per_step()

    if degree > 1:
        estimate.add_collective("all-to-all of the token copies to their experts and back", (EP,), sent,
                                overlapped=False, plugin="ep", calls=calls)


@hookimpl
def plan_options(model, world_size, hardware):
    """ep: off, or degrees 2, 4, 8 that divide the experts and the world and keep the all-to-all within a node."""
    if model.experts is None:
        return [None]
    degrees = [d for d in (2, 4, 8) if d <= min(hardware.devices_per_node, world_size)
               and model.experts.count % d == 0 and world_size % d == 0]
    return [None, *({"degree": d} for d in degrees)]
