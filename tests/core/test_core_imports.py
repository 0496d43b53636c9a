"""The core (planner, tiers, config, keys, jobs) imports without torch or numpy.

LAYOUT.md: "core (pure Python, no torch) ... Importable without torch -- a test can prove
it." A fresh interpreter blocks ``torch`` and ``numpy`` on ``sys.meta_path`` (so they fail
to import even where installed), imports the core, and reports what got loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CORE_MODULES = [
    "kvoffload.planner.planner",
    "kvoffload.planner.lookup",
    "kvoffload.tiers.host",
    "kvoffload.ledger",
    "kvoffload.config",
    "kvoffload.keys",
    "kvoffload.jobs",
]

SCRIPT = textwrap.dedent("""
    import importlib, json, sys

    BLOCKED = ("torch", "numpy")

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocker())
    try:
        import torch  # noqa: F401
        blocker_works = False
    except ImportError:
        blocker_works = True
    errors = {}
    for name in sys.argv[1:]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # report, do not crash: the test shows which one failed
            errors[name] = repr(exc)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print(json.dumps({"blocker_works": blocker_works, "errors": errors, "loaded": loaded}))
""")


def run_blocked(modules: list[str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, *modules], capture_output=True,
                         text=True, check=True).stdout
    result: dict[str, object] = json.loads(out)
    return result


def test_core_imports_with_torch_and_numpy_unavailable() -> None:
    result = run_blocked(CORE_MODULES)
    assert result["blocker_works"] is True
    assert result["errors"] == {}
    assert result["loaded"] == []


def test_the_blocker_does_catch_a_module_that_needs_torch() -> None:
    # Guards the test above against a blocker that silently lets everything through.
    result = run_blocked(["kvoffload.worker.cuda"])
    errors = result["errors"]
    assert isinstance(errors, dict) and "kvoffload.worker.cuda" in errors
    assert "blocked" in errors["kvoffload.worker.cuda"]
