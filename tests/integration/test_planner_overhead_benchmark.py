"""``benchmarks/vllm_planner_overhead.py``: the values it refuses before it builds a
scheduler, each with a message naming the option (the runs themselves take minutes and
are not run here; CI's smoke run covers them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from vllm_planner_overhead import main


@pytest.mark.parametrize(("argv", "message"), [
    (["--requests", "0"], "--requests must be at least 1, got 0"),
    (["--repeat", "-2"], "--repeat must be at least 1, got -2"),
    (["--host-gib", "0"], "--host-gib must be a positive number of GiB"),
    (["--host-gib", "nan"], "--host-gib must be a positive number of GiB"),
])
def test_bad_values_are_refused_before_any_run(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
