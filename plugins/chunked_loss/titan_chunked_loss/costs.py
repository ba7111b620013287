"""Chunked cross entropy's pricing: no logits kept from forward, the logits layer's gradient summed over the
chunks, and the logits' matmul run again in backward."""

from titan_core import hookimpl


@hookimpl
def plan_options(plugin_config):
    """chunked_loss: off, or on with the chunk size given (the same loss either way)."""
    return [None, {"chunk_tokens": plugin_config.chunk_tokens}]


@hookimpl
def estimate_costs(estimate, plugin_config, plan):
    """chunked_loss: no logits kept from forward, one chunk's made again in backward with their gradients; the
    logits' matmul run twice."""
    estimate.logits_tokens = plugin_config.chunk_tokens
    # The logits layer's weight is used once per chunk: autograd sums its gradients over the chunks as their
    # backward runs, in a buffer as wide as the logits' vocabulary (the whole table unless loss parallel splits it,
    # however tensor parallel split the weight), beside what a chunk's backward makes. A micro-batch of one chunk
    # uses it once, a frozen one never: nothing is summed.
    estimate.add_memory("gradients", lambda e: e.holds_outputs * e.facts.outputs_trained / e.logits_split
                        * e.made_gradient_bytes * (e.microbatch_tokens > e.logits_tokens),
                        "the logits layer's gradient, summed over the chunks", "chunked_loss", when="start")
    # Forward FLOPs of the logits per token (2 x vocabulary x width, the output's parameters), as a share of a
    # token's training FLOPs.
    estimate.recomputed_fraction += 2 * estimate.facts.outputs_params / plan.model.flops_per_token(estimate.seq_len)
