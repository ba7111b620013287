"""What freezing changes in a plan, for the planner: the model traced frozen (the core then counts, per rank, only
what still trains)."""

import functools

from titan_core import hookimpl

from titan_freeze import freeze


@hookimpl
def estimate_costs(ledger, plugin_config, plan):
    """freeze: a frozen linear keeps no input for its weight's gradient, and gradients and optimizer states cover
    the parameters that still train: both follow from tracing the frozen model."""
    convert = functools.partial(freeze, plugin_config=plugin_config, description=plan.model)
    ledger.convert_for_trace(f"freeze {plugin_config}", convert)
