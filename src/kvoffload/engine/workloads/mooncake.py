"""Reader of Mooncake-format request traces (JSON lines).

Each line is one request::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

``timestamp`` is the arrival in milliseconds; each hash id stands for one block of
``block_tokens`` (512) prompt tokens, equal ids meaning equal content. The reader expands
every id into ``block_tokens`` deterministic token ids derived from the id alone (so equal
ids give equal tokens wherever they occur) and truncates the last block to
``input_length``.

Every line is validated; the first problem raises ``TraceError(path, line, field,
problem)``. Rules: a JSON object; ``timestamp`` a finite number >= 0 and not below the
previous line's; ``input_length`` and ``output_length`` integers >= 1; ``hash_ids`` a
non-empty list of integers >= 0 whose count is exactly ``ceil(input_length /
block_tokens)``. Booleans are not integers. Blank lines are skipped. Unknown fields are
ignored.

The reader streams: it reads one line at a time and yields requests as it goes, so a
``limit`` stops reading early and a malformed line beyond the limit is never seen.
"""

from __future__ import annotations

import json
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvoffload.engine.workloads.request import TOKEN_TYPECODE, WorkloadRequest, derive_tokens
from kvoffload.errors import TraceError

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in Mooncake traces."""

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
        path: the JSON-lines file.
        limit: stop after this many requests (None: all).
        block_tokens: tokens per hash id.
        cache_salt: salt given to every request (None: no salt).
        id_prefix: request ids are ``f"{id_prefix}-{line_number}"``.

    Raises:
        TraceError: on the first malformed line (the file, 1-based line and field).
        OSError: when the file cannot be read.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    name = str(path)
    expand = _BlockTokens(block_tokens)
    count = 0
    last_ts = 0.0
    if limit == 0:
        return
    with open(path, encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            record = _parse(name, lineno, line)
            ts = _timestamp(name, lineno, record, last_ts)
            input_length = _positive_int(name, lineno, record, "input_length")
            output_length = _positive_int(name, lineno, record, "output_length")
            hash_ids = _hash_ids(name, lineno, record)
            need = math.ceil(input_length / block_tokens)
            if len(hash_ids) != need:
                raise TraceError(name, lineno, "input_length",
                                 f"{input_length} tokens need {need} blocks of "
                                 f"{block_tokens}, but hash_ids has {len(hash_ids)}")
            prompt: array[int] = array(TOKEN_TYPECODE)
            for hash_id in hash_ids:
                prompt.extend(expand(hash_id))
            del prompt[input_length:]
            yield WorkloadRequest(request_id=f"{id_prefix}-{lineno}", arrival_s=ts / 1000.0,
                                  prompt=prompt, output_length=output_length,
                                  cache_salt=cache_salt)
            last_ts = ts
            count += 1
            if limit is not None and count >= limit:
                return


def _parse(path: str, lineno: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(path, lineno, "<json>", f"invalid JSON: {exc.msg} at column "
                         f"{exc.colno}") from None
    if not isinstance(record, dict):
        raise TraceError(path, lineno, "<json>",
                         f"expected a JSON object, got {type(record).__name__}")
    return record


def _field(path: str, lineno: int, record: dict[str, Any], field: str) -> object:
    if field not in record:
        raise TraceError(path, lineno, field, "missing")
    value: object = record[field]
    return value


def _timestamp(path: str, lineno: int, record: dict[str, Any], last: float) -> float:
    value = _field(path, lineno, record, "timestamp")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(path, lineno, "timestamp",
                         f"expected a number of milliseconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise TraceError(path, lineno, "timestamp", f"must be finite and >= 0, got {value}")
    if value < last:
        raise TraceError(path, lineno, "timestamp",
                         f"{value} is earlier than the previous request's {last}")
    return float(value)


def _positive_int(path: str, lineno: int, record: dict[str, Any], field: str) -> int:
    value = _field(path, lineno, record, field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, lineno, field, f"expected an integer, got {value!r}")
    if value < 1:
        raise TraceError(path, lineno, field, f"must be >= 1, got {value}")
    return value


def _hash_ids(path: str, lineno: int, record: dict[str, Any]) -> list[int]:
    value = _field(path, lineno, record, "hash_ids")
    if not isinstance(value, list):
        raise TraceError(path, lineno, "hash_ids", f"expected a list, got {value!r}")
    if not value:
        raise TraceError(path, lineno, "hash_ids", "is empty")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise TraceError(path, lineno, "hash_ids",
                             f"item {i} must be an integer >= 0, got {item!r}")
    return value
