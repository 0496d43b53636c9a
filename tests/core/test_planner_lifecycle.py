"""Jobs over a request's life: fences and flushes, aborts, preemption, reset, reports.

Rule 4 (docs/architecture.md): no engine block is overwritten while a job still uses it. Window and
Mamba blocks are fenced as soon as their store exists (the engine frees them mid-request);
full-attention blocks when the request finishes; a preempted request's stores are flushed
in the same plan. Rules 2-3: ref counts are exact and every job completes once, counted
over all ranks; stale reports are ignored, reports for jobs never issued are errors.

Every story ends with nothing in flight, fenced, pinned or kept (``Harness.drained``).
"""

from __future__ import annotations

import pytest
from planner_kit import (
    Harness,
    Moved,
    full,
    make_config,
    only,
    prompt,
    start_load,
    three_groups,
)

from kvoffload.errors import InvariantError
from kvoffload.jobs import JobId, WorkerReport
from kvoffload.planner.contract import LoadFailure, MatchResult, ReportOutcome
from kvoffload.tiers.base import LookupResult

HIT = LookupResult.HIT
PENDING = LookupResult.PENDING
MISS = LookupResult.MISS
DEFER = MatchResult(None)


def hit(tokens: int) -> MatchResult:
    return MatchResult(tokens, load_async=True)


# -- fences ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("reused", "flushed"), [(12, (0,)), (31, ())])
def test_window_blocks_freed_mid_request_flush_their_pending_store_when_reallocated(
        reused: int, flushed: tuple[int, ...]) -> None:
    # A 40-token prompt in two chunks. The first chunk's store (job 0) reads window
    # blocks 11-16 and Mamba block 26 (the state at 24, where the chunk ends; no state
    # exists at the block ends it crossed); it is still in flight when the second chunk
    # starts. By then the engine has freed window positions 0-1 (ids 11, 12) and Mamba
    # positions 0-4, and hands id 12 back out for window position 6. The plan must flush
    # job 0 before the forward pass writes block 12. A fresh id flushes nothing.
    h = Harness(three_groups())
    a = h.request("a", prompt(40))
    table = [tuple(range(1, 7)), tuple(range(11, 17)), tuple(range(21, 27))]
    h.admit(a, table)
    first = only(h.step(h.sched(a, table, 0, 24)).stores)
    assert first.job_id == 0
    assert h.planner.fence_size == 7  # window + Mamba ids; full attention not yet
    new_ids = [(7, 8, 9, 10), (reused, 17, 18, 19), (27, 28, 29, 30)]
    plan = h.step(h.sched(a, new_ids, 24, 16, freed=(0, 2, 5)))
    assert plan.flush == flushed
    second = only(plan.stores)
    assert h.moved(second, a) == [
        Moved(0, (7, 8, 9, 10), 6, (6, 7, 8, 9)),
        Moved(1, (reused, 17, 18, 19), 6, (6, 7, 8, 9)),
        Moved(2, (30,), 9, (9,)),  # the state at 40 only
    ]
    h.complete(first.job_id, second.job_id)
    h.planner.request_finished(a)
    assert h.drained()


@pytest.mark.parametrize("path", ["alloc", "new_block_ids", "other_allocations"])
def test_full_attention_blocks_are_fenced_when_the_request_finishes(path: str) -> None:
    # a finishes while its store (job 0) still reads full-attention blocks 1-2. Whichever
    # way the engine hands block 1 out again, the next plan flushes job 0 first.
    h = Harness(three_groups())
    a = h.request("a", prompt(8))
    table = [(1, 2), (11, 12), (21, 22)]
    h.admit(a, table)
    store = only(h.step(h.sched(a, table, 0, 8)).stores)
    assert h.planner.fence_size == 3  # running: a's own ref protects blocks 1-2
    h.planner.request_finished(a)
    assert h.planner.fence_size == 5
    assert h.planner.num_requests == 1  # kept until its store drains
    b = h.request("b", prompt(8, base=7000))
    b_table = [(1, 3), (13, 14), (23, 24)]
    if path == "alloc":
        h.admit(b, b_table)
        plan = h.step()
    elif path == "new_block_ids":
        h.admit(b, [(), (), ()])
        plan = h.step(h.sched(b, b_table, 0, 4))
    else:
        plan = h.step(other=(1,))
    assert plan.flush == (store.job_id,)
    h.complete(store.job_id)
    assert h.status(a, 0, range(2)) == [HIT, HIT]  # the store landed after all
    h.planner.request_finished(b)
    for job in plan.stores:
        h.complete(job.job_id)
    assert h.drained()


