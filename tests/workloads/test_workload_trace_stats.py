"""``trace_stats``: a trace's lengths, reuse share and reuse distance, exact on a
hand-made trace, and the reader's validation on every line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.errors import TraceError
from kvoffload.workloads.trace_stats import (
    Distribution,
    iter_trace_records,
    percentile,
    trace_stats,
)

# Four requests, 512-token blocks. Request 3 reuses block 1 behind a new first block (not
# a prefix a cache can serve).
HAND_MADE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1],
     "session_id": "a"},
    {"timestamp": 1000, "input_length": 1536, "output_length": 20, "hash_ids": [0, 1, 2],
     "session_id": "a"},
    {"timestamp": 3000, "input_length": 600, "output_length": 30, "hash_ids": [0, 3],
     "session_id": "b"},
    {"timestamp": 6000, "input_length": 1024, "output_length": 40, "hash_ids": [4, 1]},
]


def write_trace(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_figures_of_a_hand_made_trace_are_exact(tmp_path: Path) -> None:
    stats = trace_stats(write_trace(tmp_path / "t.jsonl", HAND_MADE))
    assert stats.requests == 4 and stats.duration_s == 6.0
    assert stats.request_rate == pytest.approx(4 / 6)
    assert stats.blocks == 9 and stats.unique_blocks == 5
    # reused: request 1 blocks 0, 1; request 2 block 0; request 3 block 1
    assert stats.reused_blocks == 4 and stats.reuse_share == 4 / 9
    assert stats.prefix_reused_blocks == 3 and stats.prefix_reuse_share == 3 / 9
    assert stats.ideal_hit_tokens == 1024 + 512
    assert stats.ideal_hit_share == 1536 / (1024 + 1536 + 600 + 1024)
    assert stats.input_tokens == Distribution(4, 4184, 1046.0, 1024, 1536, 1536, 600, 1536)
    assert stats.output_tokens == Distribution(4, 100, 25.0, 20, 40, 40, 10, 40)
    # distances to the previous use: requests [1, 1, 1, 2], seconds [1, 1, 2, 5]
    gaps = stats.reuse_distance_requests
    assert (gaps.count, gaps.p50, gaps.p90, gaps.max) == (4, 1, 2, 2)
    seconds = stats.reuse_distance_s
    assert (seconds.count, seconds.p50, seconds.p90, seconds.mean) == (4, 1.0, 5.0, 2.25)
    assert stats.sessions == 2
    assert stats.session_requests is not None and stats.session_requests.max == 2
    data = stats.to_dict()
    assert data["reuse_share"] == 4 / 9 and data["reuse_distance_requests"]["p90"] == 2
    assert json.loads(json.dumps(data)) == data


def test_no_reuse_no_sessions_and_limit(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [7]},
        {"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [8]},
        {"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [7]}])
    stats = trace_stats(path, limit=2)
    assert stats.requests == 2 and stats.reused_blocks == 0 and stats.reuse_share == 0
    assert stats.reuse_distance_requests == Distribution.of([])
    assert stats.sessions is None and stats.session_requests is None
    assert stats.duration_s == 0 and stats.request_rate is None
    assert trace_stats(path).reused_blocks == 1


def test_block_tokens_sets_the_count_of_ids_a_line_needs(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [0, 1, 2]}])
    assert trace_stats(path, block_tokens=4).blocks == 3
    with pytest.raises(TraceError) as info:
        trace_stats(path)
    assert (info.value.line, info.value.field) == (1, "input_length")


@pytest.mark.parametrize(("line", "field"), [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
     "timestamp"),
    ("[]", "<json>"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}',
     "hash_ids"),
])
def test_lines_are_checked_as_the_reader_checks_them(tmp_path: Path, line: str,
                                                     field: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(HAND_MADE[0]) + "\n" + line + "\n")
    with pytest.raises(TraceError) as info:
        list(iter_trace_records(path))
    assert (info.value.line, info.value.field) == (2, field)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="holds no request"):
        trace_stats(empty)


def test_percentiles_are_nearest_rank() -> None:
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert [percentile(values, p) for p in (0, 10, 50, 90, 99, 100)] == [1, 1, 5, 9, 10, 10]
    assert percentile([7], 50) == 7
