"""The command line sits on top of the library: no module of ``kvoffload.sim`` or
``kvoffload.workloads`` imports ``kvoffload.cli``, and the modules of ``kvoffload.cli``
import one another without a circle (every import counted, those inside functions and
under ``TYPE_CHECKING`` included)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvoffload

SRC = Path(kvoffload.__file__).resolve().parent


def imported(path: Path) -> set[str]:
    """Every ``kvoffload`` module ``path`` imports, wherever the import statement is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("kvoffload")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("kvoffload"):
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_library_never_imports_the_command_line() -> None:
    for package in ("sim", "workloads"):
        for path in sorted((SRC / package).rglob("*.py")):
            cli = sorted(n for n in imported(path) if n.split(".")[:2] == ["kvoffload", "cli"])
            assert cli == [], f"{module_name(path)} imports {cli}"


def test_the_command_line_modules_import_one_another_without_a_circle() -> None:
    modules = {module_name(p): p for p in sorted((SRC / "cli").glob("*.py"))
               if p.name != "__init__.py"}
    edges = {name: sorted(m for m in imported(path) if m in modules and m != name)
             for name, path in modules.items()}
    assert edges["kvoffload.cli.plots"] == ["kvoffload.cli.common"]
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join((*path, name))}"
        if name in done:
            return
        for target in edges[name]:
            visit(target, (*path, name))
        done.add(name)

    for name in modules:
        visit(name, ())
