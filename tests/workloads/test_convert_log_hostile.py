"""The chat and token-id log reader of ``kvoffload trace convert`` on hostile values:
timestamps outside the plausible range (``1e308``, ``1e300``, negative, beyond the year
9999) refused with one ``TraceError`` naming the file, line and field; huge field values
named without being echoed; and Hypothesis fuzzing (any bytes, any JSON lines) ending in a
trace or the project's own error, within bounded time and memory per case."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.cli import main
from kvoffload.errors import ConfigError, TraceError
from kvoffload.workloads.convert import ModelTokenizer, convert_log
from kvoffload.workloads.log_reader import MAX_TIMESTAMP_S
from kvoffload.workloads.mooncake import MAX_TIMESTAMP_MS
from support.tiny_model import make_model

pytest.importorskip("tokenizers")

TURN = {"role": "user", "content": "hello what is the weather today in paris"}
BIG = "x" * 1_000_000  # a megabyte value, never to be echoed whole


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return ModelTokenizer(make_model(tmp_path_factory.mktemp("model")))


def write_log(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [TURN], **fields}


# name -> (line 1, line 2, time unit, field named on line 2)
LINES: dict[str, tuple[Any, Any, str, str]] = {
    "1e308 seconds": (chat(timestamp=0), chat(timestamp=1e308), "s", "timestamp"),
    "1e300 seconds": (chat(timestamp=0), chat(timestamp=1e300), "s", "timestamp"),
    "1e308 ms": (chat(timestamp=0), chat(timestamp=1e308), "ms", "timestamp"),
    "a 400-digit integer": (chat(timestamp=0), chat(timestamp=10**400), "s", "timestamp"),
    "after the year 9999": (chat(timestamp=0), chat(timestamp=MAX_TIMESTAMP_S + 1), "s",
                            "timestamp"),
    "negative": (chat(timestamp=5), chat(timestamp=-5), "s", "timestamp"),
    "ISO before 1970": (chat(timestamp="2025-01-01T00:00:00Z"),
                        chat(timestamp="0001-01-01T00:00:00Z"), "s", "timestamp"),
    "ISO past the year 9999 by its offset": (
        chat(timestamp="2025-01-01T00:00:00Z"), chat(timestamp="9999-12-31T23:59:59-12:00"),
        "s", "timestamp"),
    "token log, 1e308": ({"tokens": [1], "timestamp": 0}, {"tokens": [1], "timestamp": 1e308},
                         "s", "timestamp"),
    # huge values: named, not echoed
    "a megabyte ISO string": (chat(timestamp="2025-01-01T00:00:00Z"), chat(timestamp=BIG),
                              "s", "timestamp"),
    "a megabyte role": (chat(), {"messages": [{"role": 7, "content": BIG}]}, "s",
                        "messages[0].role"),
    "a megabyte content part": (chat(), {"messages": [{"role": "user",
                                                              "content": [BIG]}]}, "s",
                                       "messages[0].content[0]"),
    "a megabyte session id": (chat(), chat(session_id=BIG), "s", "session_id"),
    "a megabyte output length": (chat(), chat(max_tokens=BIG), "s", "max_tokens"),
    "a megabyte tools value": (chat(), chat(tools=BIG), "s", "tools"),
    "a megabyte part type": (chat(), {"messages": [{"role": "user", "content": [
        {"type": BIG, "text": "x"}]}]}, "s", "messages[0].content[0]"),
}


@pytest.mark.parametrize("case", list(LINES))
def test_an_implausible_or_huge_value_is_one_short_error(
        case: str, tmp_path: Path, tokenizer: ModelTokenizer) -> None:
    first, second, unit, field = LINES[case]
    log = write_log(tmp_path / "log.jsonl", [first, second])
    with pytest.raises(TraceError) as info:
        convert_log(log, tmp_path / "out.jsonl", tokenizer=tokenizer, time_unit=unit)  # type: ignore[arg-type]
    error = info.value
    assert (error.line, error.field) == (2, field), str(error)
    assert "\n" not in str(error) and len(str(error)) < 400, str(error)[:500]
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(("stamps", "unit", "duration"), [
    ([0, MAX_TIMESTAMP_S], "s", MAX_TIMESTAMP_S),
    ([0, MAX_TIMESTAMP_MS], "ms", MAX_TIMESTAMP_S),
    (["1970-01-01T00:00:00Z", "9999-12-31T23:59:59Z"], "s", MAX_TIMESTAMP_S),
])
def test_the_range_ends_are_accepted(tmp_path: Path, tokenizer: ModelTokenizer,
                                     stamps: list[Any], unit: str, duration: int) -> None:
    log = write_log(tmp_path / "log.jsonl", [chat(timestamp=t) for t in stamps])
    out = tmp_path / "out.jsonl"
    summary = convert_log(log, out, tokenizer=tokenizer, time_unit=unit)  # type: ignore[arg-type]
    assert summary.duration_s == duration
    last = json.loads(out.read_text().splitlines()[-1])
    assert last["timestamp"] == MAX_TIMESTAMP_MS


@pytest.mark.parametrize("stamp", ["1e300", "1e308", str(MAX_TIMESTAMP_MS + 1)])
@pytest.mark.parametrize("command", [["trace", "stats"], ["simulate", "--mode", "accounting"]])
def test_stats_and_simulate_refuse_an_implausible_timestamp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], stamp: str,
        command: list[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    line = '{"timestamp": %s, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}'
    trace.write_text(line % "0" + "\n" + line % stamp + "\n")
    flag = [str(trace)] if command[0] == "trace" else ["--trace", str(trace)]
    status = main([*command, *flag, "--quiet"])
    out, err = capsys.readouterr()
    assert status == 2, out[-500:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {trace}:2: field 'timestamp': ")
    assert "Traceback" not in err and len(lines[0]) < 300


def test_convert_refuses_1e308_on_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "log.jsonl", [{"tokens": [1], "timestamp": 0},
                                             {"tokens": [1], "timestamp": 1e308}])
    status = main(["trace", "convert", str(log), "-o", str(tmp_path / "out.jsonl"), "-q"])
    _, err = capsys.readouterr()
    assert status == 2 and err.startswith(f"error: {log}:2: field 'timestamp': "), err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------- fuzzing

_FUZZ = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])
_SECONDS_PER_CASE = 10.0
_BYTES_PER_CASE = 64 << 20

_SCALAR = (st.none() | st.booleans() | st.integers() | st.floats()
           | st.text(max_size=12) | st.sampled_from(["2025-01-01T00:00:00Z", "", "user"]))
_JSON = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=25)
_ROLE = st.sampled_from(["user", "assistant", "system", "tool"]) | _JSON
_CONTENT = (st.text(min_size=1, max_size=40) | _JSON
            | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                              "text": st.text(max_size=20)}), max_size=3))
_MESSAGE = st.fixed_dictionaries({}, optional={"role": _ROLE, "content": _CONTENT,
                                               "tool_calls": _JSON})
_RECORD = st.fixed_dictionaries({}, optional={
    "messages": st.lists(_MESSAGE, max_size=4) | _JSON,
    "tokens": st.lists(st.integers(min_value=-2, max_value=80), max_size=8) | _JSON,
    "timestamp": _SCALAR | _JSON,
    "session_id": _SCALAR,
    "output_tokens": _SCALAR,
    "max_tokens": _SCALAR,
    "tools": _JSON,
})


def _convert_bounded(log: Path, out: Path, tokenizer: ModelTokenizer) -> None:
    """Convert ``log``: a trace or the project's error, within the case's time and memory."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        convert_log(log, out, tokenizer=tokenizer, overwrite=True, block_size=4)
    except (TraceError, ConfigError) as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 600, str(exc)[:700]
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.monotonic() - started < _SECONDS_PER_CASE
    assert peak < _BYTES_PER_CASE


@_FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_give_a_trace_or_the_projects_error(
        tmp_path: Path, tokenizer: ModelTokenizer, data: bytes) -> None:
    log = tmp_path / "fuzz.jsonl"
    log.write_bytes(json.dumps(chat()).encode() + b"\n" + data + b"\n")
    _convert_bounded(log, tmp_path / "out.jsonl", tokenizer)


@_FUZZ
@given(st.lists(_RECORD | _JSON, min_size=1, max_size=3))
def test_arbitrary_json_lines_give_a_trace_or_the_projects_error(
        tmp_path: Path, tokenizer: ModelTokenizer, records: list[Any]) -> None:
    log = tmp_path / "fuzz.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    _convert_bounded(log, tmp_path / "out.jsonl", tokenizer)
