"""``benchmarks/disk_breakdown.c`` includes the checksum extension's C source to time its
steps; it must keep compiling against that source as the source changes.

Compiling it (``-fsyntax-only``) takes a second; running it writes
gigabytes through the page cache, which is a benchmark's job, not a test's.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "disk_breakdown.c"


def test_disk_breakdown_compiles_against_the_checksum_source() -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        pytest.skip(f"no Python headers in {include} (the extension cannot be built either)")
    done = subprocess.run([compiler, "-fsyntax-only", "-pthread", f"-I{include}",
                           str(BENCHMARK)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
