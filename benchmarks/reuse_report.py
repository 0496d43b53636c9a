"""How predictable prefix reuse is in a workload: which prompts a later request continues.

A cache policy can only keep what it expects to be used again. For a hybrid model the
bytes that a hit at a prompt's end needs (the full-attention blocks of the whole prompt
plus one Mamba state or one window) are worth keeping only if a later request starts with
that whole prompt. This module measures, for a sequence of requests, how many prompts are
continued that way, whether anything known when the prompt runs (its turn in a
conversation, its length, its output's length) tells which ones, and how long after their
prompt the continuations come.

Definitions, at a block size of ``block_tokens``:

* A prompt's *end* is the chained hash of its last full block (prompts shorter than one
  block have none and are not counted).
* A request *continues* an earlier one when the deepest block its prompt shares with any
  earlier prompt is that earlier prompt's end: the longest hit it can have is then at the
  end of the earlier prompt, where a state or window kept for it serves (an exact repeat
  counts). A prompt that only passes through an earlier prompt's end, sharing more with
  another request, does not continue it. The earlier request is then *continued*; its
  *gap* is the distance, in requests and in seconds of arrival, to its first
  continuation (counting only requests with at least one full block).
* A request's *turn* is 0 unless it continues an earlier request; then it is one more than
  the highest turn among the requests it continues.

Only continuations inside the given requests are seen: prompts near the end of a slice
have less time to be continued.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvoffload.keys import BlockHash, BlockHasher
from kvoffload.workloads.request import WorkloadRequest

MIN_BUCKET_REQUESTS = 30
"""Buckets with fewer requests than this are shown but left out of the spread."""


@dataclass(frozen=True)
class Bucket:
    """Requests of one value range of a feature, and how many of them were continued."""

    label: str
    requests: int
    continued: int

    @property
    def rate(self) -> float:
        return self.continued / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class ReuseReport:
    """Continuation of prompts in a workload (see the module docstring).

    Attributes:
        requests: requests with at least one full block (those a hit at the end can serve).
        continued: how many of them a later request continued.
        features: per feature name, its buckets in ascending order.
        gap_requests: sorted distances, in requests, from each continued request to its
            first continuation.
        gap_seconds: the same distances in seconds of arrival, sorted.
    """

    requests: int
    continued: int
    features: dict[str, tuple[Bucket, ...]]
    gap_requests: tuple[int, ...]
    gap_seconds: tuple[float, ...]

    @property
    def rate(self) -> float:
        return self.continued / self.requests if self.requests else 0.0

    def spread(self) -> tuple[float, float]:
        """Lowest and highest continuation rate over the buckets of every feature that
        hold at least ``MIN_BUCKET_REQUESTS`` requests; ``(rate, rate)`` if none does."""
        rates = [b.rate for buckets in self.features.values() for b in buckets
                 if b.requests >= MIN_BUCKET_REQUESTS]
        return (min(rates), max(rates)) if rates else (self.rate, self.rate)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nearest rank, 0 < q <= 1); 0 if empty."""
    if not values:
        return 0.0
    rank = min(max(1, math.ceil(q * len(values))), len(values))
    return values[rank - 1]


