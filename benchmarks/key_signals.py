"""Which online signals predict that a cached prefix block is read again (hits per byte).

A host tier at a few percent of the working set keeps a block until about that many other
blocks have come in after it. Whether a block is worth keeping is then whether it is read
again before that: this script replays a Mooncake-format trace at block level and asks, at
every access of a block (its first store and every later read), how well each signal known
*at that moment* predicts that label. Each signal is scored by its AUC (the chance that a
block read again in time ranks above one that is not; 0.5 is no information, below 0.5 a
lower value predicts the read) and so is an online logistic combination of all of them,
which predicts each access before its label is known and learns from labels only once
they are.

Label at horizon H (a share of the trace's distinct blocks): the block is read again by a
later request before H more new blocks have been stored after this access (what a cache
of H blocks that evicts in insertion order keeps; the oracle's horizon is longer).

Signals (``SIGNALS``) use the past only: reads by distinct earlier requests, depth in the
prompt, blocks after it in this prompt, whether it ends this prompt, the share of this
prompt already seen, how many distinct deeper blocks extend it, the request's turn (one
more than the deepest earlier prompt end it passes through), requests and seconds since
the block was first stored, seconds since its last access.

    .venv/bin/python benchmarks/key_signals.py                      # the shared trace
    .venv/bin/python benchmarks/key_signals.py --horizons 5,20 --json
    .venv/bin/python benchmarks/key_signals.py --trace my.jsonl --limit 4000

The first and second halves of the trace (by arrival time) are scored separately, so a
signal that only predicts on one half shows it. Accesses too near the trace's end for
their outcome to be known (fewer than H new blocks stored after them and no read) are
left out of the scores and counted as ``censored``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.errors import TraceError
from kvoffload.workloads.mooncake import iter_trace_records

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(os.environ.get("KVOFFLOAD_TRACE", ROOT.parent / "shared" / "traces"
                            / "mooncake_conversation_trace.jsonl"))
SIGNALS = ("reads", "depth", "remaining", "prompt_end", "request_seen", "extensions",
           "turn", "age_requests", "age_s", "idle_s")
LEARNING_RATE = 0.01


@dataclass
class Block:
    """What the replay knows of one block so far."""

    stored_at_request: int
    stored_at_s: float
    last_access_s: float
    reads: int = 0
    children: set[int] = field(default_factory=set)
    turn: int = -1
    """The turn of the latest request whose prompt ended here (-1: none did)."""


@dataclass
class Access:
    """One access: its signals, when it happened, its label and prediction per horizon."""

    signals: tuple[float, ...]
    second_half: bool
    stored_before: int
    """New blocks stored up to this access, its own first store included (the horizons
    count the new blocks stored after it)."""
    predicted: list[float]
    labels: list[bool]
    learned: list[bool]
    """Per horizon, whether the online model has learned this access's label yet."""


class OnlineLogistic:
    """Logistic regression on the signals (``log1p``, standardized by running means and
    deviations), trained by SGD as labels arrive; predictions use only what was learned
    before them."""

    def __init__(self, size: int) -> None:
        self.weights = [0.0] * (size + 1)
        self._count = 0
        self._mean = [0.0] * size
        self._m2 = [0.0] * size

    def _features(self, signals: Sequence[float]) -> list[float]:
        out = [1.0]
        for i, s in enumerate(signals):
            x = math.log1p(max(0.0, s))
            spread = math.sqrt(self._m2[i] / self._count) if self._count > 1 else 0.0
            out.append((x - self._mean[i]) / spread if spread > 0 else 0.0)
        return out

    def observe(self, signals: Sequence[float]) -> None:
        """Update the running means and deviations with one access's signals."""
        self._count += 1
        for i, s in enumerate(signals):
            x = math.log1p(max(0.0, s))
            delta = x - self._mean[i]
            self._mean[i] += delta / self._count
            self._m2[i] += delta * (x - self._mean[i])

    def predict(self, signals: Sequence[float]) -> float:
        z = sum(w * x for w, x in zip(self.weights, self._features(signals), strict=True))
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))

    def learn(self, signals: Sequence[float], label: bool) -> None:
        features = self._features(signals)
        z = sum(w * x for w, x in zip(self.weights, features, strict=True))
        error = float(label) - 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))
        for i, x in enumerate(features):
            self.weights[i] += LEARNING_RATE * error * x


