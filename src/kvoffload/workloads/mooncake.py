"""Reader of Mooncake-format request traces (JSON lines).

Each line is one request::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

``timestamp`` is the arrival in milliseconds; each hash id stands for one block of
``block_tokens`` (512) prompt tokens, equal ids meaning equal content. The reader expands
every id into ``block_tokens`` deterministic token ids derived from the id alone (so equal
ids give equal tokens wherever they occur) and truncates the last block to
``input_length``.

Every line is validated; the first problem raises ``TraceError(path, line, field,
problem)``. Rules: a JSON object; ``timestamp`` a number in ``[0, MAX_TIMESTAMP_MS]``
and not below the previous line's; ``input_length`` an integer in ``[1, MAX_INPUT_TOKENS]`` and
``output_length`` an integer in ``[1, MAX_OUTPUT_TOKENS]``; ``hash_ids`` a non-empty list
of integers in ``[0, MAX_HASH_ID]`` whose count is exactly ``ceil(input_length /
block_tokens)``. Booleans are not integers. Blank lines are skipped. Unknown fields are
ignored.

The work done on a line is bounded before the line is trusted: a line longer than
``MAX_LINE_BYTES`` (not counting its line feed) is refused after reading at most that many
bytes and before decoding; a line that is not UTF-8 is refused; a line whose brackets nest
deeper than ``MAX_NESTING`` is refused before ``json.loads`` sees it (a linear scan, no
recursion); the prompt is allocated only once ``input_length`` is within bounds and agrees
with ``hash_ids``. Whole-file problems (a path that is not a regular file or cannot be
opened, a trace without any request) raise ``TraceError`` with line 0 and field
``"<file>"``; line-level problems use the fields ``"<line>"`` (length, encoding) and
``"<json>"`` (syntax, nesting, not an object). The type of the path is checked on a
non-blocking descriptor, so a FIFO or a device is refused without waiting on it.

The reader streams: it reads one line at a time and yields requests as it goes, so a
``limit`` stops reading early and a malformed line beyond the limit is never seen.
"""

from __future__ import annotations

