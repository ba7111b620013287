"""The planner's hooks: what a plugin's pricing module may implement, beside the training contract.

A plugin prices its technique in a module of its own (``titan_<name>/costs.py`` for the first-party plugins),
registered under the entry-point group ``titan_core.costs`` with the plugin's name; the planner loads it, with
these hook specs, only when it makes a plan (``python -m titan_core.planner``, ``launch.dry_run``). Training never
imports this room. The implementations take any subset of a hook's arguments by name, as the training hooks do,
with ``@titan_core.hookimpl``; ``plugin_config`` and ``plan`` mean what they mean there.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from titan_core.description import ModelDescription
from titan_core.hookspecs import hookspec
from titan_core.plan import Plan
from titan_core.planner.estimate import Estimate
from titan_core.planner.hardware import Hardware
from titan_core.planner.ledger import Ledger

COSTS_GROUP = "titan_core.costs"


@hookspec
def estimate_costs(ledger: Ledger, estimate: Estimate, config: DictConfig, plugin_config: DictConfig, plan: Plan,
                   hardware: Hardware) -> None:
    """Say what this plugin's technique costs one rank: its memory, collectives, matrix products and traffic.

    Runs in ``python -m titan_core.planner`` and the dry run, in the launching process, once per enabled
    plugin in plan order, then for the model plugin, before anything is built. An enabled plugin without it is
    reported as not counted; a model plugin needs it only for what its own hooks run besides the model, which
    the planner traces (the planner prices :class:`titan_core.ExpertRouting`'s balancing all-reduce itself).
    Refuse a plan the hardware cannot run with :class:`titan_core.ConfigError`.

    :param ledger: This plugin's entries (:class:`titan_core.planner.Ledger`): what it may read of the plan on
        this rank and the terms it adds (docs/writing-plugins.md, "What your plugin costs").
    :param estimate: The planner's layout model (:class:`titan_core.planner.Estimate`), for a technique that
        changes where parameters, activations or micro-batches live: sharding, splitting, pipelining,
        recomputation (docs/planner-internals.md). A plugin that only adds costs never needs it.
    :param config: The whole job config.
    :param plugin_config: This plugin's options.
    :param plan: The plan being estimated.
    :param hardware: The accelerator profile the plan is priced on.
    """


@hookspec
def plan_options(config: DictConfig, plugin_config: DictConfig, model: ModelDescription, world_size: int,
                 hardware: Hardware) -> list[dict[str, Any] | None] | None:
    """The settings of this plugin worth trying on a cluster, for ``python -m titan_core.planner --recommend``.

    Runs once per plugin the command line enables, in the launching process. The core tries every
    combination of the plugins' alternatives, drops those a ``validate`` refuses or that do not fit, and
    ranks the rest. A plugin without it is tried with its options as given.

    :param config: The whole job config.
    :param plugin_config: This plugin's options as given.
    :param model: The model's description.
    :param world_size: The cluster's device count.
    :param hardware: The cluster's accelerator profile.
    :returns: Alternatives, each a dict of this plugin's options (``{}``: its defaults), or None in the list
        when the plan may leave the plugin out.
    """
