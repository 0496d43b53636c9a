"""Every bad command-line value ends in one ``error:`` line naming the flag, exit status 2,
and no traceback; checked before anything is simulated."""

from __future__ import annotations

import pytest

from kvoffload.cli import main

S = ["simulate", "--limit", "3", "--no-baseline"]


@pytest.mark.parametrize(("argv", "flag", "needle"), [
    ([*S, "--host-capacity", "1e30"], "--host-capacity", "not a size"),
    ([*S, "--host-capacity=-1GiB"], "--host-capacity", "not a size"),
    ([*S, "--host-capacity", "nan"], "--host-capacity", "not a size"),
    ([*S, "--host-capacity", "1048577TiB"], "--host-capacity", "largest size"),
    ([*S, "--host-capacity", "1048576TiB"], "--host-capacity", "more than the simulation"),
    ([*S, "--engine-capacity", "1e309"], "--engine-capacity", "not a size"),
    ([*S, "--engine-capacity", "0"], "--engine-capacity", "must be positive"),
    ([*S, "--engine-capacity", "1000TB"], "--engine-capacity", "more than the simulation"),
    ([*S, "--engine-tokens", "1T"], "--engine-tokens", "more than the simulation"),
    ([*S, "--engine-tokens", "0"], "--engine-tokens", "must be positive"),
    ([*S, "--engine-tokens", "1e5"], "--engine-tokens", "not a size"),
    ([*S, "--disk-capacity", "0"], "--disk-capacity", "must be positive"),
    ([*S, "--disk-capacity", "16Gix"], "--disk-capacity", "not a size"),
    ([*S, "--remote-capacity", "0"], "--remote-capacity", "must be positive"),
    ([*S, "--block-size", "0"], "--block-size", "at least 1"),
    ([*S, "--block-size-factor=-2"], "--block-size-factor", "at least 1"),
    ([*S, "--max-seqs", "0"], "--max-seqs", "at least 1"),
    ([*S, "--max-batched-tokens", "99999999999"], "--max-batched-tokens", "at most"),
    ([*S, "--decode-steps", "0"], "--decode-steps", "at least 1"),
    ([*S, "--scale-bytes", "0"], "--scale-bytes", "at least 1"),
    ([*S, "--flops", "nan"], "--flops", "finite positive"),
    ([*S, "--bandwidth", "inf"], "--bandwidth", "finite positive"),
    ([*S, "--bandwidth", "fast"], "--bandwidth", "cannot read"),
    ([*S, "--remote-url", "http://127.0.0.1:6379/0"], "--remote-url", "not a Redis URL"),
    ([*S, "--disk-path", "", "--disk-capacity", "1GiB"], "--disk-path", "is empty"),
    ([*S, "--tier-faults", "0.1"], "--tier-faults", "needs a real tier"),
    ([*S, "--tier-faults", "0.1", "--disk-path", "/tmp/x", "--disk-capacity", "1GiB"],
     "--tier-faults", "--faults"),
    ([*S, "--tier-faults", "nan"], "--tier-faults", "[0, 1]"),
    ([*S, "--faults", "nan"], "--faults", "outside [0, 1]"),
    ([*S, "--faults", "0.1", "--load-deadline", "inf"], "--load-deadline", "finite"),
    ([*S, "--hang", "nan", "--faults", "0.1"], "--hang", "finite"),
    ([*S, "--plot", "x.txt"], "--plot", ".png"),
    (["sweep", "--plot", "x.txt"], "--plot", ".png"),
    (["sweep", "--plot", "x"], "--plot", ".png"),
    (["sweep", "--host-capacity", "1GiB,1e9"], "--host-capacity", "not a size"),
    (["sweep", "--host-capacity", "1GiB,0"], "--host-capacity", "cannot hold"),
    (["sweep", "--capacity-fraction", "nan"], "--capacity-fraction", "every share"),
    (["sweep", "--flops", "0"], "--flops", "finite positive"),
    ([*S, "--sessions", "1000000000"], "--sessions", "at most 10,000"),
    (["sweep", "--workload", "agentic", "--sessions", "10001"], "--sessions", "at most"),
])
def test_bad_input_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str],
                                           argv: list[str], flag: str, needle: str) -> None:
    status = main([*argv, "--quiet"])
    out, err = capsys.readouterr()
    assert status == 2, err
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert flag in lines[0] and needle in lines[0], err