def continuation_report(requests: Iterable[WorkloadRequest], block_tokens: int,
                        ) -> ReuseReport:
    """Measure which prompts of ``requests`` (in arrival order) later ones continue.

    Prompts are compared by chained block hashes at ``block_tokens`` (a trace's hash block
    size is the natural choice: finer blocks only split its blocks), with each request's
    cache salt, so requests of different tenants never continue each other.

    Raises:
        ValueError: if ``block_tokens`` is not positive.
    """
    hasher = BlockHasher(block_tokens)
    ends: dict[BlockHash, list[int]] = {}  # prompt end -> earlier requests ending there
    seen: set[BlockHash] = set()  # every block hash of every earlier prompt
    turns: list[int] = []
    arrivals: list[float] = []
    prompt_tokens: list[int] = []
    output_tokens: list[int] = []
    first_continuer: dict[int, int] = {}
    for request in requests:
        hashes = request.prompt_hashes(hasher)
        if not hashes:
            continue
        me = len(turns)
        turn = 0
        deepest = _deepest_seen(hashes, seen)
        if deepest is not None:
            for earlier in ends.get(deepest, ()):
                first_continuer.setdefault(earlier, me)
                turn = max(turn, turns[earlier] + 1)
        seen.update(hashes)
        turns.append(turn)
        arrivals.append(request.arrival_s)
        prompt_tokens.append(len(request.prompt))
        output_tokens.append(request.output_length)
        ends.setdefault(hashes[-1], []).append(me)
    continued = [i in first_continuer for i in range(len(turns))]
    features = {
        "turn in its conversation": _buckets(turns, continued, _turn_label),
        "prompt tokens": _quartile_buckets(prompt_tokens, continued),
        "output tokens": _quartile_buckets(output_tokens, continued),
    }
    gaps = sorted(first_continuer.items())
    return ReuseReport(
        requests=len(turns), continued=sum(continued), features=features,
        gap_requests=tuple(sorted(later - earlier for earlier, later in gaps)),
        gap_seconds=tuple(sorted(arrivals[later] - arrivals[earlier]
                                 for earlier, later in gaps)))


def _deepest_seen(hashes: Sequence[BlockHash], seen: set[BlockHash]) -> BlockHash | None:
    """The deepest of ``hashes`` (a chain) that an earlier prompt also had, if any."""
    depth = 0
    while depth < len(hashes) and hashes[depth] in seen:
        depth += 1
    return hashes[depth - 1] if depth else None


def _turn_label(turn: int) -> str:
    return str(turn) if turn < 3 else "3 or more"


def _buckets(values: Sequence[int], continued: Sequence[bool],
             label: Callable[[int], str]) -> tuple[Bucket, ...]:
    """One bucket per distinct label, in order of first value."""
    counts: dict[str, list[int]] = {}
    for value in sorted(set(values)):
        counts.setdefault(label(value), [0, 0])
    for value, hit in zip(values, continued, strict=True):
        count = counts[label(value)]
        count[0] += 1
        count[1] += hit
    return tuple(Bucket(name, n, c) for name, (n, c) in counts.items())


def _quartile_buckets(values: Sequence[int], continued: Sequence[bool],
                      ) -> tuple[Bucket, ...]:
    """Buckets split at the values' quartiles (fewer when quartiles coincide)."""
    ordered = sorted(values)
    cuts = sorted({int(quantile(ordered, q)) for q in (0.25, 0.5, 0.75)})
    if not ordered:
        return ()
    cuts = [c for c in cuts if c < ordered[-1]]

    def label(value: int) -> str:
        low = None
        for cut in cuts:
            if value <= cut:
                if low is None:
                    return f"up to {cut:,}"
                return f"{cut:,}" if low + 1 == cut else f"{low + 1:,}-{cut:,}"
            low = cut
        return f"over {low:,}" if low is not None else "all"

    return _buckets(values, continued, label)


def format_report(report: ReuseReport) -> list[str]:
    """The report as Markdown lines: a summary, one table per feature, the gaps."""
    low, high = report.spread()
    lines = [f"{report.continued:,} of {report.requests:,} prompts "
             f"({100 * report.rate:.1f} %) were continued by a later request; by bucket "
             f"(of at least {MIN_BUCKET_REQUESTS} requests) between {100 * low:.1f} % and "
             f"{100 * high:.1f} %.", ""]
    for name, buckets in report.features.items():
        lines += [f"| {name} | requests | share continued | share of all continued |",
                  "|---|---|---|---|"]
        lines += [f"| {b.label} | {b.requests:,} | {100 * b.rate:.1f} % | "
                  f"{100 * b.continued / max(report.continued, 1):.0f} % |" for b in buckets]
        lines.append("")
    if report.gap_requests:
        lines.append(
            "Distance from a prompt to its first continuation: median "
            f"{quantile(report.gap_requests, 0.5):,.0f} requests "
            f"({quantile(report.gap_seconds, 0.5):,.0f} s), 90th percentile "
            f"{quantile(report.gap_requests, 0.9):,.0f} requests "
            f"({quantile(report.gap_seconds, 0.9):,.0f} s).")
    return lines
