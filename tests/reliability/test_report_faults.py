"""Worker reports that go wrong, at the planner: duplicates, stale reports after a reset,
reports of jobs never issued, ranks that report late or fail, and loads the engine gives
up on (``abandon_load``)."""

from __future__ import annotations

import pytest

from core.planner_kit import Harness, full, make_config, prompt
from kvoffload.errors import InvariantError
from kvoffload.jobs import JobId, WorkerReport


def loading(workers: int = 1) -> tuple[Harness, object, JobId, tuple[int, ...]]:
    """A harness with a request whose 4-block load is in flight; (h, req, job, dests)."""
    h = Harness(make_config(full(), workers=workers))
    req = h.request("r", prompt(20))
    h.put_all(req, 4)
    assert h.lookup(req).num_tokens == 16
    table = [(1, 2, 3, 4, 5)]
    h.alloc(req, table, 16)
    plan = h.step()
    (load,) = plan.loads
    return h, req, load.job_id, (1, 2, 3, 4)


def test_a_duplicate_report_is_counted_logged_and_changes_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    h, _, job, _ = loading()
    assert h.report(job).finished_loads == ("r",)
    with caplog.at_level("WARNING"):
        again = h.report(job)
    assert "duplicate job reports" in caplog.text
    assert again.finished_loads == () and again.failed_loads == ()
    assert h.planner.stats.duplicate_reports == 1
    h.planner.check_integrity()


def test_a_report_for_a_job_never_issued_is_an_error() -> None:
    h, _, job, _ = loading()
    with pytest.raises(InvariantError, match="never issued"):
        h.report(JobId(job + 100))
    with pytest.raises(InvariantError, match="rank 3"):
        h.planner.update_from_worker_reports([WorkerReport(3, (job,))])


def test_reports_from_before_a_reset_are_ignored_and_the_load_fails() -> None:
    h, _, job, _ = loading()
    h.planner.reset_cache()
    outcome = h.report(job)  # the late report arrives after the reset
    assert outcome.finished_loads == ("r",)
    assert [f.request_id for f in outcome.failed_loads] == ["r"]
    assert h.planner.stats.stale_reports == 1
    assert h.tier.usage().pinned_slots == 0
    h.planner.check_integrity()


def test_a_job_completes_only_when_every_rank_reported_and_fails_if_one_failed() -> None:
    h, _, job, _ = loading(workers=2)
    assert h.report(job, rank=0).finished_loads == ()
    assert h.tier.usage().pinned_slots > 0  # still pinned: rank 1 has not reported
    outcome = h.report(rank=1, failed=[job])
    assert outcome.finished_loads == ("r",)
    assert [f.request_id for f in outcome.failed_loads] == ["r"]  # recompute, not data
    assert h.tier.usage().pinned_slots == 0


def test_an_abandoned_load_keeps_its_pins_and_fence_until_it_reports() -> None:
    h, req, job, dests = loading(workers=2)
    assert h.planner.abandon_load(req) == job
    assert h.planner.abandon_load(req) is None  # nothing left to abandon
    assert h.planner.jobs_fencing(dests) == {job}
    assert h.tier.usage().pinned_slots == 4
    h.planner.check_integrity()
    # The request goes on without the load: it recomputes, taking no external tokens.
    h.lookup(req)
    h.alloc(req, [(11, 12, 13, 14, 15)], 0)
    h.step(h.sched(req, [(11, 12, 13, 14, 15)], 0, 20))
    h.planner.request_finished(req)
    # Reusing a destination block before the late copy reports flushes the job.
    assert job in h.step(other=[dests[0]]).flush
    assert h.report(job, rank=0).released_loads == ()
    outcome = h.report(job, rank=1)
    assert outcome.released_loads == (job,) and outcome.finished_loads == ()
    assert h.planner.jobs_fencing(dests) == set()
    assert h.tier.usage().pinned_slots == 0
    h.planner.check_integrity()


def test_a_reset_releases_abandoned_loads_without_failing_their_requests() -> None:
    h, req, job, _ = loading()
    h.planner.abandon_load(req)
    h.planner.reset_cache()
    assert job in h.step().flush  # the workers wait for the stuck copy first
    outcome = h.report()
    assert outcome.released_loads == (job,) and outcome.failed_loads == ()
    assert h.report(job).released_loads == ()  # its own late report is stale
    h.planner.check_integrity()


def test_a_load_abandoned_before_any_plan_carried_it_is_released_at_once() -> None:
    h = Harness(make_config(full()))
    req = h.request("r", prompt(20))
    h.put_all(req, 4)
    h.lookup(req)
    h.alloc(req, [(1, 2, 3, 4, 5)], 16)
    job = h.planner.abandon_load(req)
    assert job is not None
    assert h.step().loads == ()
    assert h.report().released_loads == (job,)
    assert h.tier.usage().pinned_slots == 0