def test_loads_do_not_enter_the_fence_while_the_request_lives() -> None:
    h = Harness(three_groups())
    a, load = start_load(h)
    assert h.planner.fence_size == 0
    h.complete(load.job_id)
    h.planner.request_finished(a)
    assert h.drained()


# -- aborts ---------------------------------------------------------------------------------


def test_abort_mid_load_keeps_pins_and_fences_destinations_until_reported() -> None:
    h = Harness(three_groups())
    a, load = start_load(h)
    h.planner.request_finished(a)  # aborted while its load runs
    assert h.ref(a, 0, range(6)) == [1] * 6  # still pinned
    assert h.planner.fence_size == 11  # 6 full + 4 window + 1 Mamba destinations
    assert h.step(other=(21,)).flush == (load.job_id,)
    outcome = h.complete(load.job_id)
    assert outcome.finished_loads == ("a",)
    assert h.ref(a, 0, range(6)) == [0] * 6
    assert h.drained()


def test_abort_mid_store_keeps_the_request_until_its_store_drains() -> None:
    h = Harness(three_groups())
    a = h.request("a", prompt(16))
    table = [(1, 2, 3, 4), (11, 12, 13, 14), (21, 22, 23, 24)]
    h.admit(a, table)
    store = only(h.step(h.sched(a, table, 0, 8)).stores)  # chunk 1 of 2
    h.planner.request_finished(a)
    assert h.status(a, 0, range(2)) == [PENDING, PENDING]
    # The id may not come back while the old request still drains ...
    with pytest.raises(ValueError, match="already finished"):
        h.lookup(h.request("a", prompt(16)))
    with pytest.raises(ValueError, match="already finished"):
        h.step(h.sched(h.request("a", prompt(4)), [(5,), (15,), (25,)], 0, 4))
    h.complete(store.job_id)
    assert h.status(a, 0, range(2)) == [HIT, HIT]
    assert h.drained()
    # ... and once it is forgotten, the id names a new request (nothing is left to clash).
    again = h.request("a", prompt(9))
    assert h.lookup(again) == hit(8)


# -- preemption -----------------------------------------------------------------------------


def test_preemption_flushes_stores_and_readmission_waits_for_them() -> None:
    # a stores its prompt in two chunks (jobs 0 and 1), then is preempted with both in
    # flight: its blocks are free at once, so the same plan flushes both jobs. The engine
    # (async scheduling) tries to re-admit a before their reports arrive: deferred.
    h = Harness(three_groups())
    a = h.request("a", prompt(16))
    table = [(1, 2, 3, 4), (11, 12, 13, 14), (21, 22, 23, 24)]
    h.admit(a, table)
    first = only(h.step(h.sched(a, table, 0, 8)).stores)
    second = only(h.step(h.sched(a, [(), (), ()], 8, 8, freed=(0, 0, 1))).stores)
    a.append(1)  # a decoded one token before the preemption
    plan = h.step(preempted=["a"])
    assert plan.flush == (first.job_id, second.job_id)
    assert h.lookup(a) == DEFER
    h.complete(first.job_id)
    assert h.lookup(a) == DEFER
    h.complete(second.job_id)
    # Re-admitted with a fresh table, a loads back what it stored (cap 16).
    assert h.lookup(a) == hit(16)
    new_table = [(31, 32, 33, 34, 35), (41, 42, 43, 44, 45), (0, 0, 0, 54, 55)]
    h.alloc(a, new_table, 16)
    load = only(h.step().loads)
    assert h.moved(load, a) == [Moved(0, (31, 32, 33, 34), 0, (0, 1, 2, 3)),
                                Moved(1, (41, 42, 43, 44), 0, (0, 1, 2, 3)),
                                Moved(2, (54,), 3, (3,))]
    h.complete(load.job_id)
    # Resumed: the loaded prefix is not stored again; the next block, from the new table.
    assert h.step(h.sched(a, new_table, 16, 1, resumed=True, freed=(0, 0, 3))).stores == ()
    a.append(2, 3, 4)
    store = only(h.step(h.sched(a, [(), (), ()], 17, 3, freed=(0, 0, 3))).stores)
    assert h.moved(store, a) == [Moved(0, (35,), 4, (4,)), Moved(1, (45,), 4, (4,)),
                                 Moved(2, (55,), 4, (4,))]
    h.complete(store.job_id)
    h.planner.request_finished(a)
    assert h.drained()


