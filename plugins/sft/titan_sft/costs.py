"""sft's pricing: it costs the devices nothing of its own, and says so, so that a plan counts it rather than
listing it as not counted."""

from titan_core import hookimpl


@hookimpl
def estimate_costs() -> None:
    """sft: nothing of its own: its rows are the core's, and a packed row's document mask is the core's
    (``training.attention_mask=block_causal``, which packing requires), counted by the model's trace."""
