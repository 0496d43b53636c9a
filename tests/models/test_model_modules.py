"""The modules of ``kvoffload.models``: each states its contract, stays under 500 lines, and
their imports form no circle.

Imports are read from the source (no module is run): an import at a module's top level
counts, one under ``if TYPE_CHECKING:`` does not (it names a type and runs nothing), and no
module of the package may be imported inside a function (the way a circle is dodged).
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = "kvoffload.models"
MODELS = Path(__file__).resolve().parents[2] / "src" / "kvoffload" / "models"
MODULES = sorted(p.stem for p in MODELS.glob("*.py") if p.name != "__init__.py")
MAX_LINES = 500


def _tree(name: str) -> ast.Module:
    return ast.parse((MODELS / f"{name}.py").read_text(encoding="utf-8"))


def _package_modules(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules of this package ``node`` imports (``from kvoffload.models import x``
    imports ``x`` where ``x`` is one of them)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.module == PACKAGE:
        names = [f"{PACKAGE}.{a.name}" for a in node.names]
    else:
        names = [node.module or ""]
    return {n.removeprefix(f"{PACKAGE}.") for n in names
            if n.startswith(f"{PACKAGE}.") and n.removeprefix(f"{PACKAGE}.") in MODULES}


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
        and node.test.id == "TYPE_CHECKING"


def top_level_imports(name: str) -> set[str]:
    """The package's modules ``name`` imports when it runs."""
    out: set[str] = set()
    for node in _tree(name).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out |= _package_modules(node)
    return out


def nested_imports(name: str) -> set[str]:
    """The package's modules ``name`` imports anywhere but its top level and its
    ``TYPE_CHECKING`` block."""
    top = _tree(name)
    skip = {id(n) for n in top.body if isinstance(n, ast.Import | ast.ImportFrom)}
    for block in (n for n in top.body if _is_type_checking(n)):
        skip |= {id(n) for n in ast.walk(block)}
    return {m for n in ast.walk(top) if isinstance(n, ast.Import | ast.ImportFrom)
            and id(n) not in skip for m in _package_modules(n)}


@pytest.mark.parametrize("name", MODULES)
def test_module_states_its_contract_and_stays_small(name: str) -> None:
    assert ast.get_docstring(_tree(name)), f"{name}.py has no docstring"
    lines = len((MODELS / f"{name}.py").read_text(encoding="utf-8").splitlines())
    assert lines < MAX_LINES, f"{name}.py has {lines} lines"


@pytest.mark.parametrize("name", MODULES)
def test_no_import_of_the_package_inside_a_function(name: str) -> None:
    assert nested_imports(name) == set()


def test_imports_form_no_circle() -> None:
    graph = {name: top_level_imports(name) for name in MODULES}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:  # pragma: no cover - the failure message
        pytest.fail(f"import circle: {exc.args[1]}")
    assert graph["hf_config"] >= {"preset"} and "presets" not in graph["hf_config"]
    assert "hf_config" in graph["presets"]
    assert order.index("preset") < order.index("hf_config") < order.index("presets")
