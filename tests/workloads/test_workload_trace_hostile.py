"""The Mooncake trace reader on hostile and careless input: every problem is one
``TraceError`` naming the file, line and field, found with bounded work (no traceback, no
hang, no allocation driven by an unchecked number), through the library, ``kvoffload
simulate``/``sweep`` and ``benchmarks/trace_reuse.py`` alike (exit status 2, one line)."""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.cli import main
from kvoffload.errors import TraceError
from kvoffload.workloads.mooncake import (
    MAX_HASH_ID,
    MAX_INPUT_TOKENS,
    MAX_LINE_BYTES,
    MAX_NESTING,
    MAX_OUTPUT_TOKENS,
    MAX_TIMESTAMP_MS,
    read_mooncake_trace,
)

_REPO = Path(__file__).resolve().parents[2]
GOOD = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}
GOOD_LINE = json.dumps(GOOD).encode()


def _line(**fields: object) -> bytes:
    record = {**GOOD, **fields}
    return json.dumps({k: v for k, v in record.items() if v is not _DROP}).encode()


_DROP = object()
_IDS_300K = b",".join([b"0"] * 150_000)  # a 300 KB line: 150,000 hash ids
_IDS_60K = b",".join([b"0"] * 30_000)  # 60 KB, under the line bound: 30,000 ids