def block_chain(ids: dict[tuple[int, int], int], hash_ids: Sequence[int]) -> list[int]:
    """The block ids of a prompt's hash ids: one per (parent block, hash id), numbered in
    ``ids`` as first seen (a hash id names a block only after its whole prefix)."""
    chain, parent = [], -1
    for hash_id in hash_ids:
        parent = ids.setdefault((parent, hash_id), len(ids))
        chain.append(parent)
    return chain


class Replay:
    """The trace at block level: blocks, accesses, and the models learning online."""

    def __init__(self, horizons: Sequence[int]) -> None:
        self.horizons = list(horizons)
        self.ids: dict[tuple[int, int], int] = {}
        self.blocks: dict[int, Block] = {}
        self.accesses: list[Access] = []
        self.models = [OnlineLogistic(len(SIGNALS)) for _ in horizons]
        self.stored = 0
        self._open: dict[int, int] = {}  # block -> its latest access, not read since
        self._expiring: list[deque[int]] = [deque() for _ in horizons]

    def _learn(self, access: Access, h: int, label: bool) -> None:
        if not access.learned[h]:
            access.learned[h] = True
            self.models[h].learn(access.signals, label)

    def _read(self, key: int) -> None:
        """``key`` is read again: its latest access gets its labels."""
        a = self._open.pop(key, None)
        if a is None:
            return
        access = self.accesses[a]
        for h, horizon in enumerate(self.horizons):
            access.labels[h] = self.stored - access.stored_before <= horizon
            self._learn(access, h, access.labels[h])

    def _expire(self) -> None:
        """Accesses ``horizon`` new blocks old are misses at that horizon (learned now)."""
        for h, (horizon, queue) in enumerate(zip(self.horizons, self._expiring, strict=True)):
            while queue and self.accesses[queue[0]].stored_before + horizon < self.stored:
                self._learn(self.accesses[queue.popleft()], h, False)

    def request(self, index: int, now: float, hash_ids: Sequence[int], second_half: bool,
                ) -> None:
        blocks = self.blocks
        chain = block_chain(self.ids, hash_ids)
        if not chain:
            return
        seen = sum(1 for key in chain if key in blocks) / len(chain)
        turn = 1 + max((blocks[key].turn for key in chain if key in blocks), default=-1)
        for depth, key in enumerate(chain):
            block = blocks.get(key)
            read = block is not None
            if block is None:
                block = blocks[key] = Block(index, now, now)
                self.stored += 1  # the horizon counts the blocks stored after this one
            else:
                self._read(key)
            signals = (float(block.reads), float(depth), float(len(chain) - 1 - depth),
                       float(depth == len(chain) - 1), seen, float(len(block.children)),
                       float(turn), float(index - block.stored_at_request),
                       now - block.stored_at_s, now - block.last_access_s)
            n = len(self.horizons)
            for model in self.models:
                model.observe(signals)
            self.accesses.append(Access(signals, second_half, self.stored,
                                        [m.predict(signals) for m in self.models],
                                        [False] * n, [False] * n))
            a = len(self.accesses) - 1
            self._open[key] = a
            for queue in self._expiring:
                queue.append(a)
            if read:
                block.reads += 1
            if depth:
                blocks[chain[depth - 1]].children.add(key)
            block.last_access_s = now
            self._expire()
        blocks[chain[-1]].turn = turn


