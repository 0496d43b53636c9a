"""Figures of a Mooncake-format trace that tell whether offloading can help.

Read before sizing anything: how much of the traffic repeats, and how long after.

Definitions (``block_tokens`` tokens per hash id, 512 in Mooncake traces; requests in file
order, which is arrival order):

* *Reuse share*: the share of all input blocks (hash ids) whose id appeared in an earlier
  request. *Prefix reuse share* counts only each request's leading run of such blocks,
  the part a prefix cache can serve; *ideal hit share* is the share of prompt tokens in
  those runs: what a prefix cache without a memory limit would serve (an upper bound for
  any hit rate ``kvoffload simulate`` reports on the trace).
* *Reuse distance*: for every input block whose id appeared before, the distance to that
  id's previous use, in requests (1: the request just before) and in seconds of arrival.
  A cache that keeps a block across that many requests (and their blocks) serves it.
* Percentiles are nearest-rank: p50 is the smallest value with at least half of the
  values at or below it.
* *Sessions*: distinct ``session_id`` values (``kvoffload trace convert`` writes them from
  the log; Mooncake's own traces have none).

Lines are checked exactly as the reader (``read_mooncake_trace``) checks them and the
first problem raises the same ``TraceError``; prompts are not built.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvoffload.workloads.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    iter_trace_records,
)


@dataclass(frozen=True)
class Distribution:
    """Count, sum, mean, nearest-rank percentiles and extremes of some values (all None
    but ``count`` and ``total`` when there are none)."""

    count: int
    total: float
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    min: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        n = len(values)
        if n == 0:
            return cls(0, 0, None, None, None, None, None, None)
        ordered = sorted(values)
        total = sum(ordered)
        return cls(n, total, total / n, percentile(ordered, 50), percentile(ordered, 90),
                   percentile(ordered, 99), ordered[0], ordered[-1])


def percentile(ordered: Sequence[float], p: float) -> float:
    """The nearest-rank ``p``-th percentile of sorted, non-empty ``ordered``."""
    if not ordered:
        raise ValueError("no values")
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True)
class TraceStats:
    """The figures of a trace (module docstring).

    Attributes:
        path: the trace.
        block_tokens: tokens per hash id.
        requests: lines read.
        duration_s: from the first arrival to the last.
        input_tokens, output_tokens: per request.
        blocks: input blocks (hash ids) over all requests.
        unique_blocks: distinct hash ids.
        reused_blocks: input blocks whose id appeared in an earlier request.
        prefix_reused_blocks: those in each request's leading run of such blocks.
        ideal_hit_tokens: prompt tokens in those runs.
        reuse_distance_requests: per reused block, requests since its id's previous use.
        reuse_distance_s: the same in seconds of arrival.
        sessions: distinct ``session_id`` values; None when no line has one.
        session_requests: requests per session (None without sessions).
    """

    path: str
    block_tokens: int
    requests: int
    duration_s: float
    input_tokens: Distribution
    output_tokens: Distribution
    blocks: int
    unique_blocks: int
    reused_blocks: int
    prefix_reused_blocks: int
    ideal_hit_tokens: int
    reuse_distance_requests: Distribution
    reuse_distance_s: Distribution
    sessions: int | None
    session_requests: Distribution | None

    @property
    def reuse_share(self) -> float:
        """Share of input blocks whose id appeared in an earlier request."""
        return self.reused_blocks / self.blocks if self.blocks else 0.0

    @property
    def prefix_reuse_share(self) -> float:
        """Share of input blocks in a request's leading run of reused blocks."""
        return self.prefix_reused_blocks / self.blocks if self.blocks else 0.0

    @property
    def ideal_hit_share(self) -> float:
        """Share of prompt tokens an unbounded prefix cache would serve."""
        total = self.input_tokens.total
        return self.ideal_hit_tokens / total if total else 0.0

    @property
    def request_rate(self) -> float | None:
        """Requests per second of arrival (None when they all arrive at once)."""
        return self.requests / self.duration_s if self.duration_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(reuse_share=self.reuse_share, prefix_reuse_share=self.prefix_reuse_share,
                    ideal_hit_share=self.ideal_hit_share, request_rate=self.request_rate)
        return data


def trace_stats(path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                limit: int | None = None,
                progress: Callable[[int], None] | None = None) -> TraceStats:
    """The figures of the Mooncake trace at ``path`` (its first ``limit`` requests).

    Raises:
        TraceError: the first malformed line, as the reader reports it.
    """
    inputs: array[int] = array("q")
    outputs: array[int] = array("q")
    gaps_requests: array[int] = array("q")
    gaps_s: array[float] = array("d")
    last_use: dict[int, tuple[int, float]] = {}
    sessions: dict[str | int, int] = {}
    blocks = reused = prefix = ideal = 0
    first_ts = last_ts = 0.0
    index = -1
    for index, record in enumerate(iter_trace_records(path, block_tokens=block_tokens,
                                                      limit=limit)):
        ts = record.timestamp_ms / 1000.0
        if index == 0:
            first_ts = ts
        last_ts = ts
        inputs.append(record.input_length)
        outputs.append(record.output_length)
        if record.session_id is not None:
            sessions[record.session_id] = sessions.get(record.session_id, 0) + 1
        leading = True
        run = 0
        for hash_id in record.hash_ids:
            previous = last_use.get(hash_id)
            if previous is not None:
                reused += 1
                gaps_requests.append(index - previous[0])
                gaps_s.append(ts - previous[1])
                if leading:
                    run += 1
            else:
                leading = False
        for hash_id in record.hash_ids:
            last_use[hash_id] = (index, ts)
        blocks += len(record.hash_ids)
        prefix += run
        ideal += min(run * block_tokens, record.input_length)
        if progress is not None:
            progress(index + 1)
    return TraceStats(
        path=str(path), block_tokens=block_tokens, requests=index + 1,
        duration_s=last_ts - first_ts, input_tokens=Distribution.of(inputs),
        output_tokens=Distribution.of(outputs), blocks=blocks, unique_blocks=len(last_use),
        reused_blocks=reused, prefix_reused_blocks=prefix, ideal_hit_tokens=ideal,
        reuse_distance_requests=Distribution.of(gaps_requests),
        reuse_distance_s=Distribution.of(gaps_s),
        sessions=len(sessions) if sessions else None,
        session_requests=Distribution.of(list(sessions.values())) if sessions else None)
