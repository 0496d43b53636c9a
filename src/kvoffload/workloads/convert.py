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
strings, from 0 (1970 for ISO times) to the end of the year 9999 as Unix time
(``MAX_TIMESTAMP_S``); every line has one or none does. The trace is written in arrival order (a log
written at completion time is sorted; ties keep file order) with ``timestamp`` in
milliseconds from the first arrival; without timestamps every request arrives at 0 in
file order. ``session_id`` (a string or an integer) is written through; the reader ignores
it and ``trace stats`` counts sessions with it.

Hostile input is bounded like the Mooncake reader's: a line longer than
``MAX_LOG_LINE_BYTES`` is refused after reading that many bytes and before decoding, a
line that is not UTF-8 is refused, brackets nesting deeper than ``MAX_LOG_NESTING`` are
refused before ``json.loads``, a prompt over ``MAX_INPUT_TOKENS`` tokens is refused. The
model's files are read with bounds and its chat template rendered with bounds
(``kvoffload.workloads.model_tokenizer`` and ``chat_template``). The
first problem raises ``TraceError(path, line, field, problem)``. The whole log is read and
checked before anything is written, the trace is written to a temporary file beside the
output and renamed into place, so a failed conversion leaves no output file.

Only a regular file is ever replaced: an output path that exists as anything else (a
symbolic link, whatever it points to; a FIFO, device, socket or directory) is refused with
a ``ConfigError`` (field ``output``) before the log is read and again just before the
rename, so ``-o /dev/null --force`` never turns a device into a file and a link is never
swapped for a file (give the link's target instead).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvoffload.errors import ConfigError, TraceError, shown
from kvoffload.files import file_kind
from kvoffload.workloads.log_reader import (
    MAX_LOG_LINE_BYTES,
    MAX_LOG_NESTING,
    MAX_PROMPT_CHARS,
    MAX_SESSION_ID_CHARS,
    MAX_TOKEN_ID,
    LogFormat,
    LogReader,
    TimeUnit,
    log_lines,
)
from kvoffload.workloads.model_tokenizer import ModelTokenizer
from kvoffload.workloads.mooncake import (
    MAX_OUTPUT_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    open_trace_file,
)

__all__ = [
    "DEFAULT_OUTPUT_LENGTH", "MAX_LOG_LINE_BYTES", "MAX_LOG_NESTING", "MAX_PROMPT_CHARS",
    "MAX_SESSION_ID_CHARS", "MAX_TOKEN_ID", "ConvertSummary", "LogFormat", "ModelTokenizer",
    "TimeUnit", "check_output_path", "convert_log", "write_atomically",
]

DEFAULT_OUTPUT_LENGTH = 256
"""Output length of a request whose line gives none."""


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
        overwrite: replace an existing ``output`` (otherwise ``FileExistsError``); only
            a regular file is ever replaced.
        progress: called with the number of requests read so far.

    Raises:
        TraceError: the first malformed line (file, line, field); line 0 and field
            ``<file>`` for the file as a whole.
        ConfigError: field ``"model"``, a chat log without ``tokenizer``; field
            ``"output"``, an ``output`` that exists and is not a regular file
            (``check_output_path``).
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
    check_output_path(output)
    name = str(source)
    reader = LogReader(name, tokenizer, block_size=block_size, log_format=log_format,
                        default_output_length=default_output_length, time_unit=time_unit)
    with open_trace_file(name) as f:
        for lineno, text in log_lines(name, f):
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

# ---------------------------------------------------------------------- atomic writing


def check_output_path(path: str | Path) -> None:
    """``ConfigError`` (field ``output``) when ``path`` exists and is not a regular file:
    a symbolic link (not followed: the link would be replaced, not its target), a
    directory, FIFO, device or socket. A missing path or a regular file passes."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ConfigError("output", f"{shown(str(path))} cannot be examined "
                          f"({getattr(exc, 'strerror', None) or exc})",
                          "Give the path of the trace file to write.") from None
    if stat.S_ISREG(mode):
        return
    fix = ("Give the link's target or another file name; a link is never replaced."
           if stat.S_ISLNK(mode) else
           "Give a file name in a directory." if stat.S_ISDIR(mode) else
           "Give the path of a regular file; only a regular file is ever replaced.")
    raise ConfigError("output", f"{path} is {file_kind(mode)}, not a regular file", fix)


def write_atomically(path: str | Path, lines: Sequence[str], *,
                     overwrite: bool = False) -> None:
    """Write ``lines`` (each followed by a line feed) to ``path`` through a temporary
    file in the same directory, synced and then renamed into place: readers see the old
    file or the whole new one, and a failure leaves nothing behind.

    Raises:
        FileExistsError: ``path`` exists (or appears meanwhile) and ``overwrite`` is false.
        ConfigError: ``path`` exists and is not a regular file (``check_output_path``;
            checked before writing and again just before the rename).
        OSError: the file cannot be written.
    """
    target = Path(path)
    check_output_path(target)
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
            check_output_path(target)  # it may have changed while the trace was written
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
