"""Freeze modules for fine-tuning: their parameters get no gradient and no optimizer state.

Runs first (stage 50), before any sharding, so that every later transform sees the final
``requires_grad`` flags.
"""

from titan_core import ConfigError, Declaration, hookimpl


@hookimpl
def declare():
    return Declaration(stage=50)


@hookimpl
def validate(config, plugin_config):
    if not plugin_config.modules:
        raise ConfigError("plugins.freeze.modules", "is empty", "list parameter-name prefixes, e.g. [tok_embeddings]")


@hookimpl
def apply_parallelism(model_parts, plugin_config):
    prefixes = tuple(f"{m}." for m in plugin_config.modules)
    for part in model_parts:
        for name, param in part.named_parameters():
            if name.startswith(prefixes):
                param.requires_grad_(False)