def test_readmission_waits_for_stores_even_when_the_hit_does_not_need_them() -> None:
    # a's prompt is stored; a decodes to 20 tokens and its store of block 4 is in
    # flight when it is preempted. Re-admitted, a could hit 16 tokens from blocks 0-3
    # without block 4 -- but a load needs a request with no job in flight, so it waits.
    h = Harness(three_groups())
    a = h.request("a", prompt(16))
    table = [(1, 2, 3, 4), (11, 12, 13, 14), (21, 22, 23, 24)]
    h.admit(a, table)
    h.complete(only(h.step(h.sched(a, table, 0, 16)).stores).job_id)
    a.append(1, 2, 3, 4)
    ids = [(5,), (15,), (25,)]
    block4 = only(h.step(h.sched(a, ids, 16, 4, freed=(0, 1, 3))).stores)
    assert h.step(preempted=["a"]).flush == (block4.job_id,)
    assert h.lookup(a) == DEFER
    h.complete(block4.job_id)
    assert h.lookup(a) == hit(16)  # cap 19 -> 16
    h.planner.request_finished(a)
    assert h.drained()


def test_readmission_deferral_is_bounded_when_flushed_stores_never_report() -> None:
    h = Harness(three_groups(max_deferred=3))
    a = h.request("a", prompt(9))
    table = [(1, 2, 3), (11, 12, 13), (21, 22, 23)]
    h.admit(a, table)
    store = only(h.step(h.sched(a, table, 0, 9)).stores)
    assert h.step(preempted=["a"]).flush == (store.job_id,)
    assert [h.lookup(a) for _ in range(3)] == [DEFER] * 3
    assert h.lookup(a) == MatchResult(0)  # give up waiting: recompute
    # a runs again (no load) while its old store is still in flight: stores may pile up.
    h.alloc(a, [(4, 5, 6), (14, 15, 16), (24, 25, 26)], 0)
    assert h.step(h.sched(a, [(4, 5, 6), (14, 15, 16), (24, 25, 26)], 0, 9,
                          resumed=True)).stores == ()  # its blocks are already present
    h.complete(store.job_id)
    h.planner.request_finished(a)
    assert h.drained()


# -- reset_cache ----------------------------------------------------------------------------


def test_reset_cache_flushes_everything_ignores_late_reports_and_fails_loads() -> None:
    # In flight at the reset: a's store (a running), f's store (f finished), b's load
    # (sent to the workers) and c's load (planned, not yet sent).
    h = Harness(three_groups())
    a = h.request("a", prompt(8, base=100))
    a_table = [(1, 2, 3), (11, 12, 13), (21, 22, 23)]
    h.admit(a, a_table)
    f = h.request("f", prompt(8, base=200))
    f_table = [(4, 5), (14, 15), (24, 25)]
    h.admit(f, f_table)
    stores = h.step(h.sched(a, a_table, 0, 8), h.sched(f, f_table, 0, 8)).stores
    h.planner.request_finished(f)
    shared = prompt(25, base=300)
    h.put_all(h.request("writer", shared), 6)
    b, c = h.request("b", shared), h.request("c", shared)
    assert h.lookup(b, 4) == hit(20)
    h.alloc(b, [tuple(range(31, 38)), (0, 0, 41, 42, 43, 44, 45), (0, 0, 0, 0, 0, 51, 52)], 20)
    b_load = only(h.step().loads)
    assert h.lookup(c) == hit(24)
    h.alloc(c, [tuple(range(61, 68)), (0, 0, 71, 72, 73, 74, 75), (0, 0, 0, 0, 0, 81, 82)], 24)

    h.planner.reset_cache()
    outcome = h.report()
    assert outcome.finished_loads == ("b", "c")
    assert outcome.failed_loads == (LoadFailure("b", 4), LoadFailure("c", 0))
    plan = h.step()
    assert plan.flush == (0, 1, 2, 3)  # a, f, b, c: every job of before the reset
    assert plan.loads == () and plan.stores == ()
    assert len(h.tier) == 0 and h.planner.fence_size == 0
    assert h.planner.num_requests == 3  # f is finalized; a, b, c live on
    # Late reports of old jobs are ignored, not errors.
    assert h.complete(*(job.job_id for job in stores), b_load.job_id) == ReportOutcome()
    assert h.planner.stats.stale_reports == 3
    d = h.request("d", shared)
    assert h.lookup(d) == MatchResult(0)  # nothing survives
    # a's store progress restarts at 0: its next store covers block 0 again.
    a.append(*prompt(4, base=900))
    store = only(h.step(h.sched(a, [(), (), ()], 8, 4, freed=(0, 0, 1))).stores)
    assert h.moved(store, a) == [Moved(0, (1, 2, 3), 0, (0, 1, 2)),
                                 Moved(1, (11, 12, 13), 0, (0, 1, 2)),
                                 Moved(2, (23,), 2, (2,))]  # the state at 12 only
    h.complete(store.job_id)
    for r in (a, b, c, d):
        h.planner.request_finished(r)
    assert h.drained()


