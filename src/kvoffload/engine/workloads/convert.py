"""Mooncake-format traces from real traffic: chat logs or token-id logs -> hash ids.

Two input formats, JSON lines, one request a line:

* **chat logs** (OpenAI style): ``{"messages": [{"role": ..., "content": ...}, ...]}``
  with optional ``timestamp``, ``session_id``, ``tools`` and an output length
  (``output_length``, ``output_tokens`` or ``max_tokens``, the first present). ``content``
  is a non-empty string or a list of ``{"type": "text", "text": ...}`` parts (joined with
  line feeds, as vLLM does for text-only templates); ``null`` only on an assistant message
  with ``tool_calls``. Other message keys (``name``, ``tool_calls``, ...) reach the
  chat template as they are.
* **token-id logs**: ``{"tokens": [ids...]}`` with the same optional fields.

A chat log is rendered with the model's chat template (``chat_template.jinja``,
``chat_template.json`` or ``tokenizer_config.json`` in the model directory, in that order,
or a template file given) the way ``transformers``' ``apply_chat_template`` renders it: a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the special tokens
(``bos_token``, ``eos_token``, ...) as variables, ``add_generation_prompt=True`` (the
prompt an engine receives for the next reply), ``raise_exception``, ``strftime_now`` and a
``tojson`` that keeps non-ASCII text. The text is then tokenized with the model's
``tokenizer.json`` (the ``tokenizers`` library) without adding special tokens, as
``apply_chat_template`` does. A model without a chat template gets a plain
``role: content`` rendering, tokenized with the tokenizer's special tokens.

Every prompt is cut into blocks of ``block_size`` tokens (default 512, the block the
Mooncake reader assumes); each block, the last partial one included, gets the chained
hash of (the previous block's hash, its tokens), so two blocks' hashes are equal exactly
when they and everything before them agree. The chained hashes are then numbered 0, 1, 2,
... in order of first appearance in the written trace; those numbers are the ``hash_ids``.

Timestamps are seconds (numbers; ``time_unit="ms"`` for milliseconds) or ISO 8601
strings; every line has one or none does. The trace is written in arrival order (a log
written at completion time is sorted; ties keep file order) with ``timestamp`` in
milliseconds from the first arrival; without timestamps every request arrives at 0 in
file order. ``session_id`` (a string or an integer) is written through; the reader ignores
it and ``trace stats`` counts sessions with it.

Hostile input is bounded like the Mooncake reader's: a line longer than
``MAX_LOG_LINE_BYTES`` is refused after reading that many bytes and before decoding, a
line that is not UTF-8 is refused, brackets nesting deeper than ``MAX_LOG_NESTING`` are
refused before ``json.loads``, a prompt over ``MAX_INPUT_TOKENS`` tokens is refused. The
first problem raises ``TraceError(path, line, field, problem)``. The whole log is read and
checked before anything is written, the trace is written to a temporary file beside the
output and renamed into place, so a failed conversion leaves no output file.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import tempfile
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from kvoffload.engine.workloads.mooncake import (
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    _show,
    open_trace_file,
    parse_json_object,
    read_lines,
)
from kvoffload.errors import ConfigError, TraceError
from kvoffload.keys import BlockHash, BlockHasher, hash_block

if TYPE_CHECKING:
    import jinja2

LogFormat = Literal["auto", "chat", "tokens"]
TimeUnit = Literal["s", "ms"]

MAX_LOG_LINE_BYTES = 8 << 20
"""Longest accepted log line, in bytes without its line feed (8 MiB: a conversation of
about two million tokens of English text, the most ``MAX_INPUT_TOKENS`` allows)."""

MAX_LOG_NESTING = 32
"""Deepest accepted bracket nesting in a log line (a chat line is 4 deep with content
parts; tool schemas add a few levels)."""

MAX_PROMPT_CHARS = 16 << 20
"""Longest accepted rendered prompt, in characters (a chat template cannot inflate a line
without bound)."""

MAX_TOKEN_ID = (1 << 31) - 1
"""Largest accepted token id in a token-id log (without ``--model``)."""

MAX_SESSION_ID_CHARS = 1024
"""Longest accepted ``session_id`` string."""

DEFAULT_OUTPUT_LENGTH = 256
"""Output length of a request whose line gives none."""

OUTPUT_FIELDS = ("output_length", "output_tokens", "max_tokens")
"""Fields read for the output length, in order of preference."""

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
"""The special tokens a chat template sees as variables (as ``transformers`` passes
them)."""

_BATCH_CHARS = 4 << 20  # rendered characters tokenized in one batch
_BATCH_LINES = 256
_HASH_SEED = "kvoffload-trace"


# ----------------------------------------------------------------------- the tokenizer


class ModelTokenizer:
    """A model's tokenizer (``tokenizer.json``) and chat template, loaded offline.

    Args:
        model: a model directory holding ``tokenizer.json`` (and optionally
            ``tokenizer_config.json``, ``chat_template.jinja``, ``chat_template.json``),
            or the path of a ``tokenizer.json``.
        chat_template: a Jinja template file to use instead of the model's.

    Raises:
        ConfigError: field ``"model"`` or ``"chat_template"``, when a file is missing,
            unreadable or malformed.
    """

    def __init__(self, model: str | Path, chat_template: str | Path | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - the cli extra pulls it in
            raise ConfigError("model", "the 'tokenizers' package is not installed",
                              "Install kvoffload[cli] (or pip install tokenizers).") from None
        path = Path(model)
        directory = path if path.is_dir() else path.parent
        tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        if not tokenizer_file.is_file():
            problem = (f"{path} does not exist" if not path.exists() else
                       f"{path} holds no tokenizer.json" if path.is_dir() else
                       f"{path} is not a regular file")
            raise ConfigError("model", problem,
                              "Give a local model directory that holds tokenizer.json "
                              "(nothing is downloaded).")
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise ConfigError("model", f"{tokenizer_file} cannot be loaded ({exc})",
                              "Give the tokenizer.json a Hugging Face model ships.") from None
        # A tokenizer.json may carry truncation or padding settings; a prompt is neither
        # truncated nor padded (transformers turns both off unless asked).
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.tokenizer_file = tokenizer_file
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        """One more than the largest token id (added tokens included)."""
        config = _json_file(directory / "tokenizer_config.json", "model")
        self.special_tokens: dict[str, Any] = {}
        for name in SPECIAL_TOKENS:
            value = _token_text(config.get(name))
            if value is not None:
                self.special_tokens[name] = value
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            self.special_tokens["additional_special_tokens"] = [
                t for t in (_token_text(item) for item in extra) if t is not None]
        self.templates, self.template_source = _find_templates(directory, config,
                                                               chat_template)
        self._compiled: dict[str, jinja2.Template] = {}
        for name, text in self.templates.items():
            self._compiled[name] = _compile(text, self.template_source)

    @property
    def has_template(self) -> bool:
        return bool(self._compiled)

    def render(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of ``messages`` (raises whatever the template raises)."""
        if not self._compiled:
            return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + \
                "assistant:"
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        template = self._compiled.get(name) or next(iter(self._compiled.values()))
        return template.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=True, **self.special_tokens)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text: without special tokens after a chat template (as
        ``apply_chat_template``), with them for the plain rendering."""
        encodings = self._tokenizer.encode_batch(list(texts),
                                                 add_special_tokens=not self._compiled)
        return [e.ids for e in encodings]


def _token_text(value: object) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _json_file(path: Path, field: str) -> dict[str, Any]:
    """A JSON object file; ``{}`` when it does not exist."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(field, f"{path} cannot be read ({exc})",
                          "Give the file the model ships, or remove it.") from None
    if not isinstance(data, dict):
        raise ConfigError(field, f"{path} is not a JSON object",
                          "Give the file the model ships, or remove it.")
    return data


