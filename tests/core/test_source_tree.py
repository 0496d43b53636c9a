"""The shape of ``src/kvoffload``, read from the source: its layers, no import circle, and
rooms of a readable size (``docs/architecture.md``, "Layers").

Every ``import`` and ``from ... import`` of a kvoffload module that runs counts, at module
level or inside a function: an import placed in a function to dodge a circle is still a
circle. Imports under ``if TYPE_CHECKING:`` never run; they name types for annotations
(a value and the rules of its kind, a layout and the preset it came from may name each
other), so they are left out of the circle check, but not of the layers: a package may
import only its own modules and the packages its layer allows (``ALLOWED``), for types too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "kvoffload"

CORE = frozenset({"core", "planner", "tiers", "blockfile"})
"""The core: the modules at the top of ``kvoffload`` and these packages. They decide; the
block file format is beside them (the tiers read its sizes)."""

ALLOWED: Mapping[str, frozenset[str]] = {
    **{package: CORE for package in CORE},
    "worker": CORE | {"worker"},
    "models": CORE | {"models"},
    "workloads": CORE | {"workloads"},
    "refengine": CORE | {"worker", "models", "workloads", "refengine"},
    "sim": CORE | {"worker", "models", "workloads", "refengine", "sim"},
    "faults": CORE | {"worker", "models", "workloads", "refengine", "sim", "faults"},
    "integrations": CORE | {"worker", "integrations"},
    "cli": CORE | {"worker", "models", "workloads", "refengine", "sim", "faults", "cli"},
}
"""What each package may import. ``core`` stands for the top-level modules."""

MAX_MODULE_LINES = 500
MAX_METHODS = 25
"""Methods of one class, dunders aside."""

METHOD_LIMIT_EXEMPT = {"kvoffload.integrations.vllm.connector.KVOffloadConnector":
                       "one method per hook of vLLM's KVConnectorBase_V1, each delegating "
                       "to the scheduler or worker side"}


def package_of(module: str) -> str:
    """``kvoffload.planner.lookup`` -> ``planner``; a top-level module -> ``core``."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (SRC / parts[1]).is_dir()):
        return parts[1]
    return "core"


def module_name(path: Path, root: Path = SRC) -> str:
    """``<root>/planner/lookup.py`` -> ``kvoffload.planner.lookup``."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, known: Iterable[str], *, types: bool = True) -> set[str]:
    """The kvoffload modules ``source`` imports, wherever the import statement stands;
    without ``types``, leaving out those under ``if TYPE_CHECKING:``."""
    names = set(known)
    tree = ast.parse(source)
    skipped: set[int] = set()
    if not types:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in out if name in names}


def import_graph(root: Path = SRC, *, types: bool = True) -> dict[str, set[str]]:
    """Module -> the kvoffload modules it imports (a package's ``__init__`` counts as the
    package); without ``types``, only the imports that run."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    return {name: imported(path.read_text(), files, types=types) - {name}
            for name, path in files.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_violations(graph: Mapping[str, set[str]]) -> list[str]:
    """Every import a package's layer does not allow, as ``importer -> imported``."""
    bad = []
    for module, deps in sorted(graph.items()):
        allowed = ALLOWED[package_of(module)]
        bad += [f"{module} -> {dep}" for dep in sorted(deps) if package_of(dep) not in allowed]
    return bad


def test_no_import_circle_in_src() -> None:
    graph = import_graph(types=False)
    assert "kvoffload.planner.planner" in graph and len(graph) > 100
    assert cycles(graph) == []


def test_every_package_imports_only_what_its_layer_allows() -> None:
    graph = import_graph()
    assert set(map(package_of, graph)) <= set(ALLOWED), "a package no layer names"
    assert layer_violations(graph) == []


def test_every_module_states_its_contract_and_stays_small() -> None:
    for path in sorted(SRC.rglob("*.py")):
        source = path.read_text()
        name = module_name(path)
        assert ast.get_docstring(ast.parse(source)), f"{name} has no docstring"
        assert source.count("\n") <= MAX_MODULE_LINES, f"{name} is over {MAX_MODULE_LINES} lines"


def methods(cls: ast.ClassDef) -> list[str]:
    """The names of a class's own methods, dunders aside."""
    return [node.name for node in cls.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and not (node.name.startswith("__") and node.name.endswith("__"))]


def test_no_class_has_more_than_about_25_methods() -> None:
    big = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and len(methods(node)) > MAX_METHODS:
                big[f"{module_name(path)}.{node.name}"] = len(methods(node))
    assert set(big) <= set(METHOD_LIMIT_EXEMPT), big


# Negative controls: the checks find what they look for.


def test_methods_counts_what_a_class_defines() -> None:
    cls = ast.parse("class C:\n    def __init__(self): ...\n    def a(self): ...\n"
                    "    @property\n    def b(self): ...\n    x = 1\n").body[0]
    assert isinstance(cls, ast.ClassDef) and methods(cls) == ["a", "b"]


def test_a_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "kvoffload"
    (pkg / "planner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("from kvoffload.policies import x\n")
    (pkg / "policies.py").write_text("def f():\n    from kvoffload.planner import lookup\n")
    (pkg / "planner" / "__init__.py").write_text("")
    (pkg / "planner" / "lookup.py").write_text("import kvoffload.config\n")
    assert cycles(import_graph(pkg, types=False)) == [
        ["kvoffload.config", "kvoffload.planner.lookup", "kvoffload.policies"]]
    # The same circle closed by an annotation-only import is not one that runs.
    (pkg / "planner" / "lookup.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvoffload.config\n")
    assert cycles(import_graph(pkg, types=False)) == []
    assert len(cycles(import_graph(pkg))) == 1
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(("edge", "bad"), [
    (("kvoffload.planner.planner", "kvoffload.worker.worker"), True),
    (("kvoffload.tiers.host", "kvoffload.sim.fleet"), True),
    (("kvoffload.refengine.engine", "kvoffload.cli.report"), True),
    (("kvoffload.integrations.vllm.connector", "kvoffload.refengine.engine"), True),
    (("kvoffload.sim.fleet", "kvoffload.refengine.engine"), False),
    (("kvoffload.worker.worker", "kvoffload.config"), False),
])
def test_an_import_against_the_layers_is_found(edge: tuple[str, str], bad: bool) -> None:
    importer, target = edge
    assert bool(layer_violations({importer: {target}})) is bad
