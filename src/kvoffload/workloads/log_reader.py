"""Reading a chat or token-id log into hashed rows, for ``convert_log``.

``LogReader.add`` parses one JSON line (``convert``'s module docstring states the formats
and bounds) into a ``LogRow``: its arrival time, output length, session and prompt. Chat
prompts are rendered with the model's template at once and tokenized in batches
(``flush``); every prompt is then cut into ``block_size``-token blocks whose chained hashes
get provisional numbers, shared across the log. The first problem raises
``TraceError(path, line, field, problem)``; a chat log without a tokenizer is a
``ConfigError``.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, Any, Literal

from kvoffload.errors import ConfigError, TraceError, shown
from kvoffload.keys import BlockHash, BlockHasher, hash_block
from kvoffload.workloads.chat_template import MAX_RENDER_CHARS, TemplateBoundError
from kvoffload.workloads.model_tokenizer import ModelTokenizer
from kvoffload.workloads.mooncake import (
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MAX_TIMESTAMP_MS,
    parse_json_object,
    read_lines,
)

LogFormat = Literal["auto", "chat", "tokens"]
TimeUnit = Literal["s", "ms"]

MAX_LOG_LINE_BYTES = 8 << 20
"""Longest accepted log line, in bytes without its line feed (8 MiB: a conversation of
about two million tokens of English text, the most ``MAX_INPUT_TOKENS`` allows)."""

MAX_LOG_NESTING = 32
"""Deepest accepted bracket nesting in a log line (a chat line is 4 deep with content
parts; tool schemas add a few levels)."""

MAX_PROMPT_CHARS = MAX_RENDER_CHARS
"""Longest accepted rendered prompt, in characters (a chat template cannot inflate a line
without bound; rendering stops as soon as it passes this)."""

MAX_TOKEN_ID = (1 << 31) - 1
"""Largest accepted token id in a token-id log (without ``--model``)."""

MAX_TIMESTAMP_S = MAX_TIMESTAMP_MS // 1000
"""Latest accepted timestamp, in seconds: the end of the year 9999 as Unix time (the
latest an ISO 8601 time can give). Timestamps are times from 0 (the log's start or the
Unix epoch) up to this; anything else (negative, ``1e300``) is no plausible arrival."""

MAX_SESSION_ID_CHARS = 1024
"""Longest accepted ``session_id`` string."""

OUTPUT_FIELDS = ("output_length", "output_tokens", "max_tokens")
"""Fields read for the output length, in order of preference."""

_BATCH_CHARS = 4 << 20  # rendered characters tokenized in one batch
_BATCH_LINES = 256
_HASH_SEED = "kvoffload-trace"


@dataclass
class LogRow:
    """One parsed request: its chat ``text`` until tokenized, its ``tokens`` until hashed,
    then ``input_length`` and ``ids`` (provisional block numbers, before the trace's
    numbering in arrival order)."""

    lineno: int
    time_s: float
    output_length: int
    session_id: str | int | None
    tokens: list[int] | None = None
    text: str | None = None
    input_length: int = 0
    ids: array[int] | None = None  # provisional block numbers


def log_lines(path: str, f: IO[bytes]) -> Iterator[tuple[int, str]]:
    """The log's non-blank lines (``read_lines`` with the log's bounds; a byte order mark
    on the first line is dropped)."""
    return read_lines(path, f, max_bytes=MAX_LOG_LINE_BYTES,
                      too_long="one request a line (a longer prompt is beyond the trace's "
                               "token bound)", what="log", strip_bom=True)


def _parse_object(path: str, lineno: int, text: str) -> dict[str, Any]:
    return parse_json_object(path, lineno, text, max_nesting=MAX_LOG_NESTING)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_time(path: str, lineno: int, value: object, unit: TimeUnit) -> tuple[str, float]:
    """``(kind, seconds)`` of a timestamp: kind ``"number"`` or ``"iso"``."""
    if isinstance(value, str):
        text = value.strip()
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            raise TraceError(path, lineno, "timestamp",
                             f"{shown(value)} is not an ISO 8601 time (e.g. "
                             "2025-01-31T12:00:00Z) nor a number of seconds") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)  # a naive time is read as UTC
        seconds = moment.timestamp()
        if not 0 <= seconds <= MAX_TIMESTAMP_S:
            raise TraceError(path, lineno, "timestamp",
                             f"{shown(value)} is outside 1970-01-01T00:00:00Z to the end "
                             "of year 9999; give the request's arrival time")
        return "iso", seconds
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value) / (1000.0 if unit == "ms" else 1.0)
        except OverflowError:
            seconds = math.inf
        if not (math.isfinite(seconds) and 0 <= seconds <= MAX_TIMESTAMP_S):
            most = f"{MAX_TIMESTAMP_S:,} s" if unit == "s" else f"{MAX_TIMESTAMP_MS:,} ms"
            raise TraceError(path, lineno, "timestamp",
                             f"must be a number in [0, {most}] (up to the end of year 9999 "
                             f"as Unix time), got {shown(value)}")
        return "number", seconds
    raise TraceError(path, lineno, "timestamp",
                     f"expected seconds (a number) or an ISO 8601 string, got {shown(value)}")


def _output_length(path: str, lineno: int, record: dict[str, Any], default: int) -> int:
    for field in OUTPUT_FIELDS:
        value = record.get(field)
        if value is None:
            continue
        if not _is_int(value):
            raise TraceError(path, lineno, field, f"expected an integer, got {shown(value)}")
        if not 1 <= value <= MAX_OUTPUT_TOKENS:
            raise TraceError(path, lineno, field,
                             f"must be in [1, {MAX_OUTPUT_TOKENS:,}], got {shown(value)}")
        return int(value)
    return default


def _session(path: str, lineno: int, record: dict[str, Any]) -> str | int | None:
    value = record.get("session_id")
    if value is None:
        return None
    if isinstance(value, str):
        if not value or len(value) > MAX_SESSION_ID_CHARS:
            raise TraceError(path, lineno, "session_id",
                             f"must be 1 to {MAX_SESSION_ID_CHARS} characters")
        return value
    if _is_int(value):
        return int(value)
    raise TraceError(path, lineno, "session_id",
                     f"expected a string or an integer, got {shown(value)}")


def _content(path: str, lineno: int, field: str, message: dict[str, Any]) -> str | None:
    content = message.get("content")
    if content is None:
        if "content" in message and isinstance(message.get("tool_calls"), list):
            return None  # an assistant's tool call without text
        raise TraceError(path, lineno, field, "missing" if "content" not in message else
                         "is null (allowed only beside 'tool_calls')")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            where = f"{field}[{j}]"
            if not isinstance(part, dict):
                raise TraceError(path, lineno, where,
                                 f"expected a content part object, got {shown(part)}")
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise TraceError(path, lineno, where,
                                 f"only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                 f"can be tokenized, got type {shown(part.get('type'))}")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise TraceError(path, lineno, field,
                         f"expected a string or a list of text parts, got {shown(content)}")
    if not content:
        raise TraceError(path, lineno, field, "is empty; a message needs text")
    return content


def _messages(path: str, lineno: int, record: dict[str, Any]) -> list[dict[str, Any]]:
    value = record["messages"]
    if not isinstance(value, list):
        raise TraceError(path, lineno, "messages", f"expected a list, got {shown(value)}")
    if not value:
        raise TraceError(path, lineno, "messages", "is empty; a request needs a message")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise TraceError(path, lineno, f"messages[{i}]",
                             f"expected an object with role and content, got "
                             f"{shown(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise TraceError(path, lineno, f"messages[{i}].role",
                             "missing" if role is None else
                             f"expected a non-empty string, got {shown(role)}")
        content = _content(path, lineno, f"messages[{i}].content", message)
        messages.append({**message, "content": content})
    return messages


def _tools(path: str, lineno: int, record: dict[str, Any]) -> list[dict[str, Any]] | None:
    value = record.get("tools")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise TraceError(path, lineno, "tools", f"expected a list of objects, got "
                         f"{shown(value)}")
    return value or None


def _tokens(path: str, lineno: int, record: dict[str, Any], vocab: int | None) -> list[int]:
    value = record["tokens"]
    if not isinstance(value, list):
        raise TraceError(path, lineno, "tokens", f"expected a list of token ids, got "
                         f"{shown(value)}")
    if not value:
        raise TraceError(path, lineno, "tokens", "is empty; a request needs a prompt")
    if len(value) > MAX_INPUT_TOKENS:
        raise TraceError(path, lineno, "tokens", f"{len(value):,} tokens, more than "
                         f"{MAX_INPUT_TOKENS:,}")
    bound = MAX_TOKEN_ID if vocab is None else vocab - 1
    if all(type(item) is int for item in value) and min(value) >= 0 and max(value) <= bound:
        return value  # the common case, at C speed; otherwise find the first bad item
    for i, item in enumerate(value):
        if not _is_int(item) or not 0 <= item <= bound:
            what = "the model's vocabulary" if vocab is not None else "range"
            raise TraceError(path, lineno, "tokens",
                             f"item {i} must be an integer in [0, {bound:,}] ({what}), "
                             f"got {shown(item)}")
    return value


class LogReader:
    """Parses log lines into rows, tokenizing chat prompts in batches.

    ``add`` each line in file order, then ``flush``; ``rows`` holds the finished rows in
    file order (``count`` includes the ones still waiting to be tokenized), ``format`` the
    log's format once a line has set it, ``time_kind`` whether the log has timestamps.
    A line whose format, timestamp kind or presence differs from the earlier lines' is a
    ``TraceError``.
    """

    def __init__(self, path: str, tokenizer: ModelTokenizer | None, *, block_size: int,
                 log_format: LogFormat, default_output_length: int,
                 time_unit: TimeUnit) -> None:
        self.path = path
        self.tokenizer = tokenizer
        self.format: str | None = None if log_format == "auto" else log_format
        self.default_output_length = default_output_length
        self.time_unit = time_unit
        self.hasher = BlockHasher(block_size, seed=_HASH_SEED)
        self.block_size = block_size
        self.rows: list[LogRow] = []
        self.pending: list[LogRow] = []
        self.pending_chars = 0
        self.blocks: dict[BlockHash, int] = {}
        self.time_kind: tuple[str, int] | None = None  # (kind, line) of the first timestamp
        self.untimed_line: int | None = None  # the first line without one

    @property
    def count(self) -> int:
        return len(self.rows) + len(self.pending)

    def add(self, lineno: int, text: str) -> None:
        path = self.path
        record = _parse_object(path, lineno, text)
        if self.format is None:
            self.format = ("chat" if "messages" in record else
                           "tokens" if "tokens" in record else None)
            if self.format is None:
                raise TraceError(path, lineno, "messages",
                                 "missing: a chat log line has 'messages' (a list of "
                                 "{role, content}), a token log line 'tokens'")
        key = "messages" if self.format == "chat" else "tokens"
        if key not in record:
            other = "tokens" if key == "messages" else "messages"
            hint = (f" (this line has {other!r}: one log holds one format)"
                    if other in record else "")
            raise TraceError(path, lineno, key, f"missing{hint}")
        time_s = self._time(lineno, record)
        row = LogRow(lineno, time_s, _output_length(path, lineno, record,
                                                  self.default_output_length),
                   _session(path, lineno, record))
        if self.format == "tokens":
            vocab = self.tokenizer.vocab_size if self.tokenizer is not None else None
            row.tokens = _tokens(path, lineno, record, vocab)
            self._finish(row)
            self.rows.append(row)
            return
        if self.tokenizer is None:
            raise ConfigError("model", "a chat log is tokenized with the model's own "
                              "tokenizer, and none was given",
                              "Give the local model directory that holds tokenizer.json.")
        messages = _messages(path, lineno, record)
        tools = _tools(path, lineno, record)
        try:
            row.text = self.tokenizer.render(messages, tools)
        except TemplateBoundError as exc:
            raise TraceError(path, lineno, "messages",
                             f"the chat template {self.tokenizer.template_source} {exc}; "
                             "fix it or give another with --chat-template") from None
        except Exception as exc:  # the template is the model's code: anything it raises
            raise TraceError(path, lineno, "messages",
                             f"the chat template refused them: {_brief(exc)}") from None
        if len(row.text) > MAX_PROMPT_CHARS:
            raise TraceError(path, lineno, "messages",
                             f"render to {len(row.text):,} characters, more than "
                             f"{MAX_PROMPT_CHARS:,}")
        self.pending.append(row)
        self.pending_chars += len(row.text)
        if self.pending_chars >= _BATCH_CHARS or len(self.pending) >= _BATCH_LINES:
            self.flush()

    def flush(self) -> None:
        """Tokenize the pending chat prompts and hash them (in line order)."""
        if not self.pending:
            return
        assert self.tokenizer is not None
        pending, self.pending, self.pending_chars = self.pending, [], 0
        encoded = self.tokenizer.encode([row.text or "" for row in pending])
        for row, tokens in zip(pending, encoded, strict=True):
            row.text = None
            if not tokens:
                raise TraceError(self.path, row.lineno, "messages",
                                 "render to no token at all")
            if len(tokens) > MAX_INPUT_TOKENS:
                raise TraceError(self.path, row.lineno, "messages",
                                 f"render to {len(tokens):,} tokens, more than "
                                 f"{MAX_INPUT_TOKENS:,}")
            row.tokens = tokens
            self._finish(row)
            self.rows.append(row)

    def _time(self, lineno: int, record: dict[str, Any]) -> float:
        """Seconds of the line's timestamp; 0 for a log without timestamps."""
        value = record.get("timestamp")
        if value is None:
            if self.time_kind is not None:
                raise TraceError(self.path, lineno, "timestamp",
                                 f"missing, while line {self.time_kind[1]} has one (give "
                                 "every line a timestamp or none)")
            if self.untimed_line is None:
                self.untimed_line = lineno
            return 0.0
        kind, seconds = _parse_time(self.path, lineno, value, self.time_unit)
        if self.untimed_line is not None:
            raise TraceError(self.path, lineno, "timestamp",
                             f"given, while line {self.untimed_line} has none (give every "
                             "line a timestamp or none)")
        if self.time_kind is None:
            self.time_kind = (kind, lineno)
        elif self.time_kind[0] != kind:
            given = "an ISO 8601 time" if kind == "iso" else "a number"
            first = "a number" if kind == "iso" else "an ISO 8601 time"
            raise TraceError(self.path, lineno, "timestamp",
                             f"{given}, while line {self.time_kind[1]} gives {first} (one "
                             "log uses one kind)")
        return seconds

    def _finish(self, row: LogRow) -> None:
        """Hash ``row.tokens`` into provisional block numbers."""
        tokens = row.tokens
        assert tokens is not None
        hashes = self.hasher.hashes(tokens)
        tail = len(tokens) % self.block_size
        if tail:
            parent = hashes[-1] if hashes else self.hasher.root
            hashes.append(hash_block(parent, tokens[len(tokens) - tail:]))
        ids = array("q", (self.blocks.setdefault(h, len(self.blocks)) for h in hashes))
        row.input_length = len(tokens)
        row.ids = ids
        row.tokens = None


def _brief(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
