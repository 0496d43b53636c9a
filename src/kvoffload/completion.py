"""Exact-once completion counting of jobs reported by several workers (ranks).

Transfer jobs (the planner) and tier jobs (the cascade tier) follow one rule: a job is done
when every rank has reported it, once. Reports for jobs issued before a reset are stale
and ignored; a second report of a job by the same rank is a duplicate and ignored; a
report for an id never issued is a bug (``InvariantError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeVar

from kvoffload.errors import InvariantError


class RankCounted(Protocol):
    """A job record that remembers which ranks reported it and whether one failed."""

    reported_ranks: int
    failed: bool


class ReportCounters(Protocol):
    stale_reports: int
    duplicate_reports: int


J = TypeVar("J", bound=RankCounted)
K = TypeVar("K", bound=int)


def count_rank_report(jobs: Mapping[K, J], job_id: K, rank: int, failed: bool, *,
                      next_id: int, stale_below: int, all_ranks: int,
                      counters: ReportCounters, what: str = "job") -> J | None:
    """Record one rank's report of ``job_id``; return the job once every rank reported it.

    ``jobs`` holds the jobs in flight; ids in ``[stale_below, next_id)`` that are not in it
    have completed already. ``all_ranks`` is the bit mask of every rank.
    """
    if job_id < stale_below:
        counters.stale_reports += 1
        return None
    job = jobs.get(job_id)
    if job is None:
        if job_id >= next_id or job_id < 0:
            raise InvariantError(f"report for {what} {job_id}, which was never issued")
        counters.duplicate_reports += 1
        return None
    bit = 1 << rank
    if job.reported_ranks & bit:
        counters.duplicate_reports += 1
        return None
    job.reported_ranks |= bit
    job.failed = job.failed or failed
    return job if job.reported_ranks == all_ranks else None
