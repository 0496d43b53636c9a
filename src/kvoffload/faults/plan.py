"""What faults to inject, where and how often: a seeded, reproducible schedule.

A ``FaultPlan`` decides, job by job, whether a transfer job gets a fault and which one. It
is deterministic for a given seed and sequence of decisions, so a failing soak run can be
replayed exactly. ``FaultLog`` counts what was injected.

The fault kinds (``FaultKind``) and what a correct system must do about each:

* ``fail``: the transfer fails; its destination may hold garbage. A failed load makes the
  engine recompute (never use the bytes); a failed store frees its slots.
* ``hang``: the transfer completes ``hang_s`` modelled seconds late, past a load deadline.
  The engine gives up waiting and recomputes elsewhere; the blocks the late copy writes
  stay parked until it reports.
* ``duplicate``: a rank reports the job twice. The second report is counted and ignored.
* ``late``: the job is still in flight when the cache is reset and reports afterwards;
  the stale report is ignored (the reset's flush waited for the copy).
* ``reorder``: the job reports after jobs submitted later.
* ``partial``: only some tensor-parallel ranks report on time; the job completes when the
  last rank reports, ``hang_s`` later.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from kvoffload.errors import ConfigError, shown


class FaultKind(str, Enum):
    FAIL = "fail"
    HANG = "hang"
    DUPLICATE = "duplicate"
    LATE = "late"
    REORDER = "reorder"
    PARTIAL = "partial"


ALL_KINDS = tuple(FaultKind)


@dataclass(frozen=True)
class FaultPlan:
    """A fault schedule for transfer jobs.

    Attributes:
        rate: probability that a transfer job gets a fault, in [0, 1].
        kinds: the kinds to choose from, uniformly.
        seed: seed of the schedule.
        hang_s: modelled seconds a ``hang`` or ``partial`` job is late.
        reorder_s: modelled seconds a ``reorder`` job is held back.
        min_reset_interval_s: ``late`` faults reset the cache; at most one reset per this
            many modelled seconds (other ``late`` picks become another kind).
    """

    rate: float
    kinds: tuple[FaultKind, ...] = ALL_KINDS
    seed: int = 0
    hang_s: float = 30.0
    reorder_s: float = 0.05
    min_reset_interval_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError("faults", f"rate {self.rate} is outside [0, 1]",
                              "Give a probability such as 0.01.")
        if not self.kinds:
            raise ConfigError("faults", "no fault kinds", "Name at least one kind.")
        if not (self.hang_s > 0 and self.reorder_s > 0 and self.min_reset_interval_s >= 0):
            raise ConfigError("faults", "hang_s and reorder_s must be positive",
                              "Give modelled seconds.")

    @classmethod
    def parse(cls, text: str, *, seed: int = 0) -> FaultPlan:
        """``RATE[,KIND...]``, e.g. ``0.01`` (every kind) or ``0.05,fail,hang``."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise ConfigError("--faults", "is empty", "Give RATE[,KIND...], e.g. 0.01,fail.")
        try:
            if not parts[0].isascii():  # float() takes other digits too: refused alike
                raise ValueError(parts[0])
            rate = float(parts[0])
        except ValueError:
            raise ConfigError("--faults", f"rate {shown(parts[0])} is not a number",
                              "Give RATE[,KIND...], e.g. 0.01,fail,hang.") from None
        known = {k.value: k for k in FaultKind}
        kinds = []
        for name in parts[1:]:
            if name not in known:
                raise ConfigError("--faults", f"unknown fault kind {shown(name)}",
                                  f"Choose from {', '.join(known)}.")
            kinds.append(known[name])
        return cls(rate, tuple(dict.fromkeys(kinds)) or ALL_KINDS, seed=seed)

    def schedule(self) -> FaultSchedule:
        """A fresh schedule drawing decisions from this plan's seed."""
        return FaultSchedule(self)


@dataclass
class FaultLog:
    """What was injected, per kind and direction, and what the system did about it."""

    injected: Counter[str] = field(default_factory=Counter)
    """Injected faults by ``"<kind>/<direction>"``."""
    jobs: int = 0
    """Transfer jobs that went through the fault layer."""
    resets: int = 0
    """Cache resets the ``late`` faults provoked."""

    def add(self, kind: FaultKind, direction: str) -> None:
        self.injected[f"{kind.value}/{direction}"] += 1

    def by_kind(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for name, n in self.injected.items():
            out[name.split("/")[0]] += n
        return dict(out)

    @property
    def total(self) -> int:
        return sum(self.injected.values())


K = TypeVar("K")


def draw_fault(rng: random.Random, rate: float, kinds: Sequence[K],
               allowed: Container[K] | None = None) -> K | None:
    """One fault decision: with probability ``rate`` a kind drawn evenly from ``kinds``
    (those in ``allowed``, when given), else None; None too when no kind is allowed."""
    if rng.random() >= rate:
        return None
    if allowed is not None:
        kinds = [k for k in kinds if k in allowed]
    if not kinds:
        return None
    return kinds[rng.randrange(len(kinds))]


class FaultSchedule:
    """Draws one decision per job from a ``FaultPlan`` (deterministic for its seed)."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)

    def decide(self, *, allowed: tuple[FaultKind, ...] | None = None) -> FaultKind | None:
        """The fault for the next job, or None. ``allowed`` narrows the kinds (a caller
        that cannot inject a kind now); when nothing is allowed, no fault."""
        return draw_fault(self._rng, self.plan.rate, self.plan.kinds, allowed)
