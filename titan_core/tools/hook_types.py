"""``python -m titan_core.tools.hook_types [MODULE ...]``: check that hook implementations are typed as the specs say.

pluggy checks a hook implementation's argument names when it registers it; nothing checks their types, because
hooks are free functions that no type checker sees called. This tool compares every annotated argument and
return type of each ``@hookimpl`` with its spec's (the training contract's, :mod:`titan_core.hookspecs`, or the
planner's, :mod:`titan_core.planner.hookspecs`): an argument may be annotated as the spec's type or wider, a
return as the spec's or narrower; an implementation left unannotated is not checked. Without arguments it checks
every installed plugin, model and pricing module; with arguments, the modules named. Exit 1 with one line per
mismatch; CI's first lane runs it before the suite.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points

import titan_core.hookspecs as training_hookspecs
import titan_core.planner.hookspecs as planner_hookspecs

GROUPS = ("titan_core.plugins", "titan_core.models", planner_hookspecs.COSTS_GROUP)
MARK = f"{training_hookspecs.PROJECT}_impl"


def specs() -> dict[str, Callable]:
    """Every hook spec by name, the training contract's and the planner's."""
    return {name: value for module in (training_hookspecs, planner_hookspecs) for name, value in vars(module).items()
            if callable(value) and hasattr(value, f"{training_hookspecs.PROJECT}_spec")}


def implementations(target: object) -> Iterator[tuple[str, Callable]]:
    """The hook implementations of a plugin module, class or object."""
    for name, value in inspect.getmembers(target):
        if callable(value) and hasattr(value, MARK):
            yield name, value


def fits(actual, expected) -> bool:
    """Whether a value of type ``actual`` may be passed where ``expected`` is declared."""
    if actual == expected or expected in (typing.Any, object) or actual is typing.Any:
        return True
    if _is_union(actual):
        return all(fits(member, expected) for member in typing.get_args(actual))
    if _is_union(expected):
        return any(fits(actual, member) for member in typing.get_args(expected))
    origin, expected_origin = typing.get_origin(actual), typing.get_origin(expected)
    if expected_origin is not None:
        if origin is None:  # a bare generic (dict): its arguments are Any
            return fits(actual, expected_origin)
        if not fits(origin, expected_origin):
            return False
        arguments, expected_arguments = typing.get_args(actual), typing.get_args(expected)
        return not expected_arguments or (len(arguments) == len(expected_arguments) and all(
            fits(a, e) for a, e in zip(arguments, expected_arguments)))
    actual = origin or actual
    if not (isinstance(actual, type) and isinstance(expected, type)):
        return False
    try:
        return issubclass(actual, expected)
    except TypeError:  # a protocol with data members (titan_core.Tokenizer) is not checkable by class
        return True


def _is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def mismatches(where: str, target: object) -> list[str]:
    """One line per hook implementation of ``target`` whose annotations contradict its spec."""
    known, found = specs(), []
    for name, impl in implementations(target):
        spec = known.get(name)
        if spec is None:
            continue  # pluggy refuses an unknown hook when the plugin is registered
        try:
            hints, spec_hints = typing.get_type_hints(impl), typing.get_type_hints(spec)
        except Exception as error:  # an annotation naming what the module cannot resolve
            found.append(f"{where}: {name}: its annotations do not resolve ({type(error).__name__}: {error})")
            continue
        for argument, annotation in hints.items():
            expected = spec_hints.get(argument)
            if argument == "return":
                if expected is not None and not fits(annotation, expected):
                    found.append(f"{where}: {name} returns {_shown(annotation)}, the spec {_shown(expected)}")
            elif expected is not None and not fits(expected, annotation):
                found.append(f"{where}: {name}({argument}: {_shown(annotation)}): the spec passes "
                             f"{_shown(expected)}")
    return found


def _shown(annotation) -> str:
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def installed() -> Iterator[tuple[str, object]]:
    """Every installed plugin, model and pricing module, loaded as its entry point names it."""
    for group in GROUPS:
        for point in entry_points(group=group):
            yield f"{group}:{point.name} ({point.value})", point.load()


def main(argv: list[str]) -> int:
    targets = [(name, importlib.import_module(name)) for name in argv] if argv else list(installed())
    found = [line for where, target in targets for line in mismatches(where, target)]
    for line in found:
        print(f"titan-core: hook types: {line}", file=sys.stderr)
    print(f"titan-core: hook types: {len(targets)} modules checked, {len(found)} mismatches")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
