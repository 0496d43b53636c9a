"""``kvoffload trace convert`` and ``kvoffload trace stats``: a chat log tokenized with a
tiny local model, converted, summarized and replayed by ``simulate``; mistakes are one
``error:`` line with exit status 2 and leave no output file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvoffload.cli import main
from support.tiny_model import make_model

pytest.importorskip("tokenizers")

SYSTEM = {"role": "system", "content": " ".join(["you are a helpful assistant"] * 130)}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The command's exit status (argparse's own refusals exit through SystemExit) and
    what it printed."""
    try:
        status = main(list(argv))
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return status, out, err


def chat_log(path: Path) -> Path:
    """Three conversations behind one long system prompt (over one 512-token block)."""
    records = [
        {"messages": [SYSTEM, {"role": "user", "content": "hello"}], "timestamp": 0.0,
         "session_id": "a", "output_tokens": 8},
        {"messages": [SYSTEM, {"role": "user", "content": "hello"},
                      {"role": "assistant", "content": "hi how can i help"},
                      {"role": "user", "content": "tell me a joke"}], "timestamp": 1.5,
         "session_id": "a", "max_tokens": 16},
        {"messages": [SYSTEM, {"role": "user", "content": "what is the weather"}],
         "timestamp": 2.0, "session_id": "b"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model"))


def test_convert_stats_and_simulate_on_a_chat_log(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path, model: Path) -> None:
    log = chat_log(tmp_path / "chat.jsonl")
    trace = tmp_path / "trace.jsonl"
    status, out, err = run(capsys, "trace", "convert", str(log), "--model", str(model),
                           "-o", str(trace), "--quiet")
    assert status == 0, err
    assert "converted 3 requests (chat log" in out and "2 sessions" in out
    assert f"kvoffload simulate --trace {trace}" in out
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["timestamp"] for line in lines] == [0, 1500, 2000]
    assert [line["output_length"] for line in lines] == [8, 16, 256]
    assert lines[0]["hash_ids"][0] == lines[1]["hash_ids"][0] == lines[2]["hash_ids"][0]

    status, out, err = run(capsys, "trace", "stats", str(trace), "--json", "--quiet")
    assert status == 0, err
    stats = json.loads(out)
    assert stats["requests"] == 3 and stats["sessions"] == 2
    assert stats["reused_blocks"] >= 2 and stats["reuse_distance_requests"]["p50"] == 1
    status, out, _ = run(capsys, "trace", "stats", str(trace), "--quiet")
    assert status == 0 and "reuse share" in out and "ideal hit" in out

    status, out, err = run(capsys, "simulate", "--trace", str(trace), "--json",
                           "--no-baseline", "--quiet")
    assert status == 0, err
    result = json.loads(out)["offload"]
    assert result["requests"] == 3
    assert result["prompt_tokens"] == sum(line["input_length"] for line in lines)
    assert result["engine_hit_tokens"] + result["host_hit_tokens"] >= 512  # the prompt


def test_convert_json_summary_and_a_token_log(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path) -> None:
    log = tmp_path / "tokens.jsonl"
    log.write_text("".join(json.dumps({"tokens": list(range(700 + i)), "timestamp": i})
                           + "\n" for i in range(3)))
    trace = tmp_path / "trace.jsonl"
    status, out, err = run(capsys, "trace", "convert", str(log), "-o", str(trace), "--json")
    assert status == 0, err
    summary = json.loads(out)
    assert summary["format"] == "tokens" and summary["requests"] == 3
    assert summary["blocks"] == 6 and summary["unique_blocks"] == 4  # one shared block
    assert summary["block_size"] == 512 and summary["tokenizer"] is None


def test_an_existing_output_needs_force(capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path, model: Path) -> None:
    log = chat_log(tmp_path / "chat.jsonl")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("old\n")
    argv = ["trace", "convert", str(log), "--model", str(model), "-o", str(trace), "-q"]
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert err == f"error: --output: {trace} exists; give --force to replace it\n"
    assert trace.read_text() == "old\n"
    status, _, err = run(capsys, *argv, "--force")
    assert status == 0, err
    assert len(trace.read_text().splitlines()) == 3


@pytest.mark.parametrize(("lines", "needle"), [
    (['{"messages": [{"role": "user", "content": "hello"}]}', "{oops"],
     ":2: field '<json>': invalid JSON"),
    (['{"messages": [{"role": "user", "content": ""}]}'],
     ":1: field 'messages[0].content': is empty"),
    (['{"messages": [{"role": "user", "content": "hi"}], "timestamp": "soon"}'],
     ":1: field 'timestamp'"),
    (['{"prompt": "hello"}'], ":1: field 'messages': missing"),
])
def test_a_malformed_log_is_one_line_and_leaves_the_output_untouched(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path,
        lines: list[str], needle: str) -> None:
    log = tmp_path / "chat.jsonl"
    log.write_text("\n".join(lines) + "\n")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("old\n")
    status, out, err = run(capsys, "trace", "convert", str(log), "--model", str(model),
                           "-o", str(trace), "--force", "-q")
    assert status == 2 and out == ""
    assert err.startswith(f"error: {log}{needle}") and err.count("\n") == 1, err
    assert trace.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["chat.jsonl", "trace.jsonl"]


@pytest.mark.parametrize(("extra", "needle"), [
    ([], "--model: a chat log is tokenized with the model's own tokenizer"),
    (["--format", "chat"], "--model: a chat log is tokenized"),
    (["--model", "/no/such/model"], "--model: /no/such/model does not exist"),
    (["--model", "."], "holds no tokenizer.json"),
    (["--chat-template", "t.jinja"], "--chat-template: needs --model"),
    (["--block-size", "0"], "--block-size: must be in [1,"),
    (["--output-length", "0"], "--output-length: must be in [1,"),
    (["--limit", "0"], "--limit: must be at least 1"),
    (["--limit", "\u0663"], "argument --limit: not a whole number in ASCII digits"),
    (["--block-size", "\uff11\uff16"], "argument --block-size: not a whole number in ASCII digits"),
])
def test_convert_mistakes_name_the_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, extra: list[str],
                                        needle: str) -> None:
    monkeypatch.chdir(tmp_path)
    log = chat_log(tmp_path / "chat.jsonl")
    status, out, err = run(capsys, "trace", "convert", str(log), "-o", "t.jsonl", "-q",
                           *extra)
    assert status == 2 and out == "" and "Traceback" not in err
    assert needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "t.jsonl").exists()


def test_output_paths_that_cannot_work(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                       model: Path) -> None:
    log = chat_log(tmp_path / "chat.jsonl")
    for output, needle in ((log, "is the log being converted"),
                           (tmp_path, "is a directory"),
                           (tmp_path / "no" / "t.jsonl", "does not exist")):
        status, _, err = run(capsys, "trace", "convert", str(log), "--model", str(model),
                             "-o", str(output), "--force", "-q")
        assert status == 2 and needle in err, err


def test_stats_on_a_bad_trace_and_without_a_subcommand(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, '
                   '"hash_ids": [1]}\n')
    status, _, err = run(capsys, "trace", "stats", str(bad), "-q")
    assert status == 2 and f"error: {bad}:1: field 'input_length'" in err
    status, _, err = run(capsys, "trace")
    assert status == 2 and "convert" in err and "stats" in err


def test_help_teaches_the_formats(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["trace", "convert", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and '"messages"' in out and "--block-size" in out