def _find_templates(directory: Path, config: dict[str, Any],
                    override: str | Path | None) -> tuple[dict[str, str], str | None]:
    """The chat templates by name (``default``, ``tool_use``, ...) and where they came
    from; ``({}, None)`` for a model without one."""
    fix = "Give a Jinja chat template (the file a Hugging Face model ships)."
    if override is not None:
        try:
            return {"default": Path(override).read_text(encoding="utf-8")}, str(override)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("chat_template", f"{override} cannot be read ({exc})",
                              fix) from None
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return {"default": jinja_file.read_text(encoding="utf-8")}, str(jinja_file)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("chat_template", f"{jinja_file} cannot be read ({exc})",
                              fix) from None
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        source, value = str(json_file), _json_file(json_file, "chat_template").get(
            "chat_template")
    else:
        source, value = str(directory / "tokenizer_config.json"), config.get("chat_template")
    if value is None:
        return {}, None
    if isinstance(value, str):
        return {"default": value}, source
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}, source
    raise ConfigError("chat_template", f"{source}: 'chat_template' is neither a string nor "
                      "a list of {name, template} objects", fix)


def _compile(text: str, source: str | None) -> jinja2.Template:
    """Compile a chat template in the environment ``transformers`` renders it in."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - the cli extra pulls it in
        raise ConfigError("chat_template", "the 'jinja2' package is not installed",
                          "Install kvoffload[cli] (or pip install jinja2).") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(_without_generation_tags(text))
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError("chat_template", f"{source}: line {exc.lineno}: {exc.message}",
                          "Fix the template or give another with --chat-template.") from None


def _without_generation_tags(text: str) -> str:
    """``{% generation %}`` blocks (an extension of ``transformers`` that marks assistant
    text) render their body unchanged: drop the tags."""
    import re

    return re.sub(r"\{%-?\s*(?:end)?generation\s*-?%\}", "", text)


# ------------------------------------------------------------------------ the log lines


@dataclass
class _Row:
    """One parsed request, before numbering."""

    lineno: int
    time_s: float
    output_length: int
    session_id: str | int | None
    tokens: list[int] | None = None
    text: str | None = None
    input_length: int = 0
    ids: array[int] | None = None  # provisional block numbers


def _log_lines(path: str, f: IO[bytes]) -> Iterator[tuple[int, str]]:
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
                             f"{_show(value)} is not an ISO 8601 time (e.g. "
                             "2025-01-31T12:00:00Z) nor a number of seconds") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)  # a naive time is read as UTC
        return "iso", moment.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value) / (1000.0 if unit == "ms" else 1.0)
        except OverflowError:
            seconds = math.inf
        if not math.isfinite(seconds):
            raise TraceError(path, lineno, "timestamp", f"must be finite, got {_show(value)}")
        return "number", seconds
    raise TraceError(path, lineno, "timestamp",
                     f"expected seconds (a number) or an ISO 8601 string, got {_show(value)}")


def _output_length(path: str, lineno: int, record: dict[str, Any], default: int) -> int:
    for field in OUTPUT_FIELDS:
        value = record.get(field)
        if value is None:
            continue
        if not _is_int(value):
            raise TraceError(path, lineno, field, f"expected an integer, got {_show(value)}")
        if not 1 <= value <= MAX_OUTPUT_TOKENS:
            raise TraceError(path, lineno, field,
                             f"must be in [1, {MAX_OUTPUT_TOKENS:,}], got {_show(value)}")
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
                     f"expected a string or an integer, got {_show(value)}")


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
                                 f"expected a content part object, got {_show(part)}")
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise TraceError(path, lineno, where,
                                 f"only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                 f"can be tokenized, got type {_show(part.get('type'))}")
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise TraceError(path, lineno, field,
                         f"expected a string or a list of text parts, got {_show(content)}")
    if not content:
        raise TraceError(path, lineno, field, "is empty; a message needs text")
    return content


def _messages(path: str, lineno: int, record: dict[str, Any]) -> list[dict[str, Any]]:
    value = record["messages"]
    if not isinstance(value, list):
        raise TraceError(path, lineno, "messages", f"expected a list, got {_show(value)}")
    if not value:
        raise TraceError(path, lineno, "messages", "is empty; a request needs a message")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise TraceError(path, lineno, f"messages[{i}]",
                             f"expected an object with role and content, got "
                             f"{_show(message)}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise TraceError(path, lineno, f"messages[{i}].role",
                             "missing" if role is None else
                             f"expected a non-empty string, got {_show(role)}")
        content = _content(path, lineno, f"messages[{i}].content", message)
        messages.append({**message, "content": content})
    return messages


def _tools(path: str, lineno: int, record: dict[str, Any]) -> list[dict[str, Any]] | None:
    value = record.get("tools")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise TraceError(path, lineno, "tools", f"expected a list of objects, got "
                         f"{_show(value)}")
    return value or None


def _tokens(path: str, lineno: int, record: dict[str, Any], vocab: int | None) -> list[int]:
    value = record["tokens"]
    if not isinstance(value, list):
        raise TraceError(path, lineno, "tokens", f"expected a list of token ids, got "
                         f"{_show(value)}")
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
                             f"got {_show(item)}")
    return value


# ---------------------------------------------------------------------- the conversion


@dataclass(frozen=True)
class ConvertSummary:
    """What ``convert_log`` wrote.

    Attributes:
        input, output: the log read and the trace written.
        format: ``"chat"`` or ``"tokens"``.
        requests: lines converted (one request each).
        input_tokens, output_tokens: their sums.
        blocks: hash ids written (``ceil(input_length / block_size)`` per request).
        unique_blocks: distinct hash ids.
        block_size: tokens per hash id.
        tokenizer: the ``tokenizer.json`` used, or None (a token-id log without a model).
        chat_template: where the chat template came from; None: none was applied.
        sessions: distinct ``session_id`` values, or None when no line has one.
        timestamps: whether the log has timestamps (without, every request arrives at 0).
        reordered: whether lines were sorted into arrival order.
        duration_s: from the first arrival to the last.
    """

    input: str
    output: str
    format: str
    requests: int
    input_tokens: int
    output_tokens: int
    blocks: int
    unique_blocks: int
    block_size: int
    tokenizer: str | None
    chat_template: str | None
    sessions: int | None
    timestamps: bool
    reordered: bool
    duration_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def convert_log(source: str | Path, output: str | Path, *,
                tokenizer: ModelTokenizer | None = None,
                block_size: int = MOONCAKE_BLOCK_TOKENS, log_format: LogFormat = "auto",
                default_output_length: int = DEFAULT_OUTPUT_LENGTH,
                time_unit: TimeUnit = "s", limit: int | None = None,
                overwrite: bool = False,
                progress: Callable[[int], None] | None = None) -> ConvertSummary:
    """Convert a chat or token-id log into a Mooncake-format trace (module docstring).

    Args:
        source: the JSON-lines log.
        output: the trace to write (atomically: a temporary file renamed into place).
        tokenizer: the model's tokenizer; required for a chat log. For a token-id log it
            bounds the ids by its vocabulary.
        block_size: tokens per hash id.
        log_format: ``"chat"``, ``"tokens"`` or ``"auto"`` (the first line decides).
        default_output_length: the output length of a line that gives none.
        time_unit: unit of numeric timestamps, ``"s"`` or ``"ms"``.
        limit: convert only the first ``limit`` requests.
        overwrite: replace an existing ``output`` (otherwise ``FileExistsError``).
        progress: called with the number of requests read so far.

    Raises:
        TraceError: the first malformed line (file, line, field); line 0 and field
            ``<file>`` for the file as a whole.
        ConfigError: field ``"model"``, a chat log without ``tokenizer``.
        ValueError: a bad argument (the caller's bug).
        FileExistsError: ``output`` exists and ``overwrite`` is false.
        OSError: the trace cannot be written (nothing is left behind).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not 1 <= default_output_length <= MAX_OUTPUT_TOKENS:
        raise ValueError(f"default_output_length must be in [1, {MAX_OUTPUT_TOKENS}]")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    if log_format not in ("auto", "chat", "tokens"):
        raise ValueError(f"unknown log format {log_format!r}")
    name = str(source)
    reader = _LogReader(name, tokenizer, block_size=block_size, log_format=log_format,
                        default_output_length=default_output_length, time_unit=time_unit)
    with open_trace_file(name) as f:
        for lineno, text in _log_lines(name, f):
            try:
                reader.add(lineno, text)
            except TraceError:
                reader.flush()  # an earlier line's problem is reported first
                raise
            if progress is not None:
                progress(reader.count)
            if limit is not None and reader.count >= limit:
                break
        reader.flush()
    rows = reader.rows
    if not rows:
        raise TraceError(name, 0, "<file>", "holds no request (the file is empty or blank); "
                         "give a log with at least one JSON line")
    reordered = any(b.time_s < a.time_s for a, b in itertools.pairwise(rows))
    if reordered:
        rows.sort(key=lambda row: row.time_s)  # stable: ties keep file order
    start = rows[0].time_s
    numbering: dict[int, int] = {}
    lines = []
    for row in rows:
        assert row.ids is not None
        ids = [numbering.setdefault(i, len(numbering)) for i in row.ids]
        record: dict[str, Any] = {
            "timestamp": _milliseconds(row.time_s - start),
            "input_length": row.input_length, "output_length": row.output_length,
            "hash_ids": ids}
        if row.session_id is not None:
            record["session_id"] = row.session_id
        lines.append(json.dumps(record, separators=(", ", ": ")))
    write_atomically(output, lines, overwrite=overwrite)
    sessions = {row.session_id for row in rows if row.session_id is not None}
    return ConvertSummary(
        input=name, output=str(output), format=reader.format or "tokens",
        requests=len(rows), input_tokens=sum(r.input_length for r in rows),
        output_tokens=sum(r.output_length for r in rows),
        blocks=sum(len(r.ids or ()) for r in rows), unique_blocks=len(numbering),
        block_size=block_size,
        tokenizer=str(tokenizer.tokenizer_file) if tokenizer is not None else None,
        chat_template=(tokenizer.template_source if tokenizer is not None
                       and reader.format == "chat" else None),
        sessions=len(sessions) if sessions else None,
        timestamps=reader.time_kind is not None, reordered=reordered,
        duration_s=rows[-1].time_s - start)


def _milliseconds(seconds: float) -> int | float:
    ms = round(seconds * 1000.0, 3)
    return int(ms) if ms == int(ms) else ms


class _LogReader:
    """Parses log lines into rows, tokenizing chat prompts in batches."""

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
        self.rows: list[_Row] = []
        self.pending: list[_Row] = []
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
        row = _Row(lineno, time_s, _output_length(path, lineno, record,
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

    def _finish(self, row: _Row) -> None:
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


# ---------------------------------------------------------------------- atomic writing


def write_atomically(path: str | Path, lines: Sequence[str], *,
                     overwrite: bool = False) -> None:
    """Write ``lines`` (each followed by a line feed) to ``path`` through a temporary
    file in the same directory, synced and then renamed into place: readers see the old
    file or the whole new one, and a failure leaves nothing behind.

    Raises:
        FileExistsError: ``path`` exists (or appears meanwhile) and ``overwrite`` is false.
        OSError: the file cannot be written.
    """
    target = Path(path)
    if not overwrite and os.path.lexists(target):
        raise FileExistsError(17, "File exists", str(target))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                               suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for line in lines:
                f.write(line)
                f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600
        if overwrite:
            os.replace(tmp, target)
        else:
            _link_no_clobber(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _link_no_clobber(tmp: str, target: Path) -> None:
    """Rename ``tmp`` to ``target`` unless ``target`` exists (a hard link refuses an
    existing name atomically; where links are not supported, check and rename)."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise
    except OSError:
        if os.path.lexists(target):
            raise FileExistsError(17, "File exists", str(target)) from None
        os.replace(tmp, target)
        return
    os.unlink(tmp)
