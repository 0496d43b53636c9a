"""Every bad command-line value ends in one ``error:`` line naming the flag, exit status 2,
and no traceback; checked before anything is simulated."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvoffload.cli import main

S = ["simulate", "--limit", "3", "--no-baseline"]
SW = ["sweep", "--limit", "3"]
PL = ["plan", "--limit", "3", "--jobs", "1"]


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
    # Issue 40, second round: empty lists are refused, never read as the default.
    ([*SW, "--capacity-fraction", ""], "--capacity-fraction", "comma-separated list"),
    ([*SW, "--capacity-fraction", ","], "--capacity-fraction", "comma-separated list"),
    ([*SW, "--capacity-fraction", "0.1,x"], "--capacity-fraction", "shares"),
    ([*SW, "--seeds", ""], "--seeds", "comma-separated list"),
    ([*SW, "--seeds", "1,\u0663"], "--seeds", "ASCII digits"),
    ([*SW, "--seeds", ",".join(map(str, range(65)))], "--seeds", "at most 64"),
    ([*SW, "--seeds", "0," * 100_000], "--seeds", "at most 64"),
    ([*SW, "--policy", ""], "--policy", "comma-separated list"),
    ([*SW, "--preset", " , "], "--preset", "comma-separated list"),
    ([*SW, "--host-capacity", ""], "--host-capacity", "comma-separated list"),
    ([*PL, "--fractions", ""], "--fractions", "comma-separated list"),
    ([*PL, "--fractions", "0.5,\u0661"], "--fractions", "shares"),
    # Factors and counts have documented caps (docs/configuration.md).
    ([*S, "--block-size-factor", "1000000000"], "--block-size-factor", "at most 1024"),
    ([*SW, "--block-size-factor", "1025"], "--block-size-factor", "at most 1024"),
    # Digits other than ASCII are refused by count flags as by size flags.
    ([*S, "--engines", "\u00b3"], "--engines", "ASCII digits"),
    ([*S, "--engines", "\u0663"], "--engines", "ASCII digits"),
    ([*S, "--flops", "\u0664\u0660\u0660"], "--flops", "cannot read"),
    ([*S, "--engine-tokens", "\u0663k"], "--engine-tokens", "not a size"),
    # A huge value is named, not echoed (errors.shown).
    ([*S, "--policy", "p" * 100_000], "--policy", "100,002 characters"),
    ([*S, "--preset", "m" * 100_000], "--preset", "100,002 characters"),
    ([*S, "--bandwidth", "9" * 100_000], "--bandwidth", "characters"),
    ([*S, "--engines", "4" * 100_000], "--engines", "100,002 characters"),
    ([*S, "--router", "r" * 100_000, "--engines", "2"], "--router", "100,002 characters"),
    ([*S, "--host-capacity", "1" * 100_000], "--host-capacity", "100,002 characters"),
    ([*S, "--faults", "\u0660.\u0665"], "--faults", "not a number"),
    ([*S, "--faults", "0.1," + "k" * 100_000], "--faults", "100,002 characters"),
    # The MAC key of simulate's real tiers (docs/tiers.md).
    ([*S, "--tier-mac-key-file", "/etc/kvoffload/tier.key"], "--tier-mac-key-file",
     "real tiers"),
    ([*S, "--disk-path", "/tmp/kv", "--disk-capacity", "1GiB", "--tier-mac-key-file",
      "/nonexistent/tier.key"], "--tier-mac-key-file", "cannot open"),
    ([*S, "--disk-path", "/tmp/kv\0", "--disk-capacity", "1GiB"], "--disk-path", "NUL"),
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
    assert len(lines[0]) < 600, lines[0][:600]


def run_cli(argv: list[str]) -> int:
    """``main``'s status, also for a flag argparse refuses (it exits)."""
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code or 0)


@pytest.mark.parametrize(("argv", "flag"), [
    ([*S, "--block-size", "\u0663"], "--block-size"),  # int() reads Arabic-Indic 3 as 3
    ([*S, "--max-seqs", "\uff18"], "--max-seqs"),  # a fullwidth 8
    ([*S, "--sessions", "\u0661\u0660"], "--sessions"),
    ([*S, "--seed", "\u0967"], "--seed"),  # a Devanagari 1
    ([*S, "--decode-steps", "\u0663"], "--decode-steps"),
    ([*S, "--tier-faults", "\u0661"], "--tier-faults"),  # float() reads it as 1.0
    ([*S, "--hint-accuracy", "\u0660.\u0665"], "--hint-accuracy"),
    ([*PL, "--jobs", "\u0662"], "--jobs"),
    ([*S, "--block-size", "7" * 100_000], "--block-size"),
    ([*S, "--max-seqs", "abc"], "--max-seqs"),
])
def test_count_flags_take_ascii_digits_only(capsys: pytest.CaptureFixture[str],
                                            argv: list[str], flag: str) -> None:
    status = run_cli([*argv, "--quiet"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert flag in lines[0] and "ASCII" in lines[0] and len(lines[0]) < 400, lines[0][:400]


def plot_targets(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """``--plot`` values no plot can be written to, with what the error line says."""
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.png"
    folder.mkdir()
    return {
        "missing directory": (str(tmp_path / "nope" / "run.png"), "does not exist"),
        "proc": ("/proc/kvoffload-plot.png", "cannot write"),
        "fifo": (str(fifo), "a FIFO"),
        "directory": (str(folder), "a directory"),
        "nul": (str(tmp_path / "a\0.png"), "NUL"),
    }


@pytest.mark.parametrize("target", ["missing directory", "proc", "fifo", "directory", "nul"])
@pytest.mark.parametrize("command", [
    [*S, "--mode", "accounting"],
    ["sweep", "--host-capacity", "1GiB", "--policy", "lru", "--limit", "3"],
    ["plan", "--workload", "chat", "--limit", "3", "--policy", "lru", "--jobs", "1"],
])
def test_an_unwritable_plot_is_refused_before_the_run(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, command: list[str],
        target: str) -> None:
    path, needle = plot_targets(tmp_path)[target]
    started = time.monotonic()
    status = main([*command, "--plot", path, "--quiet"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --plot: "), err
    assert needle in lines[0]
    assert time.monotonic() - started < 5  # checked at start, not after the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.png", "folder.png"]


def test_a_writable_plot_path_is_probed_without_a_trace(tmp_path: Path) -> None:
    from kvoffload.cli.validate import check_plot_path

    check_plot_path(tmp_path / "new.png")  # made and removed again
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "old.png"
    kept.write_bytes(b"earlier plot")
    check_plot_path(kept)  # opened for writing, not truncated
    assert kept.read_bytes() == b"earlier plot"
