"""muon's pricing: Muon's momentum and AdamW's moments as optimizer state, the step's working memory, the
Newton–Schulz work of this rank, and the all-to-alls that send the matrices' updates to their owners and back."""

from __future__ import annotations

import math

from titan_core import CP, DP_REPLICATE, DP_SHARD, FLOAT_DTYPES, PP, TP, build_meta_model, hookimpl, parameter_role

from titan_muon.exchange import assign_owners
from titan_muon.optimizer import NewtonSchulz
from titan_muon.plugin import MATRIX


@hookimpl
def estimate_costs(estimate, config, plugin_config, plan):
    """muon: one momentum per matrix element, AdamW's two float32 moments for the rest; what its step holds
    beyond them; this rank's share of the Newton–Schulz work; the matrices' updates sent to their owners and
    their rows sent back."""
    model = build_meta_model(config, plan.model)
    matrices = [p.shape for name, p in model.named_parameters() if parameter_role(plan.model, name, p) == MATRIX]
    every = sum(p.numel() for p in model.parameters())
    matrix_share = sum(shape.numel() for shape in matrices) / every
    whole_matrices = [shape for shape in matrices if len(shape) == 2]  # not expert stacks: exchanged
    layout = plan.model.tensor_parallel
    relaid = sum(p.numel() for name, p in model.named_parameters() if layout is not None and p.ndim == 2
                 and any(name.endswith(f".{linear}.weight") for linear in layout.block_rowwise)) / every
    exchanged_share = sum(shape.numel() for shape in whole_matrices) / every
    momentum_bytes = FLOAT_DTYPES[plugin_config.momentum_dtype].itemsize
    estimate.optimizer_state_bytes = momentum_bytes * matrix_share + 8 * (1 - matrix_share)
    dims = [dim for dim in (DP_REPLICATE, DP_SHARD, CP, TP) if plan.degree(dim) > 1]
    ranks = math.prod(plan.degree(dim) for dim in dims)  # the ranks a matrix's mesh spreads over
    work = sum(NewtonSchulz.cost_of(shape, plugin_config.ns_steps) for shape in matrices) / every
    estimate.add_flops(lambda e: e.held_params() * work / ranks, "Newton–Schulz on this rank's matrices", "muon")
    result_bytes = FLOAT_DTYPES[plugin_config.ns_dtype].itemsize
    # The owners are chosen by work, not bytes: the rank that owns the most receives that much more.
    owned = [0] * ranks
    costs = [NewtonSchulz.cost_of(shape, 1) for shape in whole_matrices]
    for shape, owner in zip(whole_matrices, assign_owners(costs, ranks)):
        owned[owner] += shape.numel()
    most_owned = max(owned) * ranks / max(1, sum(owned))
    largest = max((shape[-2:].numel() for shape in matrices), default=0)
    # Each update is a new float32 tensor unless it is the stored momentum itself.
    update_copies = int(plugin_config.nesterov or momentum_bytes < 4)

    def step_bytes(e):
        """What the step holds at once, the most of its phases: every update and, under a mesh, the rows laid out
        for the exchange (tensor parallel's split by input features), the exchange's sent and received buffers
        and, at a second level, what the first brought; or the orthogonalised updates and Newton–Schulz's
        working matrices; or those and AdamW's batched update of the other parameters."""
        held = e.trained_params()
        matrix, moved = held * matrix_share, held * exchanged_share
        updates = 4 * matrix * update_copies
        orthogonalised = result_bytes * matrix + 3 * result_bytes * largest
        adamw = result_bytes * matrix + 4 * (held - matrix)
        if ranks == 1:
            return max(updates + orthogonalised, adamw)
        # gloo has no all-to-all: DTensor re-lays by gathering, and a rank's rows keep the gathered matrix (on a
        # second mesh dimension a copy of its rows too: measured under torch 2.13).
        gathered = plan.degree(TP) + (len(dims) > 1)
        relaid_copies = (gathered if e.device_type == "cpu" else 1) * (plan.degree(TP) > 1)
        exchanging = updates + 4 * held * relaid * relaid_copies + 4 * moved * ((len(dims) > 1) + 1 + most_owned)
        return max(exchanging, updates + orthogonalised, adamw)

    estimate.optimizer_step_bytes = step_bytes
    if ranks == 1:
        return

    def exchanged(bytes_per_element):  # of its owned matrices, the rows it does not hold; of the others, its own
        return lambda e: e.held_params() * exchanged_share * bytes_per_element * (ranks - 1) / ranks**2

    levels, calls = len(dims), 2 * sum(len(shape) == 2 for shape in matrices) / plan.degree(PP)
    estimate.add_collective("all-to-all of the Muon updates to their owners", tuple(dims), exchanged(4),
                            overlapped=False, plugin="muon", calls=levels)
    estimate.add_collective("all-to-all of the orthogonalised rows back", tuple(dims), exchanged(result_bytes),
                            overlapped=False, plugin="muon", calls=levels)
    if plan.degree(TP) > 1:  # a tensor-parallel split laid out by rows and back: most of its piece each way
        tp = plan.degree(TP)
        estimate.add_collective(
            "re-layout of the tensor-parallel matrices by rows", (TP,),
            lambda e: e.held_params() * exchanged_share / ranks * (tp - 1) / tp * (4 + result_bytes),
            overlapped=False, plugin="muon", calls=calls)
