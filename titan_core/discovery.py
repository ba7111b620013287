"""Find the installed plugins and models (their distributions' entry points) and make a run's plugin objects."""

from __future__ import annotations

import inspect
from importlib.metadata import EntryPoint, entry_points

from titan_core.errors import ConfigError

PLUGIN_GROUP = "titan_core.plugins"
MODEL_GROUP = "titan_core.models"


def installed_plugins() -> dict[str, EntryPoint]:
    """Entry points of ``titan_core.plugins`` by name; two distributions using one name is an error (pluggy's own
    loader would silently keep the first of two, so the core checks this itself)."""
    return entry_points_by_name(PLUGIN_GROUP, "plugins")


def installed_models() -> dict[str, EntryPoint]:
    """Entry points of ``titan_core.models`` by name (the ``model.name`` that selects each)."""
    return entry_points_by_name(MODEL_GROUP, "model")


def entry_points_by_name(group: str, field_prefix: str) -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise ConfigError(f"{field_prefix}.{ep.name}", f"two installed distributions register '{ep.name}' in "
                              f"{group} ({distribution_name(other)}: {other.value}; {distribution_name(ep)}: "
                              f"{ep.value})", "uninstall one of them (pip uninstall ...)")
        found[ep.name] = ep
    return found


def distribution_name(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "unknown distribution"


def model_name(config) -> str:
    """The model plugin ``config.model.name`` selects, checked to be installed."""
    name = (config.get("model") or {}).get("name")
    installed = installed_models()
    if name not in installed:
        known = ", ".join(sorted(installed)) or "none"
        raise ConfigError("model.name", f"no installed model plugin is named '{name}' (installed: {known})",
                          "pick a model preset with model=<preset>, or install the model's distribution")
    return name


def plugin_object(entry_point: EntryPoint) -> object:
    """The object registered for one run: the module or instance the entry point names, or what the class or
    factory it names makes, called with no arguments (a fresh object per run, so no state leaks into the
    next job of a sweep run in the same process)."""
    try:
        loaded = entry_point.load()
        return loaded() if inspect.isclass(loaded) or inspect.isfunction(loaded) else loaded
    except Exception as error:  # a plugin's own bug, whatever it is: one line naming the plugin
        field = f"{'model' if entry_point.group == MODEL_GROUP else 'plugins'}.{entry_point.name}"
        raise ConfigError(field, f"plugin '{entry_point.name}' ({entry_point.value}) fails to load: "
                          f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                          f"fix or reinstall {distribution_name(entry_point)}") from None
