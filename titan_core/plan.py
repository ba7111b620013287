"""The plan of a job: which plugins take part, in what order, on what device mesh.

Every enabled plugin declares what it contributes (:class:`Declaration`); this module orders the declarations, checks
that their capabilities fit together and sizes the mesh, the same way in the launcher and in every worker. It is
pure arithmetic on the declarations: finding the plugins and calling their hooks is :mod:`titan_core.plugins`' job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from titan_core.description import ModelDescription
from titan_core.errors import ConfigError

# The core's mesh dimensions, outermost first: pipeline stages span the slowest links, tensor parallel the
# fastest. Plugins name them by these constants, never by string.
PP, DP_REPLICATE, DP_SHARD, CP, TP = "pp", "dp_replicate", "dp_shard", "cp", "tp"
MESH_DIMS = (PP, DP_REPLICATE, DP_SHARD, CP, TP)


def rest_of(dim: str) -> str:
    """The name of the ranks a borrowing dimension ``dim`` leaves of those it borrows (``ep`` -> ``ep_rest``)."""
    return f"{dim}_rest"


@dataclass(frozen=True)
class MeshDimension:
    """A mesh dimension: the core's (``MESH_DIMS``) or one a plugin adds in ``Declaration.dimensions``.

    ``after``: the dimension it follows in the mesh order, outermost first (None: innermost), so that a
    dimension whose collectives are frequent sits on the fast links. ``borrows``: dimensions, adjacent in
    that order, whose ranks it reuses instead of multiplying the world (expert parallel borrows the
    data- and context-parallel ranks); its degree must divide their product, and the mesh then also has
    ``rest_of(name)``, the borrowed ranks it leaves (the experts' FSDP shards over those). ``data_parallel``:
    ranks along it hold different samples; the batch is split over every such dimension. ``splits_sequence``:
    ranks along it hold different tokens of the same samples (context parallel); gradients average over them.
    """

    after: str | None = None
    borrows: tuple[str, ...] = ()
    data_parallel: bool = False
    splits_sequence: bool = False


CORE_DIMENSIONS = {PP: MeshDimension(), DP_REPLICATE: MeshDimension(data_parallel=True),
                   DP_SHARD: MeshDimension(data_parallel=True), CP: MeshDimension(splits_sequence=True),
                   TP: MeshDimension()}


@dataclass(frozen=True)
class Declaration:
    """What one plugin contributes; returned by its ``declare`` hook.

    ``stage`` orders model transforms (lower first; docs/architecture.md lists the first-party plugins'
    stages, which leave gaps for others). ``mesh`` maps mesh dimensions to degrees; -1 means "all ranks
    the other dimensions leave" (for a borrowing dimension: all the ranks it borrows). A dimension is the
    core's (``MESH_DIMS``) or one that ``dimensions`` defines (:class:`MeshDimension`). ``options`` names,
    for a dimension of ``mesh``, the plugin's option that sets its degree when it is not ``degree``: errors
    about that degree name it. ``provides`` and ``requires`` name capabilities (:mod:`titan_core.capabilities`).
    ``optimizer_options``: of a plugin building the optimizer, the ``optimizer.*`` options it honours. ``acts_only``:
    its options that act only beside another setting, ``{option: (condition, acts)}``: ``acts(plugin_config,
    config)`` tells whether the option acts, ``condition`` says when as a user sets it (``plugins.ac.mode=full``);
    set away from its default where it would do nothing, the option is refused before launch. ``replica_group``:
    ``(index, count)`` when this job is one of ``count`` jobs (replica groups) training one model on different rows,
    a plugin averaging their gradients across jobs (fault tolerance): the data splits over ``count`` x the job's
    data-parallel ranks, and this job reads the ``index``-th share.
    """

    stage: int | None = None
    mesh: Mapping[str, int] = field(default_factory=dict)
    provides: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    dimensions: Mapping[str, MeshDimension] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)
    optimizer_options: frozenset[str] = frozenset()
    acts_only: Mapping[str, tuple[str, Callable[[Any, Any], bool]]] = field(default_factory=dict)
    replica_group: tuple[int, int] | None = None


@dataclass(frozen=True)
class PlannedPlugin:
    """An enabled plugin in the plan: its name, the distribution that ships it and its declaration."""

    name: str
    distribution: str
    declaration: Declaration

    def degree_field(self, dim: str) -> str:
        """The option that sets this plugin's degree of ``dim``, as a user writes it."""
        return f"plugins.{self.name}.{self.declaration.options.get(dim, 'degree')}"


@dataclass(frozen=True)
class Plan:
    """A validated job: the plugins in transform order, the mesh and the model's description."""

    plugins: tuple[PlannedPlugin, ...]  # in transform order: stage, then name
    mesh_shape: Mapping[str, int]  # the dimensions whose degrees multiply to the world, in mesh order
    world_size: int
    model: ModelDescription
    borrowing: Mapping[str, int] = field(default_factory=dict)  # dimensions that reuse ranks: their degrees
    dimensions: Mapping[str, MeshDimension] = field(default_factory=dict)  # every sized dimension's definition
    replica_group: tuple[int, int] = (0, 1)  # this job's index among the jobs training the model, and their count

    def provides(self, capability: str) -> bool:
        """Whether some enabled plugin provides ``capability``."""
        return any(capability in p.declaration.provides for p in self.plugins)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.plugins]

    def degree(self, dim: str) -> int:
        """How many ranks ``dim`` spans (1 when the plan lacks it); ``rest_of(d)``: the borrowed ranks ``d`` leaves."""
        for borrower, (degree, dims) in self.borrowed().items():
            if dim == rest_of(borrower):
                return math.prod(self.mesh_shape[d] for d in dims) // degree
        return self.mesh_shape.get(dim, self.borrowing.get(dim, 1))

    @property
    def data_parallel_dims(self) -> tuple[str, ...]:
        """The dimensions whose ranks hold different samples, in mesh order."""
        return tuple(d for d in self.mesh_shape if self.definition(d).data_parallel)

    @property
    def dp_size(self) -> int:
        """The number of data-parallel ranks: the batch is split this many ways."""
        return math.prod(self.mesh_shape[d] for d in self.data_parallel_dims)

    @property
    def data_shards(self) -> int:
        """The shares a global batch's rows are split into: every replica group's data-parallel ranks."""
        return self.dp_size * self.replica_group[1]

    def data_shard(self, dp_rank: int) -> int:
        """Which of the ``data_shards`` the data-parallel rank ``dp_rank`` of this job reads: its group's, then its own."""
        return self.replica_group[0] * self.dp_size + dp_rank

    @property
    def token_shards(self) -> int:
        """The parts a global batch's tokens are split into (data-parallel ranks x sequence splits)."""
        return self.dp_size * math.prod(n for d, n in self.mesh_shape.items() if self.definition(d).splits_sequence)

    def definition(self, dim: str) -> MeshDimension:
        """What the sized dimension ``dim`` is: the core's or the plugin's that declared it."""
        return self.dimensions[dim] if dim in self.dimensions else CORE_DIMENSIONS[dim]

    def borrowed(self) -> dict[str, tuple[int, tuple[str, ...]]]:
        """For each borrowing dimension: its degree and the sized dimensions whose ranks it reuses."""
        return {dim: (degree, tuple(d for d in self.dimensions[dim].borrows if d in self.mesh_shape))
                for dim, degree in self.borrowing.items()}

    def describe(self) -> str:
        """The plan as the launcher prints it: the world, then a line per plugin in transform order."""
        shape = " x ".join(f"{d} {n}" for d, n in self.mesh_shape.items()) or "single process"
        shape += "".join(f"; {dim} {degree} within {' x '.join(dims)}"
                         for dim, (degree, dims) in self.borrowed().items())
        group, groups = self.replica_group
        shape += f"; replica group {group} of {groups}" if groups > 1 else ""
        lines = [f"titan-core plan: world {self.world_size} = {shape}; model {self.model.family}"]
        for p in self.plugins:
            d = p.declaration
            stage = "   -" if d.stage is None else f"{d.stage:4d}"
            extras = [f"mesh {dict(d.mesh)}" if d.mesh else "",
                      f"provides {sorted(d.provides)}" if d.provides else "",
                      f"requires {sorted(d.requires)}" if d.requires else ""]
            lines.append(f"  {stage}  {p.name:<12} {p.distribution:<20} " + "  ".join(e for e in extras if e))
        return "\n".join(lines)


