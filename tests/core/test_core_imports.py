"""The core (config, keys, jobs, policies, planner, tiers, blockfile) imports neither torch
nor numpy nor a higher layer (worker, models, workloads, refengine, sim, integrations, cli,
faults): ``docs/architecture.md``, "Layers".

A fresh interpreter blocks those packages on ``sys.meta_path`` (so they fail to import even
where installed), imports every core module and builds the policy registry (whose built-in
entries are imported on first use), and reports what got loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kvoffload"

CORE_PACKAGES = ("planner", "tiers", "blockfile")
"""Packages of the core, besides the modules at the top of ``kvoffload``."""

HIGHER_LAYERS = ("worker", "models", "workloads", "refengine", "sim", "integrations", "cli",
                 "faults")


def core_modules() -> list[str]:
    """Every module of the core, by its import name."""
    files = [p for p in SRC.glob("*.py") if p.name != "__init__.py"]
    for package in CORE_PACKAGES:
        files += [p for p in (SRC / package).rglob("*.py") if p.name != "__init__.py"]
    return sorted(".".join(("kvoffload", *p.relative_to(SRC).with_suffix("").parts))
                  for p in files)

SCRIPT = textwrap.dedent("""
    import importlib, json, sys

    BLOCKED = ("torch", "numpy")
    HIGHER = tuple("kvoffload." + layer for layer in json.loads(sys.argv[1]))

    def blocked(name):
        return name.split(".")[0] in BLOCKED or name.startswith(HIGHER)

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if blocked(name):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocker())
    try:
        import torch  # noqa: F401
        blocker_works = False
    except ImportError:
        blocker_works = True
    errors = {}
    for name in sys.argv[2:]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # report, do not crash: the test shows which one failed
            errors[name] = repr(exc)
    try:
        from kvoffload.policies import cache_policy_names
        cache_policy_names()
    except Exception as exc:
        errors["kvoffload.policies.cache_policy_names()"] = repr(exc)
    loaded = sorted(m for m in sys.modules if blocked(m))
    print(json.dumps({"blocker_works": blocker_works, "errors": errors, "loaded": loaded}))
""")


def run_blocked(modules: list[str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(HIGHER_LAYERS), *modules],
                         capture_output=True, text=True, check=True).stdout
    result: dict[str, object] = json.loads(out)
    return result


def test_core_imports_without_torch_numpy_or_a_higher_layer() -> None:
    modules = core_modules()
    assert "kvoffload.planner.planner" in modules and "kvoffload.config" in modules
    result = run_blocked(modules)
    assert result["blocker_works"] is True
    assert result["errors"] == {}
    assert result["loaded"] == []


def test_the_blocker_does_catch_a_module_that_needs_torch() -> None:
    # Guards the test above against a blocker that silently lets everything through.
    result = run_blocked(["kvoffload.worker.cuda"])
    errors = result["errors"]
    assert isinstance(errors, dict) and "kvoffload.worker.cuda" in errors
    assert "blocked" in errors["kvoffload.worker.cuda"]


def test_the_blocker_does_catch_a_module_of_a_higher_layer() -> None:
    result = run_blocked(["kvoffload.sim.replay"])
    errors = result["errors"]
    assert isinstance(errors, dict) and "blocked" in errors["kvoffload.sim.replay"]
