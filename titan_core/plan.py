"""Find the enabled plugins, ask what they contribute, and turn that into one validated plan.

pluggy does discovery and declaration; the order of model transforms, the mesh shape and the
conflict checks are decided here, the same way in the launcher and in every worker.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

import pluggy
import torch

from titan_core import defaults, hookspecs
from titan_core.description import ModelDescription
from titan_core.errors import ConfigError
from titan_core.mesh import device_kind
from titan_core.schema import CONF_GROUP, option_files

PLUGIN_GROUP = "titan_core.plugins"
MODEL_GROUP = "titan_core.models"
DEFAULTS = "titan_core.defaults"
# Every plugin option file carries this key, so that nodes made by `++plugins.x.y=...` are told apart.
PLUGIN_MARKER = "_plugin_"
# Outermost first: pipeline stages span the slowest links, tensor parallel the fastest.
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
BUILDER_HOOKS = ("describe_model", "build_model", "build_schedule", "build_optimizer", "build_lr_scheduler",
                 "build_dataloader", "save_checkpoint", "load_checkpoint")


@dataclass(frozen=True)
class MeshDimension:
    """A mesh dimension: the core's (``MESH_DIMS``) or one a plugin adds in ``Declaration.dimensions``.

    ``after``: the dimension it follows in the mesh order, outermost first (None: innermost), so that a
    dimension whose collectives are frequent sits on the fast links. ``borrows``: dimensions, adjacent in
    that order, whose ranks it reuses instead of multiplying the world (expert parallel borrows the
    data- and context-parallel ranks); its degree must divide their product, and the mesh then also has
    ``<name>_rest``, the borrowed ranks it leaves (the experts' FSDP shards over those). ``data_parallel``:
    ranks along it hold different samples; the batch is split over every such dimension.
    """

    after: str | None = None
    borrows: tuple[str, ...] = ()
    data_parallel: bool = False


CORE_DIMENSIONS = {"pp": MeshDimension(), "dp_replicate": MeshDimension(data_parallel=True),
                   "dp_shard": MeshDimension(data_parallel=True), "cp": MeshDimension(), "tp": MeshDimension()}


@dataclass(frozen=True)
class Declaration:
    """What one plugin contributes; returned by its ``declare`` hook.

    ``stage`` orders model transforms (lower first; docs/architecture.md lists the first-party plugins'
    stages, which leave gaps for others). ``mesh`` maps mesh dimensions to degrees; -1 means "all ranks
    the other dimensions leave" (for a borrowing dimension: all the ranks it borrows). A dimension is the
    core's (``MESH_DIMS``) or one that ``dimensions`` defines (:class:`MeshDimension`). ``provides`` and
    ``requires`` name capabilities (:mod:`titan_core.capabilities`).
    """

    stage: int | None = None
    mesh: Mapping[str, int] = field(default_factory=dict)
    provides: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    dimensions: Mapping[str, MeshDimension] = field(default_factory=dict)


@dataclass(frozen=True)
class PlannedPlugin:
    name: str
    distribution: str
    declaration: Declaration


@dataclass(frozen=True)
class Plan:
    plugins: tuple[PlannedPlugin, ...]  # in transform order: stage, then name
    mesh_shape: Mapping[str, int]  # the dimensions whose degrees multiply to the world, in mesh order
    world_size: int
    model: ModelDescription
    borrowing: Mapping[str, int] = field(default_factory=dict)  # dimensions that reuse ranks: their degrees
    dimensions: Mapping[str, MeshDimension] = field(default_factory=dict)  # every sized dimension's definition

    def provides(self, capability: str) -> bool:
        """Whether some enabled plugin provides ``capability``."""
        return any(capability in p.declaration.provides for p in self.plugins)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.plugins]

    def degree(self, dim: str) -> int:
        return self.mesh_shape.get(dim, self.borrowing.get(dim, 1))

    @property
    def data_parallel_dims(self) -> tuple[str, ...]:
        """The dimensions whose ranks hold different samples, in mesh order."""
        return tuple(d for d in self.mesh_shape if self.dimensions.get(d, CORE_DIMENSIONS.get(d)).data_parallel)

    @property
    def dp_size(self) -> int:
        return math.prod(self.mesh_shape[d] for d in self.data_parallel_dims)

    def borrowed(self) -> dict[str, tuple[int, tuple[str, ...]]]:
        """For each borrowing dimension: its degree and the sized dimensions whose ranks it reuses."""
        return {dim: (degree, tuple(d for d in self.dimensions[dim].borrows if d in self.mesh_shape))
                for dim, degree in self.borrowing.items()}

    def describe(self) -> str:
        shape = " x ".join(f"{d} {n}" for d, n in self.mesh_shape.items()) or "single process"
        shape += "".join(f"; {dim} {degree} within {' x '.join(dims)}" for dim, (degree, dims) in self.borrowed().items())
        lines = [f"titan-core plan: world {self.world_size} = {shape}; model {self.model.family}"]
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
    return _entry_points(PLUGIN_GROUP, "plugins")


def installed_models() -> dict[str, EntryPoint]:
    """Entry points of ``titan_core.models`` by name (the ``model.name`` that selects each)."""
    return _entry_points(MODEL_GROUP, "model")


def _entry_points(group: str, field_prefix: str) -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise ConfigError(
                f"{field_prefix}.{ep.name}",
                f"two installed distributions register '{ep.name}' in {group} "
                f"({_dist_name(other)}: {other.value}; {_dist_name(ep)}: {ep.value})",
                "uninstall one of them (pip uninstall ...)")
        found[ep.name] = ep
    return found


def config_options(group: str) -> set[str]:
    """Names of the ``<group>/<name>.yaml`` options (``plugins``, ``model``) that the core and the installed
    distributions ship."""
    return set(option_files(group))


def check_plugin_names(names) -> None:
    """Fail on a requested plugin that is not installed, before Hydra tries to compose it."""
    installed, options = installed_plugins(), config_options("plugins")
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


def model_name(config) -> str:
    """The model plugin ``config.model.name`` selects, checked to be installed."""
    name = (config.get("model") or {}).get("name")
    installed = installed_models()
    if name not in installed:
        known = ", ".join(sorted(installed)) or "none"
        raise ConfigError("model.name", f"no installed model plugin is named '{name}' (installed: {known})",
                          "pick a model preset with model=<preset>, or install the model's distribution")
    return name


def model_description(config, vocab_size: int) -> ModelDescription:
    """The description of ``config.model`` by its model plugin alone, for tools that train nothing."""
    return _model_manager(config).hook.describe_model(model_config=config.model, vocab_size=vocab_size,
                                                      seq_len=config.training.seq_len)


def build_meta_model(config, description: ModelDescription) -> torch.nn.Module:
    """The described model on the meta device, built by its model plugin alone (for shape checks)."""
    with torch.device("meta"):
        return _model_manager(config).hook.build_model(description=description)


def _model_manager(config) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(installed_models()[model_name(config)].load())
    return pm


def plugin_manager(config) -> pluggy.PluginManager:
    """A plugin manager holding the core defaults, the model plugin and every enabled plugin.

    A hook implementation whose name or arguments the contract does not know is an error here, before
    anything runs: a misspelled hook would otherwise never be called.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(defaults, name=DEFAULTS)
    model = model_name(config)
    _register(pm, installed_models()[model].load(), model, "model.name")
    installed = installed_plugins()
    for name in enabled_plugin_names(config):
        check_plugin_names([name])
        _register(pm, installed[name].load(), name, f"plugins.{name}")
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as error:
        name = pm.get_name(error.plugin)
        raise ConfigError("model.name" if name == model else f"plugins.{name}",
                          f"{error}".splitlines()[0].split(" in plugin ")[0],
                          "rename the function to one of the hooks in titan_core.hookspecs") from None
    for hook_name in BUILDER_HOOKS:
        owners = [impl.plugin_name for impl in getattr(pm.hook, hook_name).get_hookimpls()
                  if impl.plugin_name != DEFAULTS]
        if len(owners) > 1:
            raise ConfigError(f"plugins=[{','.join(owners)}]",
                              f"each of {', '.join(owners)} implements {hook_name}, which needs one answer",
                              "enable only one of them")
    return pm


def _register(pm: pluggy.PluginManager, plugin, name: str, field_name: str) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as error:
        raise ConfigError(field_name, f"plugin '{name}' does not fit the hook contract: {error}",
                          "fix the hook implementation's arguments (see titan_core.hookspecs)") from None


def call_plugin(pm: pluggy.PluginManager, hook_name: str, plugin: str, **kwargs):
    """Call one plugin's implementation of a hook (the core owns the order), or return None."""
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        if impl.plugin_name == plugin:
            return impl.function(*(kwargs[arg] for arg in impl.argnames))
    return None


class Hooks:
    """Calls hooks the core's way: each plugin with its own options, in plan order.

    ``each`` calls every enabled plugin in plan order, then the model plugin, and returns their
    non-None answers; ``first`` calls the one plugin that implements a builder hook, else the core's
    default.
    """

    def __init__(self, pm: pluggy.PluginManager, plan: Plan, config):
        self.pm, self.plan = pm, plan
        self.options = {p.name: config.plugins[p.name] for p in plan.plugins}
        self.options[config.model.name] = config.model
        self.options[DEFAULTS] = None
        self.order = [*(p.name for p in plan.plugins), config.model.name]

    def call(self, plugin: str, hook_name: str, **kwargs):
        """``plugin``'s implementation of the hook with its own options, or None when it has none."""
        return call_plugin(self.pm, hook_name, plugin, plugin_config=self.options[plugin], plan=self.plan, **kwargs)

    def each(self, hook_name: str, **kwargs) -> list:
        return [answer for name in self.order if (answer := self.call(name, hook_name, **kwargs)) is not None]

    def first(self, hook_name: str, **kwargs):
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        owner = next((i.plugin_name for i in impls if i.plugin_name != DEFAULTS), DEFAULTS if impls else None)
        return None if owner is None else self.call(owner, hook_name, **kwargs)


def build_plan(config, pm: pluggy.PluginManager, world_size: int | None, vocab_size: int,
               validate: bool = True) -> Plan:
    """Describe the model, collect the declarations, order them, size the mesh and check conflicts.

    ``world_size`` is the given world under torchrun, else None: then a degree of -1 fills
    ``launch.world_size``, or all local GPUs, and otherwise the world is what the degrees multiply to.
    The plugins' ``validate`` hooks run only where ``validate`` is set: in the launching process (under
    torchrun, rank 0's), which checks the job once for every rank; the workers rebuild the plan unchecked.
    """
    description = pm.hook.describe_model(model_config=config.model, vocab_size=vocab_size,
                                         seq_len=config.training.seq_len)
    if not isinstance(description, ModelDescription):
        raise ConfigError("model.name", f"model plugin '{config.model.name}' did not describe its model",
                          "its describe_model hook must return a titan_core.description.ModelDescription")
    planned = []
    installed = installed_plugins()
    for name in enabled_plugin_names(config):
        declaration = call_plugin(pm, "declare", name, config=config, plugin_config=config.plugins[name])
        declaration = Declaration() if declaration is None and not _implements(pm, "declare", name) else declaration
        if not isinstance(declaration, Declaration):
            raise ConfigError(f"plugins.{name}", "its declare hook did not return a titan_core.plan.Declaration",
                              "fix the plugin's declare hook")
        planned.append(PlannedPlugin(name, _dist_name(installed[name]), declaration))
    planned.sort(key=lambda p: (p.declaration.stage is None, p.declaration.stage or 0, p.name))

    _check_capabilities(planned)
    dimensions = _dimensions(planned)
    local_gpus = torch.cuda.device_count() if device_kind(config.launch.get("device")) == "cuda" else 0
    mesh_shape, borrowing = _mesh_shape(planned, dimensions, world_size, config.launch.get("world_size"), local_gpus)
    plan = Plan(tuple(planned), mesh_shape, math.prod(mesh_shape.values()), description, borrowing,
                {dim: dimensions[dim] for dim in (*mesh_shape, *borrowing)})
    for p in planned if validate else ():
        call_plugin(pm, "validate", p.name, config=config, plugin_config=config.plugins[p.name], plan=plan)
    return plan


def _implements(pm: pluggy.PluginManager, hook_name: str, plugin: str) -> bool:
    return any(impl.plugin_name == plugin for impl in getattr(pm.hook, hook_name).get_hookimpls())


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


def _dimensions(planned: list[PlannedPlugin]) -> dict[str, MeshDimension]:
    """Every dimension the job may size, in mesh order: the core's with the plugins' inserted."""
    order, definitions, owner = list(MESH_DIMS), dict(CORE_DIMENSIONS), {}
    for p in planned:
        for dim, definition in p.declaration.dimensions.items():
            field_name = f"plugins.{p.name}"
            if dim in definitions:
                by = f"plugins.{owner[dim]}" if dim in owner else "the core"
                raise ConfigError(field_name, f"defines mesh dimension '{dim}', which {by} already defines",
                                  f"enable only one of them, or name the dimension differently")
            if definition.after is not None and definition.after not in definitions:
                raise ConfigError(field_name, f"places mesh dimension '{dim}' after unknown dimension "
                                  f"'{definition.after}'", f"use one of {', '.join(order)}")
            unknown = [d for d in definition.borrows if d not in definitions or definitions[d].borrows]
            if unknown:
                raise ConfigError(field_name, f"mesh dimension '{dim}' borrows '{unknown[0]}', which is no mesh "
                                  "dimension that multiplies the world", f"borrow from {', '.join(order)}")
            order.insert(order.index(definition.after) + 1 if definition.after else len(order), dim)
            definitions[dim], owner[dim] = definition, p.name
    return {dim: definitions[dim] for dim in order}


def _mesh_shape(planned: list[PlannedPlugin], dimensions: dict[str, MeshDimension], world_size: int | None,
                configured_world: int | None, local_gpus: int) -> tuple[dict[str, int], dict[str, int]]:
    """The degrees of the dimensions that multiply to the world, in mesh order, and of those that borrow."""
    degrees: dict[str, tuple[int, str]] = {}
    for p in planned:
        for dim, degree in p.declaration.mesh.items():
            field_name = f"plugins.{p.name}"
            if dim not in dimensions:
                raise ConfigError(field_name, f"declares unknown mesh dimension '{dim}'",
                                  f"use one of {', '.join(dimensions)}, or define it in Declaration.dimensions")
            if dim in degrees:
                raise ConfigError(field_name, f"mesh dimension '{dim}' is already sized by plugins.{degrees[dim][1]}",
                                  f"enable only one of {degrees[dim][1]} and {p.name}")
            if not (degree == -1 or degree >= 1):
                raise ConfigError(f"{field_name}.degree", f"{dim} degree {degree} is not a positive integer or -1",
                                  "use a positive degree, or -1 for all remaining ranks")
            degrees[dim] = (degree, p.name)
    borrowing = {dim: degrees.pop(dim) for dim in list(degrees) if dimensions[dim].borrows}

    world = world_size if world_size is not None else configured_world
    fixed = math.prod(d for d, _ in degrees.values() if d != -1)
    fill = [dim for dim, (d, _) in degrees.items() if d == -1]
    if len(fill) > 1:
        raise ConfigError(f"plugins.{degrees[fill[1]][1]}.degree", "only one mesh dimension may be -1",
                          "give the others explicit degrees")
    if fill:
        owner = degrees[fill[0]][1]
        world = world or local_gpus or None
        if world is None:
            raise ConfigError(f"plugins.{owner}.degree", f"-1 needs a world size to fill ({fill[0]})",
                              "give an explicit degree, or set launch.world_size=N, or run under torchrun")
        if world % fixed:
            raise ConfigError(f"plugins.{owner}.degree", f"world {world} is not divisible by the other degrees ({fixed})",
                              "choose degrees whose product divides the world size")
        degrees[fill[0]] = (world // fixed, owner)
    shape = {dim: degrees[dim][0] for dim in dimensions if dim in degrees}
    product = math.prod(shape.values())
    if world is not None and product != world:
        source = "WORLD_SIZE from torchrun" if world_size is not None else "launch.world_size"
        raise ConfigError("plugins.*.degree", f"the degrees multiply to {product} but {source} is {world}",
                          f"make the product of the degrees equal {world}, or set one degree to -1")
    return shape, {dim: _borrowed_degree(dim, degree, owner, dimensions, shape)
                   for dim, (degree, owner) in borrowing.items()}


def _borrowed_degree(dim: str, degree: int, owner: str, dimensions: dict[str, MeshDimension],
                     shape: dict[str, int]) -> int:
    """The degree of a borrowing dimension, checked against the ranks it borrows."""
    lenders = [d for d in dimensions[dim].borrows if d in shape]
    ranks = math.prod(shape[d] for d in lenders)
    names = " x ".join(dimensions[dim].borrows)
    positions = [list(shape).index(d) for d in lenders]
    if positions and positions != list(range(positions[0], positions[0] + len(positions))):
        raise ConfigError(f"plugins.{owner}", f"mesh dimension '{dim}' borrows {names}, which are not adjacent "
                          f"in the mesh order ({', '.join(shape)})", "borrow adjacent dimensions")
    degree = ranks if degree == -1 else degree
    if ranks % degree:
        raise ConfigError(f"plugins.{owner}.degree", f"{dim} degree {degree} does not divide the {ranks} rank(s) "
                          f"of {names} it borrows", f"choose a divisor of {ranks}, or enlarge {names}")
    return degree


def _dist_name(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "unknown distribution"


if __name__ == "__main__":  # python -m titan_core.plan: the job's costs before launch
    from titan_core.planning.cli import main

    main()