def make_plan(planned: list[PlannedPlugin], model: ModelDescription, world_size: int | None,
              configured_world: int | None, local_gpus: int) -> Plan:
    """Order the declarations (stage, then name), check their capabilities and size the mesh.

    ``world_size`` is the given world under torchrun, else None: then a degree of -1 fills ``configured_world``
    (``launch.world_size``), or ``local_gpus``, and otherwise the world is what the degrees multiply to.
    """
    planned = sorted(planned, key=lambda p: (p.declaration.stage is None, p.declaration.stage or 0, p.name))
    _check_capabilities(planned)
    dimensions = _dimensions(planned)
    mesh_shape, borrowing = _mesh_shape(planned, dimensions, world_size, configured_world, local_gpus)
    groups = [p.declaration.replica_group for p in planned if p.declaration.replica_group is not None]
    if len(groups) > 1:
        raise ConfigError("plugins", "two plugins place this job in replica groups", "enable only one of them")
    return Plan(tuple(planned), mesh_shape, math.prod(mesh_shape.values()), model, borrowing,
                {dim: dimensions[dim] for dim in (*mesh_shape, *borrowing)}, *groups)


def _check_capabilities(planned: list[PlannedPlugin]) -> None:
    provider: dict[str, str] = {}
    for p in planned:
        for capability in sorted(p.declaration.provides):  # the same line whatever the hash seed
            if capability in provider:
                raise ConfigError(f"plugins=[{provider[capability]},{p.name}]", f"both provide '{capability}'",
                                  f"enable only one of {provider[capability]} and {p.name}")
            provider[capability] = p.name
    for p in planned:
        for capability in sorted(p.declaration.requires - provider.keys()):
            raise ConfigError(f"plugins.{p.name}", f"requires '{capability}', which no enabled plugin provides",
                              f"add a plugin that provides '{capability}' to +plugins=[...]")


