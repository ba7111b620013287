"""The core's layout as its map: no import cycle and no import hidden in a function to dodge one; plugins and
examples reach the core through its front door only; the contract typed and documented; the contract and the
training loop small enough to read alone."""

import ast
import inspect
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

import titan_core
import titan_core.hookspecs as hookspecs
import titan_core.planner.hookspecs as planner_hookspecs
from titan_core.testing import TINY

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
    """Plugin and example code imports ``titan_core`` itself, a pricing module (``costs.py``) also the planner's
    front door; their tests also the testing kit."""
    files = _plugin_files(tests)
    assert len(files) > 10
    elsewhere = []
    for path in files:
        allowed = {"titan_core", "titan_core.testing"} if tests else {"titan_core"}
        allowed |= {"titan_core.planner"} if tests or path.name == "costs.py" else set()
        elsewhere += [f"{path.relative_to(ROOT)}: {imported}" for imported, _ in core_imports(path)
                      if imported not in allowed and not imported.startswith("titan_core.testing")]
    assert elsewhere == []


def test_a_plugins_technique_never_loads_its_pricing():
    """What training imports of a plugin (every module but costs.py) imports neither the planner nor the plugin's
    pricing module, so that training never loads the planner; every first-party plugin that prices its technique
    registers its pricing module under titan_core.costs."""
    costs = [path for path in _plugin_files(False) if path.name == "costs.py"]
    assert len(costs) >= 15
    pricing_modules = {f"{path.parent.name}.costs" for path in costs}
    loading = [f"{path.relative_to(ROOT)}: {node.module}" for path in _plugin_files(False) if path.name != "costs.py"
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
               and node.module and (node.module in pricing_modules or node.module.startswith("titan_core.planner"))]
    assert loading == []
    for path in costs:
        project = (path.parents[1] / "pyproject.toml").read_text()
        assert '[project.entry-points."titan_core.costs"]' in project, path
        assert f'"{path.parent.name}.costs"' in project, path


def test_training_a_job_never_imports_the_planner(tmp_path):
    """The training contract and loop know nothing of the planner: a job trained in this process (a world of one,
    with plugins on) leaves no module of titan_core.planner imported; its dry run does load it."""
    script = textwrap.dedent("""
        import runpy, sys
        sys.argv = ["titan_core.run", *sys.argv[1:]]
        runpy.run_module("titan_core.run", run_name="__main__")
        print("PLANNER", sorted(m for m in sys.modules if m.startswith("titan_core.planner")))
    """)
    job = [*TINY, "training.steps=1", "+plugins=[ac,checkpoint,float8]",
           f"hydra.run.dir={tmp_path / 'run'}"]
    trained = subprocess.run([sys.executable, "-c", script, *job], capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "PLANNER []" in trained.stdout, trained.stdout[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    dry = subprocess.run([sys.executable, "-c", script, *job[:-1], "launch.dry_run=true",
                          f"hydra.run.dir={tmp_path / 'dry'}"], capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "titan-core estimate:" in dry.stdout and "'titan_core.planner.costs'" in dry.stdout


def test_the_front_door_lists_what_it_holds():
    assert len(titan_core.__all__) == len(set(titan_core.__all__))
    assert all(hasattr(titan_core, name) for name in titan_core.__all__)
    for name in ("hookimpl", "Declaration", "MeshDimension", "ModelDescription", "ConfigError", "add_loss", "Stateful",
                 "TrainState", "ParallelMesh", "DP_SHARD", "PIPELINE"):
        assert name in titan_core.__all__


HOOKS = [(module, name) for module in (hookspecs, planner_hookspecs) for name, value in vars(module).items()
         if callable(value) and hasattr(value, f"{hookspecs.PROJECT}_spec")]


def test_every_hook_is_typed_and_documented():
    """25 hooks in the training contract, 2 in the planner's room."""
    assert [len([name for module, name in HOOKS if module is room]) for room in (hookspecs, planner_hookspecs)] == [
        25, 2]
    for module, name in HOOKS:
        hook = getattr(module, name)
        hints = typing.get_type_hints(hook)
        arguments = list(inspect.signature(hook).parameters)
        assert set(arguments) | {"return"} == set(hints), name
        doc = inspect.getdoc(hook)
        assert doc and ("Runs" in doc or "runs" in doc), f"{name}: say when it runs"


def test_the_contract_and_the_loop_are_readable_alone():
    lines = {name: len((CORE / name).read_text().splitlines()) for name in CONTRACT + LOOP}
    assert sum(lines.values()) <= 2000, lines


MISTYPED = """
from torch import nn

from titan_core import ParallelMesh, hookimpl


@hookimpl
def apply_parallelism(model_parts: nn.Module, mesh: ParallelMesh) -> list[nn.Module] | None:
    return None


@hookimpl
def declare() -> int:
    return 3


@hookimpl
def build_schedule(model_parts) -> int:
    return 3
"""
WELL_TYPED = """
from typing import Any

from torch import nn

from titan_core import Declaration, hookimpl


@hookimpl
def apply_parallelism(model_parts: list[nn.Module], mesh: Any) -> None:
    return None


@hookimpl
def declare(plugin_config) -> Declaration:
    return Declaration()


@hookimpl
def step_metrics() -> dict:
    return {}


class Steps:
    def run(self, inputs, labels, model_kwargs):
        return None


@hookimpl
def build_schedule(model_parts) -> Steps:
    return Steps()
"""


def test_the_first_lane_refuses_a_mistyped_hook_implementation(tmp_path):
    """CI's first lane (.ci/first-lane, run by .ci/run before the suite) checks every hook implementation's types
    against its spec: an argument typed narrower than the spec passes, a return wider, fail it with one line each."""
    (tmp_path / "mistyped.py").write_text(MISTYPED)
    (tmp_path / "well_typed.py").write_text(WELL_TYPED)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}

    def check(module):
        return subprocess.run([sys.executable, "-m", "titan_core.tools.hook_types", module], capture_output=True,
                              text=True, env=env, timeout=120)
    bad, good = check("mistyped"), check("well_typed")
    assert bad.returncode == 1
    assert bad.stderr.splitlines() == [
        "titan-core: hook types: mistyped: apply_parallelism(model_parts: Module): the spec passes "
        "list[torch.nn.modules.module.Module]",
        "titan-core: hook types: mistyped: build_schedule returns int, the spec Schedule",
        "titan-core: hook types: mistyped: declare returns int, the spec titan_core.plan.Declaration | None"]
    assert good.returncode == 0, good.stderr
    lane = (ROOT / ".ci" / "first-lane").read_text()
    assert all(step in lane for step in ("ruff check .", "mypy titan_core", "python -m titan_core.tools.hook_types"))
    run = (ROOT / ".ci" / "run").read_text().splitlines()
    assert run.index("bash .ci/first-lane") < run.index("python -m pytest")
