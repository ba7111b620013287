"""Freeze parts of the model for fine-tuning: their parameters get no gradient and no optimizer state.

A module conversion (``convert_modules``), so that it runs before any parallelism and every later transform sees
the final ``requires_grad`` flags; the parts are found through the model's description (its blocks, the modules
before and after them), never by parameter names, so it freezes any model that describes itself.
"""

from titan_core import ConfigError, hookimpl, lacks


@hookimpl
def validate(plugin_config, plan):
    """freeze: the chosen blocks exist, something is chosen, and the model says where its parts are."""
    blocks, description = list(plugin_config.blocks), plan.model
    if not (blocks or plugin_config.inputs or plugin_config.outputs):
        raise ConfigError("plugins.freeze", "freezes nothing", "set plugins.freeze.blocks=[0,1], inputs=true or "
                          "outputs=true")
    if description.blocks is None or (plugin_config.inputs and description.inputs is None) or (
            plugin_config.outputs and description.outputs is None):
        missing = "blocks" if description.blocks is None else "inputs" if plugin_config.inputs else "outputs"
        raise ConfigError("plugins.freeze", lacks(description, missing, "freezing by part"), "freeze other parts")
    wrong = [b for b in blocks if not (isinstance(b, int) and 0 <= b < description.n_layers)]
    if wrong:
        raise ConfigError("plugins.freeze.blocks", f"{wrong[0]!r} is not a block of {description.n_layers}",
                          f"use block indices from 0 to {description.n_layers - 1}")


@hookimpl
def convert_modules(model, plugin_config, plan):
    """freeze: switch off the gradients of the chosen blocks and outer modules."""
    freeze(model, plugin_config, plan.model)


def freeze(model, plugin_config, description) -> None:
    """Freeze, in place, what ``plugin_config`` chooses of ``model``, as ``description`` places it."""
    names = [f"{description.blocks}.{index}" for index in plugin_config.blocks]
    names += list(description.inputs) if plugin_config.inputs else []
    names += list(description.outputs) if plugin_config.outputs else []
    for name in names:
        model.get_submodule(name).requires_grad_(False)