import codecs
import json
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvoffload.errors import TraceError
from kvoffload.files import UnreadableFileError, json_too_deep, open_regular_file
from kvoffload.workloads.request import TOKEN_TYPECODE, WorkloadRequest, derive_tokens

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake traces."""

MAX_LINE_BYTES = 256 * 1024
"""Longest accepted line, in bytes without its line feed. The largest line of the shared
Mooncake conversation trace is 2,053 bytes (247 hash ids); a line at ``MAX_INPUT_TOKENS``
with 512-token blocks and 19-digit ids is under 90 KiB."""

MAX_INPUT_TOKENS = 1 << 21
"""Largest accepted ``input_length`` (2,097,152 tokens; the shared trace's largest is
126,195). Bounds the prompt the reader allocates for one request."""

MAX_OUTPUT_TOKENS = 1 << 21
"""Largest accepted ``output_length`` (the shared trace's largest is 2,000)."""

MAX_HASH_ID = (1 << 63) - 1
"""Largest accepted hash id (a signed 64-bit integer; the shared trace's ids are below
200,000)."""

MAX_TIMESTAMP_MS = 253_402_300_799_000
"""Largest accepted ``timestamp``: the end of the year 9999 as Unix milliseconds (about
8,000 years of relative time; the latest ISO 8601 time a chat log can give). A trace's
timestamps are arrival times from its start or Unix milliseconds; a larger value (``1e300``)
is no plausible time, and durations stay readable (at most 12 digits of seconds)."""

MAX_NESTING = 16
"""Deepest accepted bracket nesting in a line (a request is 2 deep: an object holding the
``hash_ids`` list)."""

_BLOCK_CACHE_SIZE = 4096


class _BlockTokens:
    """Tokens of one hash id, with a small LRU cache (shared prefixes repeat ids)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._cache: OrderedDict[int, array[int]] = OrderedDict()

    def __call__(self, hash_id: int) -> array[int]:
        tokens = self._cache.get(hash_id)
        if tokens is None:
            tokens = mooncake_block_tokens(hash_id, self.block_tokens)
            self._cache[hash_id] = tokens
            if len(self._cache) > _BLOCK_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(hash_id)
        return tokens


def mooncake_block_tokens(hash_id: int,
                          block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> array[int]:
    """The token ids a hash id expands to (what the reader uses)."""
    return derive_tokens(f"mooncake-block/{block_tokens}/{hash_id}", block_tokens)


def read_mooncake_trace(path: str | Path, *, limit: int | None = None,
                        block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                        cache_salt: str | None = None,
                        id_prefix: str = "mooncake") -> Iterator[WorkloadRequest]:
    """Yield the requests of a Mooncake trace, in file order (see the module docstring).

    Args:
        path: the JSON-lines file (a regular file).
        limit: stop after this many requests (None: all; 0: none, the file is not opened).
        block_tokens: tokens per hash id.
        cache_salt: salt given to every request (None: no salt).
        id_prefix: request ids are ``f"{id_prefix}-{line_number}"``.

    Raises:
        TraceError: on the first malformed line (the file, 1-based line and field); with
            line 0 and field ``"<file>"`` when the path is not a regular file, cannot be
            opened or read, or holds no request. Nothing else escapes for any file content.
        ValueError: ``limit`` < 0 or ``block_tokens`` < 1 (a caller's bug, not the file's).
    """
    expand = _BlockTokens(block_tokens)
    for rec in iter_trace_records(path, block_tokens=block_tokens, limit=limit):
        prompt: array[int] = array(TOKEN_TYPECODE)
        for hash_id in rec.hash_ids:
            prompt.extend(expand(hash_id))
        del prompt[rec.input_length:]
        yield WorkloadRequest(request_id=f"{id_prefix}-{rec.line}",
                              arrival_s=rec.timestamp_ms / 1000.0, prompt=prompt,
                              output_length=rec.output_length, cache_salt=cache_salt)


@dataclass(frozen=True)
class TraceRecord:
    """One validated trace line (its prompt is not built)."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    session_id: str | int | None


def iter_trace_records(path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                       limit: int | None = None) -> Iterator[TraceRecord]:
    """The lines of a Mooncake trace, validated (the errors ``read_mooncake_trace``
    documents), without expanding hash ids into tokens."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if limit == 0:
        return
    name = str(path)
    count = 0
    last_ts = 0.0
    with open_trace_file(name) as f:
        for lineno, text in _lines(name, f):
            record = _parse(name, lineno, text)
            ts = _timestamp(name, lineno, record, last_ts)
            input_length = _bounded_int(name, lineno, record, "input_length",
                                        MAX_INPUT_TOKENS)
            output_length = _bounded_int(name, lineno, record, "output_length",
                                         MAX_OUTPUT_TOKENS)
            hash_ids = _hash_ids(name, lineno, record)
            need = math.ceil(input_length / block_tokens)
            if len(hash_ids) != need:
                raise TraceError(name, lineno, "input_length",
                                 f"{input_length} tokens need {need} blocks of "
                                 f"{block_tokens}, but hash_ids has {len(hash_ids)}")
            session = record.get("session_id")
            if isinstance(session, bool) or not isinstance(session, (str, int)):
                session = None  # an unknown field to the reader: ignored unless usable
            yield TraceRecord(lineno, ts, input_length, output_length, hash_ids, session)
            last_ts = ts
            count += 1
            if limit is not None and count >= limit:
                return
    if count == 0:
        raise TraceError(name, 0, "<file>", "holds no request (the file is empty or blank); "
                         "give a trace with at least one JSON line")


def open_trace_file(path: str | Path) -> IO[bytes]:
    """Open ``path`` for binary reading, refusing anything but a regular file with a
    ``TraceError`` (line 0, field ``<file>``).

    The descriptor is opened non-blocking (``kvoffload.files.open_regular_file``), so a
    FIFO is refused from its type at once instead of waiting for a writer.
    """
    try:
        return open_regular_file(path)
    except UnreadableFileError as exc:
        fix = ("give the path of a readable trace file" if exc.reason.startswith("cannot")
               else "give the path of a JSON-lines trace file")
        raise TraceError(str(path), 0, "<file>", f"{exc.reason}; {fix}") from None


def _lines(path: str, f: IO[bytes]) -> Iterator[tuple[int, str]]:
    """The trace's request lines (``read_lines`` with the trace's bounds)."""
    return read_lines(path, f, max_bytes=MAX_LINE_BYTES,
                      too_long="a request line is a few KB (split the file into one JSON "
                               "object per line)", what="trace")


def read_lines(path: str, f: IO[bytes], *, max_bytes: int, too_long: str, what: str,
               strip_bom: bool = False) -> Iterator[tuple[int, str]]:
    """Yield ``(line number, text)`` of every non-blank line of ``f``, decoded and
    length-checked; ``TraceError`` (naming ``path`` and the line) for a line over
    ``max_bytes`` (``too_long`` says what to do), one that is not UTF-8 (save the
    ``what`` as UTF-8) or a read error. At most ``max_bytes + 1`` bytes are read for a
    line before it is judged; ``strip_bom`` drops a UTF-8 byte order mark on line 1.
    """
    lineno = 0
    while True:
        try:
            raw = f.readline(max_bytes + 1)
        except OSError as exc:
            raise TraceError(path, lineno + 1, "<file>",
                             f"cannot be read ({exc.strerror or exc})") from None
        if not raw:
            return
        lineno += 1
        body = raw[:-1] if raw.endswith(b"\n") else raw
        if len(body) > max_bytes:
            raise TraceError(path, lineno, "<line>", f"longer than {max_bytes:,} bytes; "
                             + too_long)
        if strip_bom and lineno == 1 and body.startswith(b"\xef\xbb\xbf"):
            body = body[3:]
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(path, lineno, "<line>",
                             f"not valid UTF-8 (byte {exc.start + 1}); save the {what} as "
                             "UTF-8") from None
        if _has_content(text):
            yield lineno, text


def _has_content(text: str) -> bool:
    """Whether a trace line is a request line (not blank)."""
    return bool(text.strip())


def count_trace_lines(path: str | Path, chunk_bytes: int = 1 << 20) -> int:
    """The request lines (non-blank, as the reader sees them) of trace ``path``, read
    ``chunk_bytes`` at a time: a file without line breaks costs one chunk of memory, not
    the whole file. For progress totals; the lines are not validated."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    count = 0
    open_line = False  # the line being read has shown content (a line is blank iff
    #                    every part of it is)
    with open_trace_file(path) as f:
        while True:
            chunk = f.read(chunk_bytes)
            *complete, rest = decoder.decode(chunk, final=not chunk).split("\n")
            for piece in complete:
                count += open_line or _has_content(piece)
                open_line = False
            open_line = open_line or _has_content(rest)
            if not chunk:
                return count + open_line