# -- worker reports ---------------------------------------------------------------------------


def store_one_block(h: Harness) -> tuple[JobId, list[LookupResult]]:
    a = h.request("a", prompt(4))
    h.admit(a, [(1,)])
    job = only(h.step(h.sched(a, [(1,)], 0, 4)).stores).job_id
    h.planner.request_finished(a)
    return job, h.status(a, 0, [0])


def test_a_job_is_done_only_when_every_rank_reported_it_once() -> None:
    h = Harness(make_config(full(), workers=2))
    job, status = store_one_block(h)
    assert status == [PENDING]
    key = next(iter(h.tier))
    h.report(job, rank=0)
    assert h.tier.lookup(key) is PENDING
    h.report(job, rank=0)  # the same rank again: ignored, counted
    assert h.tier.lookup(key) is PENDING
    assert h.planner.stats.duplicate_reports == 1
    h.report(job, rank=1)
    assert h.tier.lookup(key) is HIT
    h.report(job, rank=1)  # late duplicate after completion: ignored
    assert h.planner.stats.duplicate_reports == 2
    assert h.drained()


def test_reports_for_jobs_never_issued_or_unknown_ranks_raise() -> None:
    h = Harness(make_config(full(), workers=2))
    job, _ = store_one_block(h)
    with pytest.raises(InvariantError, match="never issued"):
        h.report(JobId(job + 1))
    with pytest.raises(InvariantError, match="rank 2"):
        h.planner.update_from_worker_reports([WorkerReport(2, (job,))])


def test_a_store_failed_on_one_rank_frees_its_slots() -> None:
    h = Harness(make_config(full(), workers=2))
    job, _ = store_one_block(h)
    assert h.tier.usage().used_slots == 1
    h.report(job, rank=0)
    outcome = h.report(rank=1, failed=[job])
    assert outcome.failed_stores == 1
    assert h.tier.usage().used_slots == 0 and len(h.tier) == 0
    assert h.drained()


def test_a_failed_load_tells_the_engine_where_to_recompute_from() -> None:
    h = Harness(three_groups(workers=2))
    a, load = start_load(h, num_computed=8)  # hit(16)
    assert h.report(load.job_id, rank=1) == ReportOutcome()
    outcome = h.report(rank=0, failed=[load.job_id])
    assert outcome.finished_loads == ("a",)
    assert outcome.failed_loads == (LoadFailure("a", 8),)
    assert h.ref(a, 0, range(6)) == [0] * 6  # pins released
    assert h.status(a, 0, range(6)) == [HIT] * 6  # the stored copy is still good
    h.planner.request_finished(a)
    assert h.drained()


# -- misuse ---------------------------------------------------------------------------------


def test_engine_misuse_is_reported_with_what_to_change() -> None:
    h = Harness(three_groups())
    a = h.request("a", prompt(25))
    table = [tuple(range(1, 8)), (0, 0, 11, 12, 13, 14, 15), (0, 0, 0, 0, 0, 21, 22)]
    with pytest.raises(ValueError, match="never looked up"):
        h.alloc(a, table, 0)
    h.put_all(a, 6)
    assert h.lookup(a) == hit(24)
    with pytest.raises(ValueError, match="block lists for 2 groups"):
        h.alloc(a, table[:2], 24)
    with pytest.raises(ValueError, match="accepted 20 external tokens"):
        h.alloc(a, table, 20)
    assert h.lookup(a) == hit(24)
    h.alloc(a, table, 24)
    load = only(h.step().loads)
    with pytest.raises(InvariantError, match="load is in flight"):
        h.step(h.sched(a, table, 24, 1))
    h.complete(load.job_id)
    h.planner.request_finished(a)
    assert h.drained()


def test_a_null_full_attention_block_in_a_store_is_an_error() -> None:
    # Full attention needs every block: a null one where a store must read is a broken
    # block table, not something to skip.
    h = Harness(three_groups())
    a = h.request("a", prompt(8))
    table = [(1, 0), (11, 12), (21, 22)]
    h.admit(a, table)
    with pytest.raises(InvariantError, match="null or freed block at offloaded block 1"):
        h.step(h.sched(a, table, 0, 8))