def _dimensions(planned: list[PlannedPlugin]) -> dict[str, MeshDimension]:
    """Every dimension the job may size, in mesh order: the core's with the plugins' inserted."""
    order, definitions, owner = list(MESH_DIMS), dict(CORE_DIMENSIONS), dict[str, str]()  # owner: dim -> plugin
    for p in planned:
        for dim, definition in p.declaration.dimensions.items():
            field_name = f"plugins.{p.name}"
            if dim in definitions:
                by = f"plugins.{owner[dim]}" if dim in owner else "the core"
                raise ConfigError(field_name, f"defines mesh dimension '{dim}', which {by} already defines",
                                  "enable only one of them, or name the dimension differently")
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
    degrees: dict[str, tuple[int, PlannedPlugin]] = {}
    for p in planned:
        for dim, degree in p.declaration.mesh.items():
            if dim not in dimensions:
                raise ConfigError(f"plugins.{p.name}", f"declares unknown mesh dimension '{dim}'",
                                  f"use one of {', '.join(dimensions)}, or define it in Declaration.dimensions")
            if dim in degrees:
                owner = degrees[dim][1].name
                raise ConfigError(f"plugins.{p.name}", f"mesh dimension '{dim}' is already sized by plugins.{owner}",
                                  f"enable only one of {owner} and {p.name}")
            if not (degree == -1 or degree >= 1):
                raise ConfigError(p.degree_field(dim), f"{dim} degree {degree} is not a positive integer or -1",
                                  "use a positive degree, or -1 for all remaining ranks")
            degrees[dim] = (degree, p)
    borrowing = {dim: degrees.pop(dim) for dim in list(degrees) if dimensions[dim].borrows}

    world = world_size if world_size is not None else configured_world
    fixed = math.prod(d for d, _ in degrees.values() if d != -1)
    fill = [dim for dim, (d, _) in degrees.items() if d == -1]
    if len(fill) > 1:
        raise ConfigError(degrees[fill[1]][1].degree_field(fill[1]), "only one mesh dimension may be -1",
                          "give the others explicit degrees")
    if fill:
        field_name = degrees[fill[0]][1].degree_field(fill[0])
        world = world or local_gpus or None
        if world is None:
            raise ConfigError(field_name, f"-1 needs a world size to fill ({fill[0]})",
                              "give an explicit degree, or set launch.world_size=N, or run under torchrun")
        if world % fixed:
            raise ConfigError(field_name, f"world {world} is not divisible by the other degrees ({fixed})",
                              "choose degrees whose product divides the world size")
        degrees[fill[0]] = (world // fixed, degrees[fill[0]][1])
    shape = {dim: degrees[dim][0] for dim in dimensions if dim in degrees}
    product = math.prod(shape.values())
    if world is not None and product != world:
        source = "WORLD_SIZE from torchrun" if world_size is not None else "launch.world_size"
        raise ConfigError("plugins.*.degree", f"the degrees multiply to {product} but {source} is {world}",
                          f"make the product of the degrees equal {world}, or set one degree to -1")
    lenders = {dim: (f"{dim} {degree} from {p.degree_field(dim)}") for dim, (degree, p) in degrees.items()}
    return shape, {dim: _borrowed_degree(dim, degree, owner, dimensions, shape, lenders)
                   for dim, (degree, owner) in borrowing.items()}


def _borrowed_degree(dim: str, degree: int, owner: PlannedPlugin, dimensions: dict[str, MeshDimension],
                     shape: dict[str, int], lenders: dict[str, str]) -> int:
    """The degree of a borrowing dimension, checked against the ranks it borrows; an error names the option
    the user set for it and the options that sized the ranks it borrows."""
    borrowed = [d for d in dimensions[dim].borrows if d in shape]
    ranks = math.prod(shape[d] for d in borrowed)
    names = " x ".join(dimensions[dim].borrows)
    positions = [list(shape).index(d) for d in borrowed]
    if positions and positions != list(range(positions[0], positions[0] + len(positions))):
        raise ConfigError(f"plugins.{owner.name}", f"mesh dimension '{dim}' borrows {names}, which are not adjacent "
                          f"in the mesh order ({', '.join(shape)})", "borrow adjacent dimensions")
    degree = ranks if degree == -1 else degree
    if ranks % degree:
        sized = "; ".join(lenders[d] for d in borrowed if d in lenders) or "no plugin sizes them"
        raise ConfigError(owner.degree_field(dim), f"{dim} degree {degree} does not divide the {ranks} rank(s) of "
                          f"{names} it borrows ({sized})", f"set {owner.degree_field(dim)} to a divisor of {ranks}, "
                          f"or enlarge {names}")
    return degree
