"""The Mooncake trace reader, on a slice of the shared trace and on malformed lines."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from kvoffload.errors import TraceError
from kvoffload.keys import BlockHasher
from kvoffload.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    mooncake_block_tokens,
    read_mooncake_trace,
)

_REPO = Path(__file__).resolve().parents[2]
TRACE = Path(os.environ.get(
    "KVOFFLOAD_TRACE", _REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"))
# CI always has the shared trace beside the checkout: there, a missing trace is a failure.
needs_trace = pytest.mark.skipif(not TRACE.exists() and not os.environ.get("CI"),
                                 reason="shared trace not present")


def _raw(limit: int) -> list[dict[str, object]]:
    with TRACE.open() as f:
        return [json.loads(line) for line in itertools.islice(f, limit)]


@needs_trace
def test_first_200_lines_match_the_raw_records() -> None:
    raw = _raw(200)
    reqs = list(read_mooncake_trace(TRACE, limit=200))
    assert len(reqs) == 200
    assert sum(r.num_prompt_tokens for r in reqs) == sum(int(str(d["input_length"]))
                                                         for d in raw)
    for lineno, (req, rec) in enumerate(zip(reqs, raw, strict=True), start=1):
        assert req.request_id == f"mooncake-{lineno}"
        assert req.num_prompt_tokens == rec["input_length"]
        assert req.output_length == rec["output_length"]
        assert req.arrival_s == float(str(rec["timestamp"])) / 1000.0
        assert req.cache_salt is None and req.output_tokens is None


@needs_trace
def test_shared_hash_ids_give_equal_tokens_and_equal_block_hashes() -> None:
    raw = _raw(200)
    reqs = list(read_mooncake_trace(TRACE, limit=200))
    bs = MOONCAKE_BLOCK_TOKENS
    hasher = BlockHasher(bs)
    pairs_checked = 0
    for (i, a), (j, b) in itertools.combinations(enumerate(raw), 2):
        ids_a, ids_b = list(a["hash_ids"]), list(b["hash_ids"])  # type: ignore[call-overload]
        shared = 0
        while shared < min(len(ids_a), len(ids_b)) and ids_a[shared] == ids_b[shared]:
            shared += 1
        n = min(shared * bs, reqs[i].num_prompt_tokens, reqs[j].num_prompt_tokens)
        assert reqs[i].prompt[:n] == reqs[j].prompt[:n]
        if shared < min(len(ids_a), len(ids_b)):  # they diverge in block `shared`
            start = shared * bs
            assert reqs[i].prompt[start:start + 16] != reqs[j].prompt[start:start + 16]
        if shared >= 2:
            ha, hb = reqs[i].prompt_hashes(hasher), reqs[j].prompt_hashes(hasher)
            full = min(shared, len(ha), len(hb))
            assert ha[:full] == hb[:full]
            pairs_checked += 1
    assert pairs_checked == 7  # pairs of the first 200 lines sharing >= 2 blocks
    # Block contents depend on the id only.
    first = list(raw[0]["hash_ids"])  # type: ignore[call-overload]
    assert reqs[0].prompt[:bs] == mooncake_block_tokens(first[0])


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = [
    '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}',
    '{"timestamp": 5, "input_length": 512, "output_length": 10, "hash_ids": [0]}',
]


@pytest.mark.parametrize(("line", "field"), [
    ('{"timestamp": 9, "input_length": 600', "<json>"),
    ("[1, 2, 3]", "<json>"),
    ('{"input_length": 600, "output_length": 10, "hash_ids": [0, 1]}', "timestamp"),
    ('{"timestamp": "9", "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}',
     "timestamp"),
    ('{"timestamp": -1, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}',
     "timestamp"),
    ('{"timestamp": 4, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}',
     "timestamp"),
    ('{"timestamp": 9, "output_length": 10, "hash_ids": [0, 1]}', "input_length"),
    ('{"timestamp": 9, "input_length": 0, "output_length": 10, "hash_ids": [0]}',
     "input_length"),
    ('{"timestamp": 9, "input_length": 600.5, "output_length": 10, "hash_ids": [0, 1]}',
     "input_length"),
    ('{"timestamp": 9, "input_length": true, "output_length": 10, "hash_ids": [0]}',
     "input_length"),
    ('{"timestamp": 9, "input_length": 600, "output_length": -3, "hash_ids": [0, 1]}',
     "output_length"),
    ('{"timestamp": 9, "input_length": 600, "output_length": null, "hash_ids": [0, 1]}',
     "output_length"),
    ('{"timestamp": 9, "input_length": 600, "output_length": 10, "hash_ids": "0,1"}',
     "hash_ids"),
    ('{"timestamp": 9, "input_length": 600, "output_length": 10, "hash_ids": []}',
     "hash_ids"),
    ('{"timestamp": 9, "input_length": 600, "output_length": 10, "hash_ids": [0, -2]}',
     "hash_ids"),
    ('{"timestamp": 9, "input_length": 600, "output_length": 10, "hash_ids": [0, false]}',
     "hash_ids"),
    ('{"timestamp": 9, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1]}',
     "input_length"),
    ('{"timestamp": 9, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1, 2]}',
     "input_length"),
])
def test_malformed_line_names_line_and_field(tmp_path: Path, line: str, field: str) -> None:
    path = _write(tmp_path, [*GOOD, line])
    with pytest.raises(TraceError) as info:
        list(read_mooncake_trace(path))
    assert (info.value.line, info.value.field) == (3, field)
    assert str(path) in str(info.value) and ":3:" in str(info.value)


def test_reader_streams_and_stops_at_the_limit(tmp_path: Path) -> None:
    path = _write(tmp_path, [*GOOD, "not json at all"])
    reqs = list(read_mooncake_trace(path, limit=2))
    assert [r.request_id for r in reqs] == ["mooncake-1", "mooncake-2"]
    it = read_mooncake_trace(path)
    assert next(it).request_id == "mooncake-1"  # nothing beyond line 1 read yet
    with pytest.raises(TraceError):
        list(it)


def test_truncation_salt_and_blank_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, [GOOD[0], "", GOOD[1]])
    a, b = read_mooncake_trace(path, cache_salt="t1", id_prefix="x")
    assert (a.request_id, b.request_id) == ("x-1", "x-3")  # physical line numbers
    assert a.num_prompt_tokens == 600 and b.num_prompt_tokens == 512
    assert a.prompt[:512] == b.prompt
    assert a.prompt[512:] == mooncake_block_tokens(1)[:88]
    assert a.cache_salt == "t1" and a.hash_context.cache_salt == "t1"
    assert all(0 <= t < 1 << 16 for t in a.prompt)
