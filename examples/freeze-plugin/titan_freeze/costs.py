"""What freezing changes in a plan, for the planner: the model traced frozen, and only what still trains counted."""

import functools

from titan_core import build_meta_model, hookimpl

from titan_freeze import freeze


@hookimpl
def estimate_costs(estimate, config, plugin_config, plan):
    """freeze: a frozen linear keeps no input for its weight's gradient (the trace runs the frozen model), and the
    gradients and optimizer states cover the parameters that still train."""
    convert = functools.partial(freeze, plugin_config=plugin_config, description=plan.model)
    estimate.trace_conversions[f"freeze {plugin_config}"] = convert
    model = build_meta_model(config, plan.model)
    convert(model)
    total = sum(p.numel() for p in model.parameters())
    estimate.trained_share = sum(p.numel() for p in model.parameters() if p.requires_grad) / total
