"""The core's layout as its map: no import cycle and no import hidden in a function to dodge one; plugins and
examples reach the core through its front door only; the contract typed and documented; the contract and the
training loop small enough to read alone."""

import ast
import inspect
import typing
from pathlib import Path

import pytest

import titan_core
from titan_core import hookspecs

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "titan_core"
# The contract (what a plugin or model author reads: the hooks, the plan, the model's description, the mesh, how
# plugins are found and called) and the training loop (what runs it). The seams and helpers beside them
# (attention.py, data_parallel.py, options.py, initialization.py) are read when needed, not to follow the flow.
CONTRACT = ("__init__.py", "hookspecs.py", "plan.py", "plugins.py", "description.py", "capabilities.py", "errors.py",
            "objective.py", "train_state.py", "mesh.py")
LOOP = ("train.py", "default_hooks.py", "preemption.py")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = CORE.joinpath(*name.split(".")[1:])
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def core_imports(path: Path) -> list[tuple[str, bool]]:
    """The titan_core modules ``path`` imports, each with whether the import sits inside a function."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("titan_core"):
                # ``from titan_core import train`` names a submodule, as an import of it would; other names come
                # from the module itself.
                submodules = {alias.name for alias in child.names if _is_module(f"{child.module}.{alias.name}")}
                found.extend((f"{child.module}.{name}", inside) for name in sorted(submodules))
                if len(submodules) < len(child.names):
                    found.append((child.module, inside))
            elif isinstance(child, ast.Import):
                found.extend((alias.name, inside) for alias in child.names if alias.name.startswith("titan_core"))
            visit(child, inside)
    visit(tree, False)
    return found


def core_modules() -> dict[str, Path]:
    return {module_name(path): path for path in CORE.rglob("*.py")}


def test_no_core_import_inside_a_function():
    hidden = [f"{name} imports {imported}" for name, path in core_modules().items()
              for imported, inside in core_imports(path) if inside]
    assert hidden == []


def test_the_core_has_no_import_cycle():
    modules = core_modules()
    edges = {name: set() for name in modules}
    for name, path in modules.items():
        # A module's own packages are imported before it, so importing through them never waits on it; the
        # root is the front door, which no module of the core imports (checked below).
        ancestors = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        for imported, _ in core_imports(path):
            # Importing a module runs the __init__ of each package above it first.
            for target in (imported, *(imported.rsplit(".", k)[0] for k in range(1, imported.count(".")))):
                if target in modules and target != name and target not in ancestors:
                    edges[name].add(target)
    seen, on_path, cycles = set(), [], []

    def walk(node):
        if node in on_path:
            cycles.append(on_path[on_path.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        on_path.append(node)
        for target in sorted(edges[node]):
            walk(target)
        on_path.pop()
    for node in sorted(edges):
        walk(node)
    assert cycles == []
    # No module of the core imports the front door: the front door depends on them, never the reverse.
    assert [name for name, path in modules.items() for imported, _ in core_imports(path)
            if imported == "titan_core" and name != "titan_core"] == []


def _plugin_files(tests: bool) -> list[Path]:
    packages = [p for folder in ("plugins", "examples") for p in (ROOT / folder).glob("*/titan_*") if p.is_dir()]
    code = [f for package in packages for f in package.rglob("*.py")]
    if tests:
        return [f for folder in ("plugins", "examples") for f in (ROOT / folder).glob("*/tests/*.py")]
    return code


@pytest.mark.parametrize("tests", [False, True], ids=["plugin code", "plugin tests"])
def test_plugins_and_examples_use_the_front_door_only(tests):
    """Plugin and example code imports ``titan_core`` itself; their tests also the testing kit."""
    allowed = {"titan_core", "titan_core.testing"} if tests else {"titan_core"}
    files = _plugin_files(tests)
    assert len(files) > 10
    elsewhere = [f"{path.relative_to(ROOT)}: {imported}" for path in files for imported, _ in core_imports(path)
                 if imported not in allowed and not imported.startswith("titan_core.testing")]
    assert elsewhere == []


def test_the_front_door_lists_what_it_holds():
    assert len(titan_core.__all__) == len(set(titan_core.__all__))
    assert all(hasattr(titan_core, name) for name in titan_core.__all__)
    for name in ("hookimpl", "Declaration", "MeshDimension", "ModelDescription", "ConfigError", "add_loss", "Stateful",
                 "TrainState", "ParallelMesh", "DP_SHARD", "PIPELINE"):
        assert name in titan_core.__all__


HOOKS = [name for name, value in vars(hookspecs).items()
         if callable(value) and hasattr(value, f"{hookspecs.PROJECT}_spec")]


def test_every_hook_is_typed_and_documented():
    assert len(HOOKS) == 26
    for name in HOOKS:
        hook = getattr(hookspecs, name)
        hints = typing.get_type_hints(hook)
        arguments = list(inspect.signature(hook).parameters)
        assert set(arguments) | {"return"} == set(hints), name
        doc = inspect.getdoc(hook)
        assert doc and ("Runs" in doc or "runs" in doc), f"{name}: say when it runs"


def test_the_contract_and_the_loop_are_readable_alone():
    lines = {name: len((CORE / name).read_text().splitlines()) for name in CONTRACT + LOOP}
    assert sum(lines.values()) <= 2000, lines
