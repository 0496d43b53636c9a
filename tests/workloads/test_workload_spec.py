"""``kvoffload.workloads.spec``: a workload's label, and the layer it sits in (it imports
neither the simulator nor the reference engine nor the command line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kvoffload
from kvoffload.workloads.spec import WorkloadSpec

SRC = Path(kvoffload.__file__).resolve().parents[1]


def test_a_sized_builtin_workload_is_labelled_with_its_size_and_seed() -> None:
    assert WorkloadSpec("shared-prefix", None, None, 3, 5).label == (
        "shared-prefix, 5 users (seed 3)")


def test_the_spec_needs_no_simulator() -> None:
    script = (f"import json, sys; sys.path.insert(0, {str(SRC)!r}); "
              "import kvoffload.workloads.spec; "
              "print(json.dumps(sorted(m for m in sys.modules if m.startswith("
              "('kvoffload.sim', 'kvoffload.refengine', 'kvoffload.cli')))))")
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True,
                         text=True).stdout
    assert json.loads(out) == []
