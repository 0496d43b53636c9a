"""``convert_log``: chat and token-id logs into Mooncake-format traces, with the model's
own tokenizer and chat template (a tiny one built here, nothing downloaded): hash ids
equal exactly where the token blocks and everything before them agree, readable by the
unchanged reader, hostile lines refused with one error naming the file, line and field,
and no output file left by a failed conversion."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import ConfigError, TraceError
from kvoffload.workloads import read_mooncake_trace
from kvoffload.workloads.convert import (
    MAX_LOG_LINE_BYTES,
    MAX_LOG_NESTING,
    ModelTokenizer,
    convert_log,
    write_atomically,
)
from support.tiny_model import make_model, render

tokenizers = pytest.importorskip("tokenizers")

SYSTEM = {"role": "system",
          "content": "you are a helpful assistant that answers briefly and politely"}
TURN_1 = {"role": "user", "content": "hello what is the weather today in paris"}
A = [SYSTEM, TURN_1, {"role": "assistant", "content": "it is sunny and warm"},
     {"role": "user", "content": "tell me a joke about cats"}]
B = [SYSTEM, TURN_1, {"role": "assistant", "content": "it is rainy"},
     {"role": "user", "content": "thanks"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> ModelTokenizer:
    return ModelTokenizer(model)


def write_log(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tokens_of(model: Path, messages: list[dict[str, str]]) -> list[int]:
    """The prompt's token ids, computed without the converter: the template rendered by
    hand, tokenized by the tokenizers library."""
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    return list(tok.encode(render(messages), add_special_tokens=False).ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("block", [1, 3, 4, 7, 512])
def test_shared_system_prompt_and_first_turn_share_leading_ids_exactly_where_tokens_agree(
        tmp_path: Path, model: Path, tokenizer: ModelTokenizer, block: int) -> None:
    log = write_log(tmp_path / "chat.jsonl", [{"messages": A}, {"messages": B}])
    out = tmp_path / "trace.jsonl"
    summary = convert_log(log, out, tokenizer=tokenizer, block_size=block)
    a, b = tokens_of(model, A), tokens_of(model, B)
    shared = common_prefix(a, b)
    assert 0 < shared < min(len(a), len(b))  # the system prompt and first turn, then not
    ra, rb = read_lines(out)
    assert (ra["input_length"], rb["input_length"]) == (len(a), len(b))
    assert len(ra["hash_ids"]) == -(-len(a) // block)
    full = shared // block  # blocks that agree, with everything before them
    assert ra["hash_ids"][:full] == rb["hash_ids"][:full]
    assert ra["hash_ids"][full] != rb["hash_ids"][full]  # the first block that differs
    assert not set(ra["hash_ids"][full:]) & set(rb["hash_ids"][full:])
    # small stable integers, numbered in order of first appearance
    assert ra["hash_ids"] == list(range(len(ra["hash_ids"])))
    assert rb["hash_ids"][full:] == list(range(len(ra["hash_ids"]),
                                               len(ra["hash_ids"]) + len(rb["hash_ids"])
                                               - full))
    assert summary.unique_blocks == len(set(ra["hash_ids"]) | set(rb["hash_ids"]))
    assert summary.chat_template is not None and summary.format == "chat"
    # the unchanged reader takes it, and its prompts share exactly those blocks
    pa, pb = read_mooncake_trace(out, block_tokens=block)
    assert (len(pa.prompt), len(pb.prompt)) == (len(a), len(b))
    assert common_prefix(list(pa.prompt), list(pb.prompt)) >= full * block
    assert pa.prompt[full * block:(full + 1) * block] != pb.prompt[full * block:
                                                                  (full + 1) * block]


def test_equal_prompts_get_equal_ids_and_the_partial_block_depends_on_its_length(
        tmp_path: Path, tokenizer: ModelTokenizer) -> None:
    short = [SYSTEM, TURN_1]
    log = write_log(tmp_path / "chat.jsonl",
                    [{"messages": A}, {"messages": A}, {"messages": short}])
    out = tmp_path / "t.jsonl"
    convert_log(log, out, tokenizer=tokenizer, block_size=8)
    first, again, prefix = read_lines(out)
    assert first["hash_ids"] == again["hash_ids"]
    full = prefix["input_length"] // 8
    assert prefix["hash_ids"][:full] == first["hash_ids"][:full]
    if prefix["input_length"] % 8:  # a partial block is its own id
        assert prefix["hash_ids"][full] not in first["hash_ids"]


def test_a_token_id_log_round_trips_through_the_reader(tmp_path: Path) -> None:
    """tokens -> trace -> the reader's prompts -> a token log -> the same trace."""
    base = list(range(100, 110))
    prompts = [[*base, 1, 2, 3], [*base, 1, 2, 3], base[:6], [*base, *[9] * 7], [5] * 4]
    records = [{"tokens": p, "timestamp": 10.0 + i * 0.25, "output_length": i + 1,
                "session_id": f"s{i % 2}"} for i, p in enumerate(prompts)]
    log = write_log(tmp_path / "tokens.jsonl", records)
    out = tmp_path / "trace.jsonl"
    summary = convert_log(log, out, block_size=4)
    assert summary.format == "tokens" and summary.tokenizer is None
    assert (summary.requests, summary.input_tokens) == (5, sum(map(len, prompts)))
    assert summary.sessions == 2 and not summary.reordered
    lines = read_lines(out)
    assert [r["timestamp"] for r in lines] == [0, 250, 500, 750, 1000]
    assert [r["output_length"] for r in lines] == [1, 2, 3, 4, 5]
    assert [r["session_id"] for r in lines] == ["s0", "s1", "s0", "s1", "s0"]
    # ids agree exactly where blocks and everything before them agree
    for i, p in enumerate(prompts):
        for j, q in enumerate(prompts):
            for k in range(min(len(p), len(q)) // 4 + 1):
                same = p[:4 * (k + 1)] == q[:4 * (k + 1)]
                if k < len(lines[i]["hash_ids"]) and k < len(lines[j]["hash_ids"]):
                    assert (lines[i]["hash_ids"][k] == lines[j]["hash_ids"][k]) == same
    requests = list(read_mooncake_trace(out, block_tokens=4))
    assert [len(r.prompt) for r in requests] == [len(p) for p in prompts]
    again = write_log(tmp_path / "again.jsonl",
                      [{"tokens": list(r.prompt), "timestamp": r.arrival_s,
                        "output_length": r.output_length, "session_id": f"s{i % 2}"}
                       for i, r in enumerate(requests)])
    out2 = tmp_path / "trace2.jsonl"
    convert_log(again, out2, block_size=4)
    assert out2.read_bytes() == out.read_bytes()


def test_conversion_is_stable(tmp_path: Path, tokenizer: ModelTokenizer) -> None:
    log = write_log(tmp_path / "chat.jsonl", [{"messages": A}, {"messages": B}])
    convert_log(log, tmp_path / "1.jsonl", tokenizer=tokenizer, block_size=4)
    convert_log(log, tmp_path / "2.jsonl", tokenizer=ModelTokenizer(tokenizer.tokenizer_file),
                block_size=4)
    assert (tmp_path / "1.jsonl").read_bytes() == (tmp_path / "2.jsonl").read_bytes()


def test_timestamps_iso_or_seconds_sorted_into_arrival_order(
        tmp_path: Path, tokenizer: ModelTokenizer) -> None:
    log = write_log(tmp_path / "chat.jsonl", [
        {"messages": A, "timestamp": "2025-01-31T12:00:02.5Z", "output_tokens": 7},
        {"messages": B, "timestamp": "2025-01-31T12:00:00Z", "max_tokens": 9},
        {"messages": B, "timestamp": "2025-01-31T13:00:02.5+01:00"}])  # = the first
    out = tmp_path / "t.jsonl"
    summary = convert_log(log, out, tokenizer=tokenizer, block_size=4,
                          default_output_length=11)
    lines = read_lines(out)
    assert [r["timestamp"] for r in lines] == [0, 2500, 2500]
    assert [r["output_length"] for r in lines] == [9, 7, 11]  # ties keep file order
    assert summary.reordered and summary.duration_s == 2.5 and summary.sessions is None
    ms = write_log(tmp_path / "ms.jsonl", [{"tokens": [1], "timestamp": 1500},
                                           {"tokens": [2], "timestamp": 1501.25}])
    convert_log(ms, tmp_path / "ms-out.jsonl", time_unit="ms")
    assert [r["timestamp"] for r in read_lines(tmp_path / "ms-out.jsonl")] == [0, 1.25]
    untimed = write_log(tmp_path / "untimed.jsonl", [{"tokens": [1]}, {"tokens": [2]}])
    convert_log(untimed, tmp_path / "u.jsonl")
    assert [r["timestamp"] for r in read_lines(tmp_path / "u.jsonl")] == [0, 0]


def test_the_model_templates_and_their_precedence(tmp_path: Path) -> None:
    plain = make_model(tmp_path / "plain", template=None)
    tok = ModelTokenizer(plain)
    assert not tok.has_template and tok.template_source is None
    assert tok.render([TURN_1]) == "user: hello what is the weather today in paris\nassistant:"
    jinja = make_model(tmp_path / "jinja")
    (jinja / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} "
                                               "{% endfor %}")
    assert ModelTokenizer(jinja).render([TURN_1]) == TURN_1["content"] + " "
    override = tmp_path / "t.jinja"
    override.write_text("{{ eos_token }} {{ messages | length }}")
    assert ModelTokenizer(jinja, override).render([TURN_1, TURN_1]) == "</s> 2"
    listed = make_model(tmp_path / "listed", template=None)
    config = json.loads((listed / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "d"},
                               {"name": "tool_use", "template": "t{{ tools | tojson }}"}]
    (listed / "tokenizer_config.json").write_text(json.dumps(config))
    multi = ModelTokenizer(listed)
    assert multi.render([TURN_1]) == "d"
    assert multi.render([TURN_1], [{"name": "café"}]) == 't[{"name": "café"}]'


