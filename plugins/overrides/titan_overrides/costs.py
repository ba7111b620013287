"""Module overrides' pricing: the model traced with its modules swapped, so that the planner measures what the
swapped modules keep and run (the fused product's concatenated weight and its gate and up results)."""

from titan_core import hookimpl
from titan_overrides.plugin import activation, swap_swiglu


@hookimpl
def estimate_costs(ledger, plugin_config, plan):
    """overrides: the trace runs the swapped modules."""
    ledger.convert_for_trace("overrides", lambda model: swap_swiglu(model, plan.model, activation("eager")))
