"""``JobLedger``: the jobs in flight that several workers (ranks) report, counted exactly once.

Transfer jobs (the planner) and tier jobs (the cascade tier) follow one rule set, which
this class alone keeps for both:

* ``issue`` gives every job a new id, counting up from 0 and never reused (also not after
  ``reset``).
* A job is *complete* when every rank ``0 .. num_ranks - 1`` has reported it; ``count``
  returns it exactly once, on the report that completes it, failed when any rank reported
  a failure. The caller then ``retire``-s it (and acts on it); until then it stays in the
  ledger, and further reports of it are duplicates.
* A second report of a job by the same rank, or a report of a job retired already, is a
  *duplicate*: counted (``counters.duplicate_reports``) and ignored.
* ``reset`` drops every job in flight; reports of any job issued before it are *stale*:
  counted (``counters.stale_reports``) and ignored.
* A report of an id never issued (negative, or not issued yet) is a bug: ``InvariantError``.

Pure bookkeeping (no I/O, no threads; one caller drives it). The ledger is a read-only
``Mapping`` from id to job record (in issue order) for inspection; only ``issue``,
``count``, ``retire`` and ``reset`` change it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, Protocol, TypeVar

from kvoffload.errors import InvariantError


class RankCounted(Protocol):
    """A job record that remembers which ranks reported it and whether one failed."""

    reported_ranks: int
    failed: bool


class ReportCounters(Protocol):
    """Where a ledger counts the reports it ignores (the caller's stats object)."""

    stale_reports: int
    duplicate_reports: int


K = TypeVar("K", bound=int)
J = TypeVar("J", bound=RankCounted)


class JobLedger(Mapping[K, J], Generic[K, J]):
    """Jobs in flight by id, with exact-once completion over ``num_ranks`` ranks.

    Args:
        make_id: turns the next integer into the caller's id type (``JobId``,
            ``TierJobId``; ``int`` works too).
        num_ranks: ranks that must report every job (>= 1).
        counters: where ``stale_reports`` and ``duplicate_reports`` are counted (the
            caller's stats object).
        what: the jobs' name in error messages ("job", "tier job").
    """

    __slots__ = ("_all_ranks", "_counters", "_jobs", "_make_id", "_next_id",
                 "_stale_below", "_what", "num_ranks")

    def __init__(self, make_id: Callable[[int], K], num_ranks: int,
                 counters: ReportCounters, *, what: str = "job") -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self._make_id = make_id
        self.num_ranks = num_ranks
        self._all_ranks = (1 << num_ranks) - 1
        self._counters = counters
        self._what = what
        self._jobs: dict[K, J] = {}
        self._next_id = 0
        self._stale_below = 0

    # -- Mapping (read-only) ------------------------------------------------------------

    def __getitem__(self, job_id: K) -> J:
        return self._jobs[job_id]

    def get(self, job_id: K, default: J | None = None) -> J | None:  # type: ignore[override]
        """The job in flight with this id, else ``default``. Changes nothing."""
        return self._jobs.get(job_id, default)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __iter__(self) -> Iterator[K]:
        """Ids in flight, in issue order. Do not issue, retire or reset while iterating."""
        return iter(self._jobs)

    def __len__(self) -> int:
        """Jobs in flight (issued, not retired, not dropped by ``reset``)."""
        return len(self._jobs)

    @property
    def next_id(self) -> int:
        """The id the next ``issue`` gives (every smaller id was issued)."""
        return self._next_id

    # -- changes ------------------------------------------------------------------------

    def issue(self, make: Callable[[K], J]) -> J:
        """Record the job ``make(new_id)`` under a new id and return it. The record must
        start with no rank reported (``reported_ranks == 0``, ``failed`` False)."""
        job_id = self._make_id(self._next_id)
        self._next_id += 1
        job = make(job_id)
        self._jobs[job_id] = job
        return job

    def check_rank(self, rank: int) -> None:
        """Raise ``InvariantError`` unless ``rank`` is one of ``0 .. num_ranks - 1`` (called
        once per report, before its jobs are counted)."""
        if not 0 <= rank < self.num_ranks:
            raise InvariantError(f"{self._what} report from rank {rank}; num_workers is "
                                 f"{self.num_ranks}")

    def count(self, job_id: K, rank: int, failed: bool) -> J | None:
        """Record ``rank``'s report of ``job_id`` (``failed``: that rank failed it).

        Returns the job when this report is the last rank's (exactly once per job; it
        stays in the ledger until ``retire``), else ``None``: more ranks to come, or the
        report was stale or a duplicate (counted in ``counters``, nothing else changes).
        Raises ``InvariantError`` for an id never issued. ``rank`` must be in
        ``[0, num_ranks)`` (``check_rank``, once per report).
        """
        if job_id < 0 or job_id >= self._next_id:
            raise InvariantError(f"report for {self._what} {job_id}, which was never issued")
        counters = self._counters
        if job_id < self._stale_below:
            counters.stale_reports += 1
            return None
        job = self._jobs.get(job_id)
        bit = 1 << rank
        if job is None or job.reported_ranks & bit:  # retired already, or this rank again
            counters.duplicate_reports += 1
            return None
        job.reported_ranks |= bit
        job.failed = job.failed or failed
        return job if job.reported_ranks == self._all_ranks else None

    def retire(self, job_id: K) -> J:
        """Remove a job in flight (normally once ``count`` returned it) and return it; later
        reports of it are duplicates. An id not in flight raises ``InvariantError``."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            raise InvariantError(f"retire of {self._what} {job_id}, which is not in flight")
        return job

    def reset(self) -> tuple[K, ...]:
        """Drop every job in flight and return their ids (in issue order; the caller
        flushes them on the workers). Reports of every id issued so far become stale;
        ids keep counting up."""
        dropped = tuple(self._jobs)
        self._jobs.clear()
        self._stale_below = self._next_id
        return dropped

    def check_integrity(self) -> None:
        """Raise ``InvariantError`` unless every job in flight has an id issued since the
        last ``reset`` and only known ranks reported it. Changes nothing."""
        for job_id, job in self._jobs.items():
            if not self._stale_below <= job_id < self._next_id:
                raise InvariantError(f"{self._what} {job_id} in flight outside the ids "
                                     f"[{self._stale_below}, {self._next_id})")
            if job.reported_ranks & ~self._all_ranks:
                raise InvariantError(f"{self._what} {job_id} reported by unknown ranks")