def test_truncation_saved_in_tokenizer_json_does_not_cut_prompts(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    expected = len(tokens_of(model, A))
    tok = tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.enable_truncation(max_length=5)
    tok.save(str(model / "tokenizer.json"))
    log = write_log(tmp_path / "chat.jsonl", [{"messages": A}])
    convert_log(log, tmp_path / "t.jsonl", tokenizer=ModelTokenizer(model), block_size=4)
    assert expected > 5
    assert read_lines(tmp_path / "t.jsonl")[0]["input_length"] == expected


@pytest.mark.parametrize(("files", "field", "needle"), [
    ({}, "model", "holds no tokenizer.json"),
    ({"tokenizer.json": "{not json"}, "model", "cannot be loaded"),
    ({"tokenizer_config.json": "[]"}, "model", "not a JSON object"),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{% for %}"})},
     "chat_template", "line 1"),
    ({"tokenizer_config.json": json.dumps({"chat_template": 5})}, "chat_template",
     "neither a string"),
])
def test_a_broken_model_directory_is_one_config_error(
        tmp_path: Path, model: Path, files: dict[str, str], field: str, needle: str) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    if files:
        (directory / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes())
    for name, text in files.items():
        (directory / name).write_text(text)
    with pytest.raises(ConfigError) as info:
        ModelTokenizer(directory)
    assert info.value.field == field and needle in str(info.value)


