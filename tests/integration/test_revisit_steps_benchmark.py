"""``benchmarks/revisit_steps.py``: how it splits the engine steps before the last first
token (plain data), and which configurations it refuses before starting vLLM (the
benchmark itself runs vLLM for a minute or more and is not run here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from revisit_steps import Step, main, split_steps


def test_steps_split_into_load_waits_prefill_and_decode_until_the_last_first_token() -> None:
    steps = [Step(0.000, ()),                # every request waits for its load
             Step(0.002, (128,)),            # a revisit's new tokens
             Step(0.150, (1, 128, 128)),     # one decodes, two prefill
             Step(0.400, (1, 1, 1)),         # decode only
             Step(0.420, (1, 1, 1))]         # begins after the last first token: left out
    count, empty, prefill, decode = split_steps(steps, until=0.410)
    assert count == 4
    assert empty == pytest.approx(0.002)
    assert prefill == pytest.approx(0.398)  # 0.148 + 0.250
    assert decode == pytest.approx(0.010)   # the decode step, cut at ``until``


def test_no_step_before_the_first_token_splits_into_nothing() -> None:
    assert split_steps([Step(1.0, (5,))], until=0.5) == (0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("configs", ["none", "redis", "host,restart", "nope", ""])
def test_configurations_other_than_host_and_disk_are_refused_before_vllm_starts(
        configs: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--configs", configs])
    assert exit_.value.code == 2
    assert "choose from host, disk" in capsys.readouterr().err
