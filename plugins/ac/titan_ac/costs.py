"""Activation checkpointing's pricing: what a checkpointed block keeps of its activations, and the share of the
step's work its recomputation adds."""

from titan_core import hookimpl


# Of a step's FLOPs, the forward is a third (backward computes two gradients per forward matmul).
FORWARD_SHARE = 1 / 3


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """ac: checkpointed blocks keep their input (full) or their expensive ops' results (selective_op) and
    run their forward again in backward, one block at a time (what a block did not keep, it recomputes)."""
    mode, every = plugin_config.mode, plugin_config.every
    checkpointed = [i for i in estimate.blocks if mode != "selective_layer" or i % every == 0]
    if mode == "selective_op":
        ops = {"attention" if "attention" in op else op for op in plugin_config.save_ops}
        alternate = plugin_config.matmuls == "every_other"
        # torch's selective checkpoint stores the policy's results whatever autograd needs: more than a block keeps
        # without checkpointing where autograd keeps little (a frozen model's: LoRA's, tracked 13% more).
        estimate.keep = lambda index, saved, stream: (
            stream + estimate.facts.made_by(index, ops, alternate) / estimate.activation_split)
        estimate.attention_kept = "attention" in ops
        # Backward runs again the matrix products whose results it did not keep (every_other's, the experts'),
        # and the elementwise ops: their FLOPs are negligible, their memory traffic is not.
        facts = estimate.facts
        rerun = sum(facts.rerun_flops(i, ops, alternate) for i in range(len(facts.block_params)))
        estimate.recomputed_fraction += rerun / plan.model.flops_per_token(estimate.seq_len)
        estimate.elementwise_passes += 1
    else:
        previous = estimate.keep
        estimate.keep = lambda index, saved, stream: (
            stream if mode == "full" or index % every == 0 else previous(index, saved, stream))
        estimate.recomputed_fraction += FORWARD_SHARE * len(checkpointed) / max(len(estimate.blocks), 1)


@hookimpl
def plan_options():
    """ac: off, selective (all the matmuls' results kept, or every other one's: TorchTitan's) or full."""
    return [None, {"mode": "selective_op"}, {"mode": "selective_op", "matmuls": "every_other"}, {"mode": "full"}]