OK_CHAT = {"messages": [TURN_1], "timestamp": 1}
OK_TOKENS = {"tokens": [1, 2, 3], "timestamp": 1}
DEEP = "[" * (MAX_LOG_NESTING + 1) + "]" * (MAX_LOG_NESTING + 1)

# name -> (line 1, line 2, field of the error on line 2)
HOSTILE: dict[str, tuple[Any, Any, str]] = {
    "bad json": (OK_CHAT, '{"messages": [', "<json>"),
    "not an object": (OK_CHAT, "[1, 2]", "<json>"),
    "NaN timestamp": (OK_CHAT, '{"messages": [], "timestamp": NaN}', "timestamp"),
    "deep nesting": (OK_CHAT, '{"messages": ' + DEEP + "}", "<json>"),
    "missing messages": (OK_CHAT, {"prompt": "hi", "timestamp": 2}, "messages"),
    "tokens in a chat log": (OK_CHAT, OK_TOKENS, "messages"),
    "messages not a list": (OK_CHAT, {"messages": "hi", "timestamp": 2}, "messages"),
    "messages empty": (OK_CHAT, {"messages": [], "timestamp": 2}, "messages"),
    "message not an object": (OK_CHAT, {"messages": ["hi"], "timestamp": 2}, "messages[0]"),
    "role missing": (OK_CHAT, {"messages": [{"content": "hi"}], "timestamp": 2},
                     "messages[0].role"),
    "role a number": (OK_CHAT, {"messages": [{"role": 1, "content": "hi"}], "timestamp": 2},
                      "messages[0].role"),
    "empty content": (OK_CHAT, {"messages": [SYSTEM, {"role": "user", "content": ""}],
                                "timestamp": 2}, "messages[1].content"),
    "content missing": (OK_CHAT, {"messages": [{"role": "user"}], "timestamp": 2},
                        "messages[0].content"),
    "content a number": (OK_CHAT, {"messages": [{"role": "user", "content": 5}],
                                   "timestamp": 2}, "messages[0].content"),
    "content null": (OK_CHAT, {"messages": [{"role": "user", "content": None}],
                               "timestamp": 2}, "messages[0].content"),
    "image part": (OK_CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}], "timestamp": 2},
        "messages[0].content[0]"),
    "template refuses": (OK_CHAT, {"messages": [{"role": "tool", "content": "hi"}],
                                   "timestamp": 2}, "messages"),
    "tools not objects": (OK_CHAT, {"messages": [TURN_1], "tools": [1], "timestamp": 2},
                          "tools"),
    "timestamp a list": (OK_CHAT, {"messages": [TURN_1], "timestamp": [1]}, "timestamp"),
    "timestamp not ISO": (OK_CHAT, {"messages": [TURN_1], "timestamp": "yesterday"},
                          "timestamp"),
    "timestamp missing": (OK_CHAT, {"messages": [TURN_1]}, "timestamp"),
    "timestamp kinds mixed": (OK_CHAT, {"messages": [TURN_1], "timestamp": "2025-01-01"},
                              "timestamp"),
    "timestamp only later": ({"messages": [TURN_1]}, OK_CHAT, "timestamp"),
    "output zero": (OK_CHAT, {"messages": [TURN_1], "timestamp": 2, "output_tokens": 0},
                    "output_tokens"),
    "output a string": (OK_CHAT, {"messages": [TURN_1], "timestamp": 2,
                                  "max_tokens": "many"}, "max_tokens"),
    "output a bool": (OK_TOKENS, {"tokens": [1], "timestamp": 2, "output_length": True},
                      "output_length"),
    "session a list": (OK_CHAT, {"messages": [TURN_1], "timestamp": 2, "session_id": [1]},
                       "session_id"),
    "tokens negative": (OK_TOKENS, {"tokens": [1, -1], "timestamp": 2}, "tokens"),
    "tokens beyond the vocabulary": (OK_TOKENS, {"tokens": [10**6], "timestamp": 2},
                                     "tokens"),
    "tokens strings": (OK_TOKENS, {"tokens": "1 2 3", "timestamp": 2}, "tokens"),
    "tokens bools": (OK_TOKENS, {"tokens": [True], "timestamp": 2}, "tokens"),
    "tokens empty": (OK_TOKENS, {"tokens": [], "timestamp": 2}, "tokens"),
    "messages in a token log": (OK_TOKENS, OK_CHAT, "tokens"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_malformed_line_is_one_error_naming_file_line_and_field(
        tmp_path: Path, tokenizer: ModelTokenizer, case: str) -> None:
    first, second, field = HOSTILE[case]
    log = write_log(tmp_path / "log.jsonl", [first, "", second, OK_CHAT])
    out = tmp_path / "trace.jsonl"
    with pytest.raises(TraceError) as info:
        convert_log(log, out, tokenizer=tokenizer, block_size=4)
    error = info.value
    assert (error.path, error.line, error.field) == (str(log), 3, field), str(error)
    assert "\n" not in str(error) and str(error).startswith(f"{log}:3: field {field!r}: ")
    assert os.listdir(tmp_path) == ["log.jsonl"]  # nothing half-written


@pytest.mark.parametrize(("content", "field", "line"), [
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n', "<line>", 1),
    (b"\n\n", "<file>", 0),
    (b"", "<file>", 0),
    (b'{"tokens": [1]}\n' + b" " * (MAX_LOG_LINE_BYTES + 1) + b"\n", "<line>", 2),
    (b'{"neither": 1}\n', "messages", 1),
])
def test_whole_file_and_line_problems(tmp_path: Path, tokenizer: ModelTokenizer,
                                      content: bytes, field: str, line: int) -> None:
    log = tmp_path / "log.jsonl"
    log.write_bytes(content)
    with pytest.raises(TraceError) as info:
        convert_log(log, tmp_path / "out.jsonl", tokenizer=tokenizer)
    assert (info.value.line, info.value.field) == (line, field)
    with pytest.raises(TraceError) as info:
        convert_log(tmp_path, tmp_path / "out.jsonl")  # a directory
    assert (info.value.line, info.value.field) == (0, "<file>")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_byte_order_mark_and_text_parts_are_accepted(
        tmp_path: Path, tokenizer: ModelTokenizer) -> None:
    parts = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": "what is the weather"}]}]}
    joined = {"messages": [{"role": "user", "content": "hello\nwhat is the weather"}]}
    log = tmp_path / "log.jsonl"
    log.write_bytes(b"\xef\xbb\xbf" + (json.dumps(parts) + "\n" + json.dumps(joined))
                    .encode())
    convert_log(log, tmp_path / "t.jsonl", tokenizer=tokenizer, block_size=4)
    first, second = read_lines(tmp_path / "t.jsonl")
    assert first["hash_ids"] == second["hash_ids"]


def test_a_chat_log_needs_a_tokenizer(tmp_path: Path) -> None:
    log = write_log(tmp_path / "chat.jsonl", [OK_CHAT])
    with pytest.raises(ConfigError) as info:
        convert_log(log, tmp_path / "t.jsonl")
    assert info.value.field == "model"


def test_an_existing_output_is_kept_unless_overwrite(tmp_path: Path) -> None:
    log = write_log(tmp_path / "tokens.jsonl", [OK_TOKENS])
    out = tmp_path / "t.jsonl"
    out.write_text("keep me\n")
    with pytest.raises(FileExistsError):
        convert_log(log, out)
    assert out.read_text() == "keep me\n"
    convert_log(log, out, overwrite=True)
    assert read_lines(out)[0]["input_length"] == 3
    assert sorted(os.listdir(tmp_path)) == ["t.jsonl", "tokens.jsonl"]


def test_a_failed_write_leaves_nothing_and_keeps_the_old_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "t.jsonl"
    out.write_text("old\n")

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        write_atomically(out, ["{}"] * 1000, overwrite=True)
    assert out.read_text() == "old\n" and os.listdir(tmp_path) == ["t.jsonl"]
    with pytest.raises(OSError, match="No space"):
        write_atomically(tmp_path / "new.jsonl", ["{}"])
    assert os.listdir(tmp_path) == ["t.jsonl"]


def test_limit_stops_reading_before_a_later_bad_line(tmp_path: Path) -> None:
    log = write_log(tmp_path / "tokens.jsonl", [OK_TOKENS, OK_TOKENS, "{bad"])
    summary = convert_log(log, tmp_path / "t.jsonl", limit=2)
    assert summary.requests == 2


@pytest.mark.slow
def test_the_rendering_matches_transformers_apply_chat_template(model: Path,
                                                                tokenizer: ModelTokenizer
                                                                ) -> None:
    """The converter renders as transformers does (checked offline when transformers is
    installed; importing it takes seconds)."""
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    for messages in (A, B, [TURN_1]):
        expected = reference.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False)
        assert tokenizer.render(messages) == expected
        ids = reference.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        assert tokenizer.encode([expected])[0] == list(ids)
