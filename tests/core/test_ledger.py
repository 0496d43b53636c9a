"""``JobLedger``: exact-once completion of jobs reported by several ranks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvoffload.errors import InvariantError
from kvoffload.jobs import JobId
from kvoffload.ledger import JobLedger


@dataclass
class Job:
    job_id: JobId
    payload: str
    reported_ranks: int = 0
    failed: bool = False


@dataclass
class Counters:
    stale_reports: int = 0
    duplicate_reports: int = 0


def make(num_ranks: int = 2) -> tuple[JobLedger[JobId, Job], Counters]:
    counters = Counters()
    return JobLedger(JobId, num_ranks, counters), counters


def test_ids_count_up_and_the_ledger_maps_them_in_issue_order() -> None:
    ledger, _ = make()
    a = ledger.issue(lambda job_id: Job(job_id, "a"))
    b = ledger.issue(lambda job_id: Job(job_id, "b"))
    assert (a.job_id, b.job_id) == (0, 1) and ledger.next_id == 2
    assert list(ledger) == [0, 1] and len(ledger) == 2
    assert ledger[JobId(1)] is b and ledger.get(JobId(0)) is a and ledger.get(JobId(7)) is None
    assert JobId(0) in ledger and dict(ledger.items()) == {0: a, 1: b}
    ledger.check_integrity()


def test_a_job_completes_once_when_every_rank_reported_it() -> None:
    ledger, counters = make(3)
    job = ledger.issue(lambda job_id: Job(job_id, "x"))
    assert ledger.count(job.job_id, 0, False) is None
    assert ledger.count(job.job_id, 2, True) is None
    assert ledger.count(job.job_id, 1, False) is job  # the last rank completes it
    assert job.failed  # one rank failed it
    assert ledger.count(job.job_id, 1, False) is None  # before retire: a duplicate
    assert counters.duplicate_reports == 1
    assert ledger.retire(job.job_id) is job and len(ledger) == 0
    assert ledger.count(job.job_id, 0, False) is None  # after retire: a duplicate too
    assert counters == Counters(stale_reports=0, duplicate_reports=2)


def test_a_second_report_by_one_rank_is_a_duplicate_and_ignored() -> None:
    ledger, counters = make(2)
    job = ledger.issue(lambda job_id: Job(job_id, "x"))
    assert ledger.count(job.job_id, 0, True) is None
    assert ledger.count(job.job_id, 0, False) is None
    assert counters.duplicate_reports == 1 and job.reported_ranks == 0b01
    assert ledger.count(job.job_id, 1, False) is job and job.failed


def test_reports_from_before_a_reset_are_stale() -> None:
    ledger, counters = make(1)
    old = [ledger.issue(lambda job_id: Job(job_id, "old")) for _ in range(3)]
    ledger.retire(old[1].job_id)
    assert ledger.reset() == (0, 2)  # in flight, in issue order: the caller flushes them
    assert len(ledger) == 0
    for job in old:
        assert ledger.count(job.job_id, 0, False) is None
    assert counters.stale_reports == 3 and counters.duplicate_reports == 0
    new = ledger.issue(lambda job_id: Job(job_id, "new"))
    assert new.job_id == 3  # ids are never reused
    assert ledger.count(new.job_id, 0, False) is new
    ledger.check_integrity()


def test_a_report_of_an_id_never_issued_raises() -> None:
    ledger, _ = make()
    ledger.issue(lambda job_id: Job(job_id, "x"))
    with pytest.raises(InvariantError, match="never issued"):
        ledger.count(JobId(1), 0, False)
    ledger.reset()  # ids below the reset are stale, but a negative one was never issued
    with pytest.raises(InvariantError, match="never issued"):
        ledger.count(JobId(-1), 0, False)
    with pytest.raises(InvariantError, match="not in flight"):
        ledger.retire(JobId(5))


def test_the_ledger_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="num_ranks"):
        JobLedger(JobId, 0, Counters())


def test_integrity_catches_a_report_from_an_unknown_rank() -> None:
    ledger, _ = make(2)
    job = ledger.issue(lambda job_id: Job(job_id, "x"))
    job.reported_ranks = 0b100
    with pytest.raises(InvariantError, match="unknown ranks"):
        ledger.check_integrity()


def test_a_report_from_a_rank_outside_the_workers_raises() -> None:
    ledger, _ = make()
    ledger.check_rank(ledger.num_ranks - 1)
    for rank in (-1, ledger.num_ranks):
        with pytest.raises(InvariantError, match=f"from rank {rank}"):
            ledger.check_rank(rank)
