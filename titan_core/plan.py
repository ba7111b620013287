"""Find the enabled plugins, ask what they contribute, and turn that into one validated plan.

pluggy does discovery and declaration; the order of model transforms, the mesh shape and the
conflict checks are decided here, the same way in the launcher and in every worker.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from importlib.resources import files

import pluggy
import torch

from titan_core import defaults, hookspecs
from titan_core.errors import ConfigError

PLUGIN_GROUP = "titan_core.plugins"
CONF_GROUP = "titan_core.conf"
# Every plugin option file carries this key, so that nodes made by `++plugins.x.y=...` are told apart.
PLUGIN_MARKER = "_plugin_"
# Outermost first: pipeline stages span the slowest links, tensor parallel the fastest.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
BUILDER_HOOKS = ("build_model", "build_schedule", "build_optimizer", "build_dataloader",
                 "save_checkpoint", "load_checkpoint")


@dataclass(frozen=True)
class Declaration:
    """What one plugin contributes; returned by its ``declare`` hook.

    ``stage`` orders model transforms (lower first; the first-party plugins use pp 100, tp 200,
    cp 300, ac 400, compile 500, fsdp 600, leaving gaps for others). ``mesh`` maps mesh dimensions
    (see ``MESH_DIMS``) to degrees; -1 means "all ranks the other dimensions leave".
    """

    stage: int | None = None
    mesh: Mapping[str, int] = field(default_factory=dict)
    provides: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PlannedPlugin:
    name: str
    distribution: str
    declaration: Declaration


@dataclass(frozen=True)
class Plan:
    plugins: tuple[PlannedPlugin, ...]  # in transform order: stage, then name
    mesh_shape: Mapping[str, int]  # declared dimensions only, in MESH_DIMS order
    world_size: int

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.plugins]

    def degree(self, dim: str) -> int:
        return self.mesh_shape.get(dim, 1)

    @property
    def dp_size(self) -> int:
        return self.degree("dp_replicate") * self.degree("dp_shard")

    def describe(self) -> str:
        shape = " x ".join(f"{d} {n}" for d, n in self.mesh_shape.items()) or "single process"
        lines = [f"titan-core plan: world {self.world_size} = {shape}"]
        for p in self.plugins:
            d = p.declaration
            stage = "   -" if d.stage is None else f"{d.stage:4d}"
            extras = [f"mesh {dict(d.mesh)}" if d.mesh else "",
                      f"provides {sorted(d.provides)}" if d.provides else "",
                      f"requires {sorted(d.requires)}" if d.requires else ""]
            lines.append(f"  {stage}  {p.name:<12} {p.distribution:<20} " + "  ".join(e for e in extras if e))
        return "\n".join(lines)


def installed_plugins() -> dict[str, EntryPoint]:
    """Entry points of ``titan_core.plugins`` by name; two distributions using one name is an error.

    pluggy's own loader would silently keep the first of two, so the core checks this itself.
    """
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=PLUGIN_GROUP):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise ConfigError(
                f"plugins.{ep.name}",
                f"two installed distributions register a plugin named '{ep.name}' "
                f"({_dist_name(other)}: {other.value}; {_dist_name(ep)}: {ep.value})",
                "uninstall one of them (pip uninstall ...)")
        found[ep.name] = ep
    return found


def plugin_options() -> set[str]:
    """Names of the ``plugins/<name>.yaml`` options that installed distributions ship."""
    names = set()
    for ep in entry_points(group=CONF_GROUP):
        group = files(ep.value).joinpath("plugins")
        if group.is_dir():
            names |= {f.name[:-5] for f in group.iterdir() if f.name.endswith(".yaml")}
    return names


def check_plugin_names(names) -> None:
    """Fail on a requested plugin that is not installed, before Hydra tries to compose it."""
    installed, options = installed_plugins(), plugin_options()
    for name in names:
        if name not in installed:
            known = ", ".join(sorted(installed)) or "none"
            raise ConfigError(f"plugins={name}", f"no installed plugin is named '{name}' (installed: {known})",
                              f"install the distribution that provides it, or pick one of: {known}")
        if name not in options:
            raise ConfigError(f"plugins={name}", f"plugin '{name}' is installed but ships no plugins/{name}.yaml",
                              f"add a '{CONF_GROUP}' entry point to its distribution pointing at its conf package")


def enabled_plugin_names(config) -> list[str]:
    """The keys of ``config.plugins``, each checked to be a real plugin option, not a stray override."""
    names = []
    for name, node in (config.get("plugins") or {}).items():
        if not isinstance(node, Mapping) or node.get(PLUGIN_MARKER) != name:
            raise ConfigError(f"plugins.{name}", "is set but the plugin is not enabled",
                              f"enable it with +plugins=[{name}] (or remove the override)")
        names.append(name)
    return names


def plugin_manager(config) -> pluggy.PluginManager:
    """A plugin manager holding the core defaults and every enabled plugin, loaded by entry point."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(defaults, name="titan_core.defaults")
    installed = installed_plugins()
    for name in enabled_plugin_names(config):
        check_plugin_names([name])
        pm.register(installed[name].load(), name=name)
    for hook_name in BUILDER_HOOKS:
        owners = [impl.plugin_name for impl in getattr(pm.hook, hook_name).get_hookimpls()
                  if impl.plugin_name != "titan_core.defaults"]
        if len(owners) > 1:
            raise ConfigError(f"plugins=[{','.join(owners)}]",
                              f"each of {', '.join(owners)} implements {hook_name}, which needs one answer",
                              "enable only one of them")
    return pm