# name -> (line 2 of the trace, field named). Line 1 is always GOOD.
LINES: dict[str, tuple[bytes, str]] = {
    "invalid utf-8": (b'{"timestamp": 1, "input_length": 600, "x": "\xff\xfe"}', "<line>"),
    "latin-1 text": ('{"note": "caf\u00e9"}'.encode("latin-1"), "<line>"),
    "deep nesting": (b"[" * 200_000, "<json>"),
    "deep nesting in an unknown field": (
        _line(extra=json.loads("[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1))),
        "<json>"),
    "300 KB line, huge input_length": (
        b'{"timestamp": 1, "input_length": %d, "output_length": 1, "hash_ids": [%s]}'
        % (150_000 * 512, _IDS_300K), "<line>"),
    "60 KB line, input_length beyond the bound": (
        b'{"timestamp": 1, "input_length": %d, "output_length": 1, "hash_ids": [%s]}'
        % (30_000 * 512, _IDS_60K), "input_length"),
    "integer of 5000 digits": (b'{"timestamp": 1' + b"0" * 5000 + b"}", "<json>"),
    "timestamp beyond a float": (_line(timestamp=10**400), "timestamp"),
    "timestamp NaN": (b'{"timestamp": NaN, "input_length": 600, "output_length": 2, '
                      b'"hash_ids": [1, 2]}', "timestamp"),
    "timestamp infinite": (_line(timestamp=float("inf")), "timestamp"),
    "timestamp 1e308": (_line(timestamp=1e308), "timestamp"),
    "timestamp 1e300 (a 300-digit duration)": (_line(timestamp=1e300), "timestamp"),
    "timestamp after the year 9999": (_line(timestamp=MAX_TIMESTAMP_MS + 1), "timestamp"),
    "timestamp a list": (_line(timestamp=[1]), "timestamp"),
    "input_length a string": (_line(input_length="600"), "input_length"),
    "input_length negative": (_line(input_length=-600), "input_length"),
    "input_length a float": (_line(input_length=600.0), "input_length"),
    "output_length beyond the bound": (_line(output_length=MAX_OUTPUT_TOKENS + 1),
                                       "output_length"),
    "output_length negative": (_line(output_length=-1), "output_length"),
    "output_length an object": (_line(output_length={"n": 2}), "output_length"),
    "hash id negative": (_line(hash_ids=[1, -1]), "hash_ids"),
    "hash id beyond 64 bits": (_line(hash_ids=[1, MAX_HASH_ID + 1]), "hash_ids"),
    "hash id a string": (_line(hash_ids=[1, "2"]), "hash_ids"),
    "hash id null": (_line(hash_ids=[1, None]), "hash_ids"),
    "hash_ids an object": (_line(hash_ids={"0": 1}), "hash_ids"),
    "hash_ids too few": (_line(hash_ids=[1]), "input_length"),
    "missing timestamp": (_line(timestamp=_DROP), "timestamp"),
    "missing input_length": (_line(input_length=_DROP), "input_length"),
    "missing output_length": (_line(output_length=_DROP), "output_length"),
    "missing hash_ids": (_line(hash_ids=_DROP), "hash_ids"),
    "a bare string": (b'"hello"', "<json>"),
    "truncated object": (b'{"timestamp": 1, "input_', "<json>"),
    "byte-order mark": (b"\xef\xbb\xbf" + GOOD_LINE, "<json>"),
    "NUL bytes": (b"\x00" * 64, "<json>"),
}


def _trace(tmp_path: Path, line: bytes) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(GOOD_LINE + b"\n" + line + b"\n" + GOOD_LINE + b"\n")
    return path


@pytest.mark.parametrize("name", list(LINES))
def test_a_hostile_line_raises_a_trace_error_naming_line_and_field(
        name: str, tmp_path: Path) -> None:
    line, field = LINES[name]
    path = _trace(tmp_path, line)
    with pytest.raises(TraceError) as info:
        list(read_mooncake_trace(path))
    assert (info.value.line, info.value.field) == (2, field), str(info.value)
    message = str(info.value)
    assert message.startswith(f"{path}:2: field {field!r}: ")
    assert "\n" not in message and len(message) < 300


@pytest.mark.parametrize("name", ["300 KB line, huge input_length",
                                  "60 KB line, input_length beyond the bound",
                                  "deep nesting"])
def test_a_huge_line_is_refused_with_little_memory(name: str, tmp_path: Path) -> None:
    path = _trace(tmp_path, LINES[name][0])
    tracemalloc.start()
    try:
        with pytest.raises(TraceError):
            list(read_mooncake_trace(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Expanding the claimed prompt would take 4 bytes a token: 150 MB and more here.
    assert peak < 3 * 1024 * 1024, f"peak {peak:,} bytes"


def test_the_line_bound_is_exact(tmp_path: Path) -> None:
    pad = MAX_LINE_BYTES - len(_line(note=""))
    fits = _line(note="x" * pad)
    assert len(fits) == MAX_LINE_BYTES
    path = tmp_path / "t.jsonl"
    path.write_bytes(fits + b"\n" + fits + b"\r\n")  # a CR counts as a byte of its line
    it = read_mooncake_trace(path)
    assert next(it).request_id == "mooncake-1"
    with pytest.raises(TraceError) as info:
        next(it)
    assert (info.value.line, info.value.field) == (2, "<line>")
    path.write_bytes(fits)  # no final line feed
    assert len(list(read_mooncake_trace(path))) == 1


def test_bounds_admit_their_largest_values(tmp_path: Path) -> None:
    deep = json.loads("[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1))
    ids = [MAX_HASH_ID] * (MAX_INPUT_TOKENS // 512)
    line = _line(input_length=MAX_INPUT_TOKENS, output_length=MAX_OUTPUT_TOKENS,
                 hash_ids=ids, note="[[[[{{{{" * 40, extra=deep, timestamp=MAX_TIMESTAMP_MS)
    assert len(line) < MAX_LINE_BYTES  # the line bound is consistent with the token bound
    path = tmp_path / "t.jsonl"
    path.write_bytes(line + b"\n")
    (req,) = read_mooncake_trace(path)
    assert req.num_prompt_tokens == MAX_INPUT_TOKENS
    assert req.output_length == MAX_OUTPUT_TOKENS
    assert req.arrival_s == MAX_TIMESTAMP_MS / 1000


def _fifo(tmp_path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    return path


def _blank(tmp_path: Path) -> Path:
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b"\n  \n\t\r\n")
    return path


FILES: dict[str, Callable[[Path], Path]] = {
    "empty file": _empty,
    "only blank lines": _blank,
    "a directory": lambda tmp_path: tmp_path,
    "a FIFO": _fifo,
    "a missing file": lambda tmp_path: tmp_path / "nowhere.jsonl",
    "a character device": lambda tmp_path: Path(os.devnull),
}


def _read_in_thread(path: Path) -> BaseException | None:
    """Read the trace in a daemon thread so that a blocking open fails the test, not hangs."""
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            list(read_mooncake_trace(path))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert outcome, f"reading {path} blocked"
    return outcome[0]


@pytest.mark.parametrize("name", list(FILES))
def test_a_bad_file_raises_a_trace_error_naming_it(name: str, tmp_path: Path) -> None:
    path = FILES[name](tmp_path)
    error = _read_in_thread(path)
    assert isinstance(error, TraceError), repr(error)
    assert (error.path, error.line, error.field) == (str(path), 0, "<file>")
    assert str(error).startswith(f"{path}:0: field '<file>': ")


def test_limit_zero_opens_nothing(tmp_path: Path) -> None:
    assert list(read_mooncake_trace(tmp_path / "nowhere.jsonl", limit=0)) == []


# ---- the command line and the benchmark: exit status 2, one line, no traceback ----

CASES = {**{f"line: {k}": k for k in LINES}, **{f"file: {k}": k for k in FILES}}


def _case_path(case: str, tmp_path: Path) -> tuple[Path, str]:
    """The trace for ``case`` and the start of the message it must produce."""
    kind, name = case.split(": ", 1)
    if kind == "line":
        line, field = LINES[name]
        path = _trace(tmp_path, line)
        return path, f"{path}:2: field {field!r}: "
    path = FILES[name](tmp_path)
    return path, str(path)


def _one_clean_line(err: str, out: str, needle: str) -> None:
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0], err


@pytest.mark.parametrize("command", ["simulate", "sweep"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_cli_reports_a_bad_trace_in_one_line_with_status_2(
        command: str, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, needle = _case_path(case, tmp_path)
    extra = ["--host-capacity", "1GiB", "--policy", "lru"] if command == "sweep" else []
    status = main([command, "--trace", str(path), "--quiet", *extra])
    out, err = capsys.readouterr()
    assert status == 2, err
    _one_clean_line(err, out, needle)


@pytest.mark.parametrize("case", list(CASES))
def test_trace_reuse_reports_a_bad_trace_in_one_line_with_status_2(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    path, needle = _case_path(case, tmp_path)
    script = runpy.run_path(str(_REPO / "benchmarks" / "trace_reuse.py"), run_name="test")
    monkeypatch.setattr(sys, "argv", ["trace_reuse.py", "--trace", str(path)])
    status = script["main"]()
    out, err = capsys.readouterr()
    assert status == 2, err
    _one_clean_line(err, out, needle)


# ---- fuzzing: any line ends in requests or a TraceError, nothing else ----

_FUZZ = settings(max_examples=300, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


def _read_all(path: Path) -> int:
    try:
        return len(list(read_mooncake_trace(path)))
    except TraceError as exc:
        assert exc.line >= 0 and "\n" not in str(exc)
        return -1


@_FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_give_requests_or_a_trace_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(GOOD_LINE + b"\n" + data + b"\n")
    _read_all(path)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=30)
_FIELD_VALUES = (st.integers(min_value=-2, max_value=2000) | st.floats() | _JSON
                 | st.lists(st.integers(min_value=-2, max_value=2**64), max_size=5))


@_FUZZ
@given(st.one_of(
    _JSON,
    st.fixed_dictionaries({}, optional={k: _FIELD_VALUES for k in GOOD}),
))
def test_arbitrary_json_gives_requests_or_a_trace_error(tmp_path: Path, value: object) -> None:
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(GOOD_LINE + b"\n" + json.dumps(value).encode() + b"\n")
    _read_all(path)