def replay(path: Path, horizon_shares: Sequence[float], limit: int | None,
           ) -> tuple[Replay, list[int]]:
    """Replay the trace; the horizons, in blocks, are shares of its distinct blocks."""
    records = list(iter_trace_records(path, limit=limit))
    if not records:
        raise TraceError(str(path), 0, "hash_ids", "no requests: nothing to replay")
    chained: dict[tuple[int, int], int] = {}
    for r in records:
        block_chain(chained, r.hash_ids)
    distinct = len(chained)
    horizons = [max(1, round(share * distinct)) for share in horizon_shares]
    middle = (records[0].timestamp_ms + records[-1].timestamp_ms) / 2
    run = Replay(horizons)
    for index, record in enumerate(records):
        run.request(index, record.timestamp_ms / 1000, record.hash_ids,
                    record.timestamp_ms > middle)
    return run, horizons


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Mann-Whitney AUC of ``scores`` for ``labels`` (ties count half); NaN if one class
    is empty."""
    positives = sum(labels)
    negatives = len(labels) - positives
    if not positives or not negatives:
        return math.nan
    order = sorted(range(len(scores)), key=scores.__getitem__)
    rank_sum = 0.0
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        mean_rank = (i + j) / 2 + 1
        rank_sum += mean_rank * sum(labels[order[k]] for k in range(i, j + 1))
        i = j + 1
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def score(run: Replay, horizons: Sequence[int]) -> list[dict[str, object]]:
    """Per horizon and half: the share of accesses read again in time, each signal's AUC
    and the online combination's."""
    out: list[dict[str, object]] = []
    age, reads = SIGNALS.index("age_requests"), SIGNALS.index("reads")
    kinds = {"store": lambda a: a.signals[age] == 0,
             "first_read": lambda a: a.signals[age] > 0 and a.signals[reads] == 0,
             "later_read": lambda a: a.signals[reads] > 0}
    for h, horizon in enumerate(horizons):
        for half in (False, True):
            # Accesses too near the trace's end to know their outcome are left out.
            chosen = [a for a in run.accesses if a.second_half == half and a.learned[h]]
            labels = [a.labels[h] for a in chosen]
            row: dict[str, object] = {
                "horizon_blocks": horizon, "half": "second" if half else "first",
                "accesses": len(chosen),
                "censored": sum(1 for a in run.accesses
                                if a.second_half == half and not a.learned[h]),
                "read_again": sum(labels) / len(labels) if labels else math.nan}
            for kind, pick in kinds.items():
                sub = [a.labels[h] for a in chosen if pick(a)]
                row[f"read_again_after_{kind}"] = sum(sub) / len(sub) if sub else math.nan
            for s, name in enumerate(SIGNALS):
                row[name] = auc([a.signals[s] for a in chosen], labels)
            row["online"] = auc([a.predicted[h] for a in chosen], labels)
            out.append(row)
    return out


def format_rows(rows: Sequence[dict[str, object]], shares: Sequence[float]) -> str:
    names = (*SIGNALS, "online")
    lines = ["AUC of each signal for 'read again within the horizon' (0.5: no information; "
             "below 0.5: a lower value predicts the read)",
             "| horizon | half | accesses | read again | after its store | after its first "
             "read | after a later read | " + " | ".join(names) + " |",
             "|" + "---|" * (7 + len(names))]
    share_of = dict(zip([r["horizon_blocks"] for r in rows[::2]], shares, strict=False))
    for row in rows:
        cells = [f"{share_of.get(row['horizon_blocks'], 0):.0%}", str(row["half"]),
                 str(row["accesses"]), f"{row['read_again']:.1%}",
                 *(f"{row[f'read_again_after_{k}']:.1%}"
                   for k in ("store", "first_read", "later_read")),
                 *(f"{row[n]:.2f}" for n in names)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE,
                        help="Mooncake-format JSONL trace (default: the shared trace)")
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="the first N requests only")
    parser.add_argument("--horizons", default="5,20", metavar="P,P",
                        help="horizons in percent of the trace's distinct blocks "
                             "(default 5,20)")
    parser.add_argument("--json", action="store_true", help="JSON rows instead of a table")
    args = parser.parse_args(argv)
    try:
        shares = [float(p) / 100 for p in args.horizons.split(",")]
    except ValueError:
        parser.error(f"--horizons: percentages separated by commas, got {args.horizons!r}")
    if not shares or any(not 0 < share <= 1 for share in shares):
        parser.error(f"--horizons: each in (0, 100], got {args.horizons!r}")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit: at least 1, got {args.limit}")
    try:
        run, horizons = replay(args.trace, shares, args.limit)
    except (TraceError, OSError) as error:
        print(f"key_signals.py: {error}", file=sys.stderr)
        return 2
    rows = score(run, horizons)
    print(json.dumps(rows, indent=2) if args.json else format_rows(rows, shares))
    return 0


if __name__ == "__main__":
    sys.exit(main())
