"""Signals that predict a block's next read (``benchmarks/key_signals.py``)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from key_signals import SIGNALS, auc, main, replay, score


def write_trace(path: Path, prompts: list[list[int]]) -> Path:
    with path.open("w") as f:
        for i, ids in enumerate(prompts):
            f.write(json.dumps({"timestamp": i * 1000, "input_length": 512 * len(ids),
                                "output_length": 1, "hash_ids": ids}) + "\n")
    return path


def test_auc_counts_pairs_and_ties() -> None:
    assert auc([0.1, 0.2, 0.9, 0.8], [False, False, True, True]) == 1.0
    assert auc([0.9, 0.8, 0.1, 0.2], [False, False, True, True]) == 0.0
    assert auc([1, 1, 1, 1], [False, True, False, True]) == 0.5
    assert auc([1, 2, 3], [True, False, True]) == 0.5
    assert math.isnan(auc([1, 2], [True, True]))


def test_labels_follow_the_horizon_and_a_shared_prefix_is_predicted(tmp_path: Path) -> None:
    # Block 0 (a system prompt) opens every request; each request's own blocks never
    # come back. Horizon: 10 % of the distinct blocks.
    prompts = [[0, 100 + 3 * i, 101 + 3 * i, 102 + 3 * i] for i in range(40)]
    run, horizons = replay(write_trace(tmp_path / "t.jsonl", prompts), [0.1], None)
    assert horizons == [12]  # 121 distinct blocks
    # Per request: block 0 read again by the next request (3 new blocks later), the rest
    # never; the last request's block 0 has no later read.
    labels = [a.labels[0] for a in run.accesses]
    assert labels == [True, False, False, False] * 39 + [False] * 4
    rows = {(r["horizon_blocks"], r["half"]): r for r in score(run, horizons)}
    # Near the end, too few blocks come after an access to know its outcome: left out.
    assert rows[(12, "first")]["censored"] == 0
    assert 4 <= rows[(12, "second")]["censored"] < 20  # type: ignore[operator]
    first = rows[(12, "first")]
    assert first["read_again_after_store"] == 1 / 61  # block 0's store, of 61 stores
    assert first["read_again_after_first_read"] == 1.0
    assert first["read_again_after_later_read"] == 1.0
    assert first["depth"] == 0.0  # shallower is read again: perfectly
    assert first["reads"] > 0.9 and first["online"] > 0.9
    assert set(SIGNALS) <= set(first)


def test_a_read_past_the_horizon_is_a_miss(tmp_path: Path) -> None:
    # Block 0 comes back after 31 new blocks (its sibling and 30 others): within a
    # 32-block horizon (all 32 distinct blocks), not within a 3-block one.
    prompts = [[0, 1]] + [[10 + i] for i in range(30)] + [[0, 1]]
    run, horizons = replay(write_trace(tmp_path / "t.jsonl", prompts), [1.0, 0.08], None)
    assert horizons == [32, 3]
    first_access = run.accesses[0]
    assert first_access.labels == [True, False]


def test_the_cli_prints_a_table_or_json_and_refuses_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[0, i] for i in range(1, 30)])
    assert main(["--trace", str(trace), "--horizons", "10"]) == 0
    assert "| 10% | first |" in capsys.readouterr().out
    assert main(["--trace", str(trace), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 4 and rows[0]["accesses"] > 0
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["--trace", str(tmp_path / "empty.jsonl")]) == 2
    assert "key_signals.py:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--trace", str(trace), "--horizons", "0"])
    with pytest.raises(SystemExit):
        main(["--trace", str(trace), "--horizons", "five"])