def call_plugin(pm: pluggy.PluginManager, hook_name: str, plugin: str, **kwargs):
    """Call one plugin's implementation of a hook (the core owns the order), or return None."""
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        if impl.plugin_name == plugin:
            return impl.function(*(kwargs[arg] for arg in impl.argnames))
    return None


def build_plan(config, pm: pluggy.PluginManager, world_size: int | None) -> Plan:
    """Collect the declarations, order them, size the mesh and check conflicts.

    ``world_size`` is the given world under torchrun, else None: then a degree of -1 fills
    ``launch.world_size``, or all local GPUs, and otherwise the world is what the degrees multiply to.
    """
    planned = []
    installed = installed_plugins()
    for name in enabled_plugin_names(config):
        declaration = call_plugin(pm, "declare", name, config=config, plugin_config=config.plugins[name])
        if not isinstance(declaration, Declaration):
            raise ConfigError(f"plugins.{name}", "its declare hook did not return a titan_core.plan.Declaration",
                              "fix the plugin's declare hook")
        planned.append(PlannedPlugin(name, _dist_name(installed[name]), declaration))
    planned.sort(key=lambda p: (p.declaration.stage is None, p.declaration.stage or 0, p.name))

    _check_capabilities(planned)
    mesh_shape = _mesh_shape(planned, world_size, config.launch.get("world_size"))
    plan = Plan(tuple(planned), mesh_shape, math.prod(mesh_shape.values()))
    for p in planned:
        call_plugin(pm, "validate", p.name, config=config, plugin_config=config.plugins[p.name], plan=plan)
    return plan


def _check_capabilities(planned: list[PlannedPlugin]) -> None:
    provider: dict[str, str] = {}
    for p in planned:
        for capability in p.declaration.provides:
            if capability in provider:
                raise ConfigError(f"plugins=[{provider[capability]},{p.name}]",
                                  f"both provide '{capability}'", f"enable only one of {provider[capability]} and {p.name}")
            provider[capability] = p.name
    for p in planned:
        for capability in sorted(p.declaration.requires - provider.keys()):
            raise ConfigError(f"plugins.{p.name}", f"requires '{capability}', which no enabled plugin provides",
                              f"add a plugin that provides '{capability}' to +plugins=[...]")


def _mesh_shape(planned: list[PlannedPlugin], world_size: int | None, configured_world: int | None) -> dict[str, int]:
    degrees: dict[str, tuple[int, str]] = {}
    for p in planned:
        for dim, degree in p.declaration.mesh.items():
            field_name = f"plugins.{p.name}"
            if dim not in MESH_DIMS:
                raise ConfigError(field_name, f"declares unknown mesh dimension '{dim}'",
                                  f"use one of {', '.join(MESH_DIMS)}")
            if dim in degrees:
                raise ConfigError(field_name, f"mesh dimension '{dim}' is already sized by plugins.{degrees[dim][1]}",
                                  f"enable only one of {degrees[dim][1]} and {p.name}")
            if not (degree == -1 or degree >= 1):
                raise ConfigError(f"{field_name}.degree", f"{dim} degree {degree} is not a positive integer or -1",
                                  "use a positive degree, or -1 for all remaining ranks")
            degrees[dim] = (degree, p.name)

    world = world_size if world_size is not None else configured_world
    fixed = math.prod(d for d, _ in degrees.values() if d != -1)
    fill = [dim for dim, (d, _) in degrees.items() if d == -1]
    if len(fill) > 1:
        raise ConfigError(f"plugins.{degrees[fill[1]][1]}.degree", "only one mesh dimension may be -1",
                          "give the others explicit degrees")
    if fill:
        owner = degrees[fill[0]][1]
        world = world or torch.cuda.device_count() or None
        if world is None:
            raise ConfigError(f"plugins.{owner}.degree", f"-1 needs a world size to fill ({fill[0]})",
                              "give an explicit degree, or set launch.world_size=N, or run under torchrun")
        if world % fixed:
            raise ConfigError(f"plugins.{owner}.degree", f"world {world} is not divisible by the other degrees ({fixed})",
                              "choose degrees whose product divides the world size")
        degrees[fill[0]] = (world // fixed, owner)
    shape = {dim: degrees[dim][0] for dim in MESH_DIMS if dim in degrees}
    product = math.prod(shape.values())
    if world is not None and product != world:
        source = "WORLD_SIZE from torchrun" if world_size is not None else "launch.world_size"
        raise ConfigError("plugins.*.degree", f"the degrees multiply to {product} but {source} is {world}",
                          f"make the product of the degrees equal {world}, or set one degree to -1")
    return shape


def _dist_name(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "unknown distribution"
