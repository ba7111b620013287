"""The run's plugin objects (:mod:`titan_core.discovery` finds them installed), their hooks called the core's way.

pluggy finds and checks the implementations; the core decides who is called and in what order. Each plugin is
called on its own, with its own options (``plugin_config``), through pluggy's hook callers (``subset_hook_caller``),
in plan order for ordered hooks and events, or alone for a builder. Because no call spans several plugins, pluggy's
ordering options (``tryfirst``, ``trylast``) and wrappers have nothing to act on: an implementation that asks for
them is refused before launch, never silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from types import ModuleType

import pluggy
import torch

import titan_core.default_hooks as default_hooks
import titan_core.hookspecs as hookspecs
from titan_core.description import ModelDescription
from titan_core.discovery import (distribution_name, entry_points_by_name, installed_models, installed_plugins,
                                  model_name, plugin_object)
from titan_core.errors import ConfigError
from titan_core.mesh import device_kind
from titan_core.plan import Declaration, Plan, PlannedPlugin, make_plan
from titan_core.train_state import Stateful

CORE = "titan_core"  # the name the core's own default hooks are registered under
# Every plugin option file carries this key, so that nodes made by `++plugins.x.y=...` are told apart.
PLUGIN_MARKER = "_plugin_"
# pluggy's options that order or wrap the implementations of one call: each call here has one implementation.
UNHONOURED = ("wrapper", "hookwrapper", "tryfirst", "trylast")


def enabled_plugin_names(config) -> list[str]:
    """The keys of ``config.plugins``, each checked to be a real plugin option, not a stray override."""
    names = []
    for name, node in (config.get("plugins") or {}).items():
        if not isinstance(node, Mapping) or node.get(PLUGIN_MARKER) != name:
            raise ConfigError(f"plugins.{name}", "is set but the plugin is not enabled",
                              f"enable it with +plugins=[{name}] (or remove the override)")
        names.append(name)
    return names


@dataclass(frozen=True, eq=False)
class Room:
    """Hooks beside the training contract that training never loads (the planner's): their specs, each plugin's
    implementations (entry points of ``group`` by its name) and what ``extra`` adds for a plugin object."""

    hookspecs: ModuleType
    group: str
    extra: Callable[[object], list[object]] = field(default=lambda plugin: [])


class Registry:
    """The plugin objects of one run in one pluggy manager: the core's defaults, the model plugin and each
    enabled plugin, checked against the hook contract before anything runs."""

    def __init__(self, config, model_only: bool = False):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.belongs_to: dict[str, str] = {}  # pluggy's name -> the plugin it belongs to
        self.rooms: list[Room] = []
        self.model = model_name(config)
        self.names = [] if model_only else enabled_plugin_names(config)
        self.objects: dict[str, object] = {} if model_only else {CORE: default_hooks}
        self.objects[self.model] = plugin_object(installed_models()[self.model])
        installed = installed_plugins()
        for name in self.names:
            if name not in installed:  # composed by hand, not from the command line's checked options
                raise ConfigError(f"plugins.{name}", f"no installed plugin is named '{name}'",
                                  "install the distribution that provides it, or remove it from plugins")
            self.objects[name] = plugin_object(installed[name])
        self.distributions = {name: distribution_name(installed[name]) for name in self.names}
        for name, plugin in self.objects.items():
            self._register(plugin, name, name)
        self._check()
        self._callers: dict[tuple[str, str], pluggy.HookCaller] = {}

    def open_room(self, room: Room) -> None:
        """Add ``room``'s hooks and, for the model plugin and each enabled plugin, its objects implementing them."""
        if room in self.rooms:
            return
        self.rooms.append(room)
        self.pm.add_hookspecs(room.hookspecs)
        found = entry_points_by_name(room.group, "plugins")
        for name, plugin in self.objects.items():
            parts = ([plugin_object(found[name])] if name in found and name != CORE else []) + room.extra(plugin)
            for index, part in enumerate(parts):
                self._register(part, f"{name}:{room.group}:{index}", name)
        self._check()
        self._callers.clear()

    def field(self, name: str) -> str:
        """The config field a user sets to change plugin ``name``."""
        return "model.name" if name == self.model else f"plugins.{name}"

    def _register(self, plugin, registered_name: str, name: str) -> None:
        if not isinstance(plugin, Hashable):  # pluggy keeps plugins in sets
            raise ConfigError(self.field(name), f"plugin '{name}' is an object that cannot be hashed (its class "
                              "compares by value, as @dataclass does)", "use @dataclass(eq=False), or no __eq__")
        try:
            self.pm.register(plugin, name=registered_name)
            self.belongs_to[registered_name] = name
        except pluggy.PluginValidationError as error:
            raise ConfigError(self.field(name), f"plugin '{name}' does not fit the hook contract: {error}",
                              "fix the hook implementation's arguments (see titan_core.hookspecs)") from None

    def _check(self) -> None:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as error:
            raise ConfigError(self.field(self.belongs_to[self.pm.get_name(error.plugin)]),
                              f"{error}".splitlines()[0].split(" in plugin ")[0],
                              "rename the function to one of the hooks in titan_core.hookspecs (the planner's hooks "
                              "go in a pricing module registered under titan_core.costs: docs/writing-plugins.md)"
                              ) from None
        for hook_name in self.pm.hook.__dict__:
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                unhonoured = [option for option in UNHONOURED if getattr(impl, option)]
                if unhonoured and impl.plugin_name != CORE:
                    raise ConfigError(self.field(self.belongs_to[impl.plugin_name]), f"its {hook_name} is marked "
                                      f"{', '.join(f'{o}=True' for o in unhonoured)}, which titan-core cannot honour: "
                                      f"the core calls each plugin's {hook_name} on its own, in plan order",
                                      "remove it from @hookimpl(...) (Declaration.stage orders model transforms)")
        for hook_name in builder_hooks(self.pm):
            owners = [name for name in self.objects if name != CORE and self.implements(name, hook_name)]
            if len(owners) > 1:
                raise ConfigError(f"plugins=[{','.join(owners)}]",
                                  f"each of {', '.join(owners)} implements {hook_name}, which needs one answer",
                                  "enable only one of them")

    def implements(self, plugin: str, hook_name: str) -> bool:
        return any(self.belongs_to[impl.plugin_name] == plugin
                   for impl in getattr(self.pm.hook, hook_name).get_hookimpls())

    def call(self, plugin: str, hook_name: str, **kwargs):
        """``plugin``'s implementation of the hook, through pluggy, or None when it has none."""
        if not self.implements(plugin, hook_name):
            return None
        key = (hook_name, plugin)
        if key not in self._callers:
            others = [obj for name, obj in self.pm.list_name_plugin()
                      if self.belongs_to[name] != plugin and obj is not self.objects[plugin]]
            self._callers[key] = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
        answer = self._callers[key](**kwargs)
        return answer if self._callers[key].spec.opts.get("firstresult") else next(iter(answer), None)

    def owner(self, hook_name: str) -> str | None:
        """The one enabled plugin implementing a builder hook, else the core when it has a default."""
        return next((name for name in self.objects if name != CORE and self.implements(name, hook_name)),
                    CORE if self.implements(CORE, hook_name) else None)

    def describe_model(self, config, vocab_size: int) -> ModelDescription:
        """The model plugin's description of ``config.model``."""
        description = self.call(self.model, "describe_model", model_config=config.model, vocab_size=vocab_size,
                                seq_len=config.training.seq_len)
        if not isinstance(description, ModelDescription):
            raise ConfigError("model.name", f"model plugin '{self.model}' did not describe its model",
                              "its describe_model hook must return a titan_core.ModelDescription")
        return description

    def stateful(self) -> dict[str, Stateful]:
        """The plugin objects that keep state across a restart, by name."""
        return {name: plugin for name, plugin in self.objects.items()
                if name != CORE and isinstance(plugin, Stateful)}


def builder_hooks(pm: pluggy.PluginManager) -> list[str]:
    """The hooks that need one answer: those specified ``firstresult``."""
    return [name for name, caller in vars(pm.hook).items()
            if caller.spec is not None and caller.spec.opts.get("firstresult")]


def model_description(config, vocab_size: int) -> ModelDescription:
    """The description of ``config.model`` by its model plugin alone, for tools that train nothing."""
    return Registry(config, model_only=True).describe_model(config, vocab_size)


def build_meta_model(config, description: ModelDescription) -> torch.nn.Module:
    """The described model on the meta device, built by its model plugin alone (for shape checks)."""
    registry = Registry(config, model_only=True)
    with torch.device("meta"):
        return registry.call(registry.model, "build_model", description=description)


class Hooks:
    """Calls hooks the core's way once the plan is known: each plugin with its own options and the plan.

    ``each`` calls every enabled plugin in plan order, then the model plugin, and returns their non-None
    answers; ``first`` calls the one plugin that implements a builder hook, else the core's default.
    """

    def __init__(self, registry: Registry, plan: Plan, config):
        self.registry, self.plan = registry, plan
        self.options = {p.name: config.plugins[p.name] for p in plan.plugins}
        self.options[registry.model] = config.model
        self.options[CORE] = None
        self.order = [*(p.name for p in plan.plugins), registry.model]

    def call(self, plugin: str, hook_name: str, **kwargs):
        """``plugin``'s implementation of the hook with its own options, or None when it has none."""
        return self.registry.call(plugin, hook_name, plugin_config=self.options[plugin], plan=self.plan, **kwargs)

    def each(self, hook_name: str, **kwargs) -> list:
        return [answer for name in self.order if (answer := self.call(name, hook_name, **kwargs)) is not None]

    def first(self, hook_name: str, **kwargs):
        owner = self.registry.owner(hook_name)
        return None if owner is None else self.call(owner, hook_name, **kwargs)

    def converted_model(self, config) -> torch.nn.Module:
        """The whole model, built on meta and converted by every plugin (what trains is settled from here on)."""
        with torch.device("meta"):
            model = self.first("build_model", description=self.plan.model)
        self.each("convert_modules", model=model, config=config)
        return model

    def implementing(self, hook_name: str) -> list[str]:
        """The plugins, in plan order, that implement ``hook_name``."""
        return [name for name in self.order if self.registry.implements(name, hook_name)]


def build_plan(config, registry: Registry, world_size: int | None, vocab_size: int, validate: bool = True) -> Plan:
    """Describe the model, collect the declarations, order them, size the mesh and check conflicts.

    ``world_size`` is the given world under torchrun, else None (see :func:`titan_core.plan.make_plan`). The
    plugins' ``validate`` hooks run only where ``validate`` is set: in the launching process (under torchrun,
    rank 0's), which checks the job once for every rank; the workers rebuild the plan unchecked.
    """
    description = registry.describe_model(config, vocab_size)
    planned = []
    for name in enabled_plugin_names(config):  # the registry's, or some of them (--recommend tries subsets)
        declaration = registry.call(name, "declare", config=config, plugin_config=config.plugins[name])
        declaration = Declaration() if declaration is None and not registry.implements(name, "declare") else declaration
        if not isinstance(declaration, Declaration):
            raise ConfigError(f"plugins.{name}", "its declare hook did not return a titan_core.Declaration",
                              "fix the plugin's declare hook")
        planned.append(PlannedPlugin(name, registry.distributions[name], declaration))
    local_gpus = torch.cuda.device_count() if device_kind(config.launch.get("device")) == "cuda" else 0
    plan = make_plan(planned, description, world_size, config.launch.get("world_size"), local_gpus)
    for p in plan.plugins if validate else ():
        registry.call(p.name, "validate", config=config, plugin_config=config.plugins[p.name], plan=plan)
    training_data, validation_data = registry.owner("build_dataloader"), registry.owner("build_validation_batches")
    if config.validation.every and validate and training_data != validation_data:
        raise ConfigError("validation.every", f"the training batches come from plugin '{training_data}', which "
                          "gives no validation batches (build_validation_batches)",
                          "set validation.every=0, or add build_validation_batches to that plugin")
    return plan