def _parse(path: str, lineno: int, line: str) -> dict[str, Any]:
    return parse_json_object(path, lineno, line, max_nesting=MAX_NESTING,
                             nesting_hint="; a request is a flat object with one list")


def parse_json_object(path: str, lineno: int, line: str, *, max_nesting: int,
                      nesting_hint: str = "") -> dict[str, Any]:
    """Line ``lineno`` of ``path`` as a JSON object; ``TraceError`` (field ``<json>``) for
    brackets nested deeper than ``max_nesting`` (checked before parsing), invalid JSON or
    another JSON type."""
    if json_too_deep(line, max_nesting):
        raise TraceError(path, lineno, "<json>",
                         f"brackets nest deeper than {max_nesting}{nesting_hint}")
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(path, lineno, "<json>", f"invalid JSON: {exc.msg} at column "
                         f"{exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer beyond 4300 digits
        raise TraceError(path, lineno, "<json>", f"invalid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise TraceError(path, lineno, "<json>",
                         f"expected a JSON object, got {type(record).__name__}")
    return record


def _field(path: str, lineno: int, record: dict[str, Any], field: str) -> object:
    if field not in record:
        raise TraceError(path, lineno, field, "missing")
    value: object = record[field]
    return value


def _show(value: object) -> str:
    """A short ``repr`` for messages (a hostile value can be a long string or list)."""
    text = repr(value) if not isinstance(value, (list, dict)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _timestamp(path: str, lineno: int, record: dict[str, Any], last: float) -> float:
    value = _field(path, lineno, record, "timestamp")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(path, lineno, "timestamp",
                         f"expected a number of milliseconds, got {_show(value)}")
    try:
        ts = float(value)
    except OverflowError:
        ts = math.inf
    if not math.isfinite(ts) or not 0 <= ts <= MAX_TIMESTAMP_MS:
        raise TraceError(path, lineno, "timestamp",
                         f"must be a number of milliseconds in [0, {MAX_TIMESTAMP_MS:,}] "
                         f"(the end of year 9999 as Unix milliseconds), got {_show(value)}")
    if ts < last:
        raise TraceError(path, lineno, "timestamp",
                         f"{value} is earlier than the previous request's {last}")
    return ts


def _bounded_int(path: str, lineno: int, record: dict[str, Any], field: str,
                 bound: int) -> int:
    value = _field(path, lineno, record, field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, lineno, field, f"expected an integer, got {_show(value)}")
    if value < 1:
        raise TraceError(path, lineno, field, f"must be >= 1, got {_show(value)}")
    if value > bound:
        raise TraceError(path, lineno, field, f"must be <= {bound:,}, got {_show(value)}")
    return value


def _hash_ids(path: str, lineno: int, record: dict[str, Any]) -> list[int]:
    value = _field(path, lineno, record, "hash_ids")
    if not isinstance(value, list):
        raise TraceError(path, lineno, "hash_ids", f"expected a list, got {_show(value)}")
    if not value:
        raise TraceError(path, lineno, "hash_ids", "is empty")
    for i, item in enumerate(value):
        if (isinstance(item, bool) or not isinstance(item, int) or item < 0
                or item > MAX_HASH_ID):
            raise TraceError(path, lineno, "hash_ids",
                             f"item {i} must be an integer in [0, 2**63 - 1], "
                             f"got {_show(item)}")
    return value
