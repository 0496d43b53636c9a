"""Worker semantics: flush, asynchrony, in-order completion, wait, failures, validation."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from worker_kit import (
    CacheSet,
    kv_separate,
    load,
    make_config,
    make_worker,
    mamba_states,
    needs_native,
    next_job_id,
    run_all,
    run_step,
    store,
)

from kvoffload.errors import InvariantError, LayoutError
from kvoffload.jobs import Direction, GroupTransfer, JobId, StepPlan, TransferJob
from kvoffload.worker import (
    CudaBackend,
    FailJobs,
    MemmoveCpuBackend,
    TransferWorker,
    cpu_backend,
)
from kvoffload.worker.cpu_memmove import _MemmoveEntry

SENTINEL = 0xEE


class GatedCpuBackend(MemmoveCpuBackend):
    """A CPU backend whose store copies wait for a gate, and every copy a fixed delay.

    The gate holds the Python copy lanes, so this backend copies with ``memmove``
    (``MemmoveCpuBackend``); tests run on both copy paths hold jobs with
    ``CpuBackend.hold`` instead (``COPY_PATHS``).
    """

    def __init__(self, delay: float = 0.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.started: list[JobId] = []

    def _copy(self, batch: list[_MemmoveEntry]) -> None:
        self.started.extend(e.job.job_id for e in batch)
        if batch[0].job.direction is Direction.STORE:
            self.gate.wait()
        time.sleep(self.delay)
        super()._copy(batch)


def _cache(num_blocks: int = 16, seed: int = 0) -> CacheSet:
    return kv_separate(num_blocks, torch.Generator().manual_seed(seed), layers=1)


COPY_PATHS = [
    pytest.param(False, id="memmove"),
    pytest.param(True, id="native", marks=needs_native),
]
"""Both CPU copy paths; tests taking ``native`` hold jobs with ``CpuBackend.hold``."""


@pytest.mark.parametrize("native", COPY_PATHS)
def test_stores_run_asynchronously_until_polled(native: bool) -> None:
    cache = _cache(seed=1)
    backend = cpu_backend(native_copy=native)
    worker = make_worker([cache], backend=backend)
    backend.hold(Direction.STORE)
    s = store(0, [1, 2], [0, 1])
    worker.execute(StepPlan(stores=(s,)))  # returns while the copy is held
    report = worker.poll()
    assert report.finished == () and report.failed == ()
    backend.hold(Direction.STORE, False)
    worker.wait([s.job_id, JobId(10**9)])  # an unknown id is ignored
    report = worker.poll()
    assert report.finished == (s.job_id,) and report.stats.stored_bytes > 0
    assert worker.poll().finished == ()  # reported exactly once
    assert torch.equal(worker.host_pool.slot_view(0, 0), cache.block(1))
    worker.shutdown()


def test_flushed_store_is_complete_when_execute_returns() -> None:
    """A store whose engine blocks are about to be reused is flushed: execute returns only
    once it is done, so the engine may then overwrite the blocks."""
    cache = _cache()
    backend = GatedCpuBackend(delay=0.05)
    worker = make_worker([cache], backend=backend)
    original = cache.block(3).clone()
    earlier = store(0, [3], [4])
    worker.execute(StepPlan(stores=(earlier,)))
    worker.execute(StepPlan(flush=(earlier.job_id,)))
    assert torch.equal(worker.host_pool.slot_view(4, 0), original)
    for _, (k, v) in cache.layers:  # the engine reuses block 3 right away
        k[3].zero_()
        v[3].zero_()
    ld = load(0, [7], [4])
    assert run_all(worker, [ld]).finished[-1] == ld.job_id
    assert torch.equal(cache.block(7), original)
    worker.shutdown()


def test_store_in_flush_and_stores_of_the_same_step_is_submitted_first() -> None:
    cache = _cache()
    backend = GatedCpuBackend(delay=0.05)
    worker = make_worker([cache], backend=backend)
    urgent, later = store(0, [5], [0]), store(0, [6], [1])
    worker.execute(StepPlan(flush=(urgent.job_id,), stores=(later, urgent)))
    assert backend.started[0] == urgent.job_id
    assert torch.equal(worker.host_pool.slot_view(0, 0), cache.block(5))
    assert worker.poll().finished == (urgent.job_id,)  # `later` was submitted after the wait
    worker.wait([later.job_id])
    assert worker.poll().finished == (later.job_id,)
    worker.shutdown()


def test_completion_is_in_submission_order_per_direction() -> None:
    cache = _cache(num_blocks=40)
    backend = GatedCpuBackend(delay=0.01)
    worker = make_worker([cache], backend=backend, num_slots=20)
    stores = [store(0, [1 + i], [i]) for i in range(6)]
    worker.execute(StepPlan(stores=tuple(stores)))
    seen: list[JobId] = []
    deadline = time.monotonic() + 10
    while len(seen) < len(stores) and time.monotonic() < deadline:
        seen.extend(worker.poll().finished)
    assert seen == [s.job_id for s in stores]
    worker.shutdown()


@pytest.mark.parametrize("native", COPY_PATHS)
def test_loads_do_not_wait_behind_stores(native: bool) -> None:
    cache = _cache()
    backend = cpu_backend(native_copy=native)
    worker = make_worker([cache], backend=backend)
    first = store(0, [1], [0])
    assert run_all(worker, [first]).finished == (first.job_id,)
    backend.hold(Direction.STORE)  # holds stores only
    slow_store = store(0, [2], [1])
    worker.execute(StepPlan(stores=(slow_store,)))
    ld = load(0, [9], [0])
    worker.execute(StepPlan(loads=(ld,)))
    worker.wait([ld.job_id])
    assert worker.poll().finished == (ld.job_id,)
    backend.hold(Direction.STORE, False)
    worker.wait([slow_store.job_id])
    assert worker.poll().finished == (slow_store.job_id,)
    worker.shutdown()


def test_wait_ignores_unknown_and_reported_jobs() -> None:
    worker = make_worker([_cache()])
    s = store(0, [1], [0])
    run_all(worker, [s])
    start = time.monotonic()
    worker.wait([JobId(10**9), s.job_id])
    worker.wait([])
    assert time.monotonic() - start < 1
    worker.shutdown()


def test_failed_store_is_reported_failed_and_its_slots_are_reusable(
        caplog: pytest.LogCaptureFixture) -> None:
    cache = _cache()
    bad = store(0, [1, 2, 3, 4], [2, 3, 4, 5])
    hook = FailJobs([bad.job_id])
    worker = make_worker([cache], backend=cpu_backend(fault_hook=hook))
    with caplog.at_level(logging.WARNING):
        report = run_all(worker, [bad])
    assert report.failed == (bad.job_id,) and report.finished == ()
    assert report.stats.stored_bytes == 0
    assert hook.fired == [bad.job_id]
    assert any(f"job {bad.job_id} failed" in r.getMessage() and r.exc_info for r in caplog.records)
    # The tier frees the slots and hands them to the next store; it works and loads back.
    retry = store(0, [5, 6, 7, 8], [2, 3, 4, 5])
    assert run_all(worker, [retry]).finished == (retry.job_id,)
    expected = [cache.block(b).clone() for b in (5, 6, 7, 8)]
    ld = load(0, [9, 10, 11, 12], [2, 3, 4, 5])
    assert run_all(worker, [ld]).finished == (ld.job_id,)
    for b, want in zip((9, 10, 11, 12), expected, strict=True):
        assert torch.equal(cache.block(b), want)
    worker.shutdown()


def test_failed_load_is_reported_failed_and_a_retry_loads_the_right_bytes() -> None:
    cache = mamba_states(12, torch.Generator().manual_seed(5))
    first = store(0, [1, 2], [0, 1])
    bad = load(0, [5, 6], [0, 1])
    worker = make_worker([cache], backend=cpu_backend(fault_hook=FailJobs([bad.job_id])))
    assert run_all(worker, [first]).finished == (first.job_id,)
    assert run_all(worker, [bad]).failed == (bad.job_id,)
    retry = load(0, [5, 6], [0, 1])
    assert run_all(worker, [retry]).finished == (retry.job_id,)
    assert torch.equal(cache.block(5), cache.block(1))
    assert torch.equal(cache.block(6), cache.block(2))
    worker.shutdown()


def _bad_jobs() -> list[tuple[str, TransferJob, str]]:
    def job(direction: Direction, *transfers: GroupTransfer) -> TransferJob:
        return TransferJob(next_job_id(), direction, "r", transfers)

    s, ld = Direction.STORE, Direction.LOAD
    return [
        ("null block", job(s, GroupTransfer(0, (0, 2), 0, (0, 1))), "null block id"),
        ("block out of range", job(s, GroupTransfer(0, (3, 16), 0, (0, 1))),
         "engine block 16 outside"),
        ("negative block", job(ld, GroupTransfer(0, (-1,), 0, (0,))), "engine block -1"),
        ("slot out of range", job(s, GroupTransfer(0, (3,), 0, (8,))), "slot 8 outside"),
        ("slot count", job(s, GroupTransfer(0, (3, 4), 0, (0,))), "need 2 slots, got 1"),
        ("unknown group", job(ld, GroupTransfer(4, (3,), 0, (0,))), "group 4 is not registered"),
        ("empty", job(s, GroupTransfer(0, (), 0, ())), "empty transfer"),
        ("same slot twice", job(s, GroupTransfer(0, (3, 4), 0, (1, 1))), "written twice"),
        ("same block twice", job(ld, GroupTransfer(0, (3, 3), 0, (1, 2))), "written twice"),
        ("slot of two groups", job(s, GroupTransfer(0, (3,), 0, (2,)),
                                   GroupTransfer(1, (4,), 0, (2,))), "written by groups 0 and 1"),
    ]


@pytest.mark.parametrize(("label", "job", "message"), _bad_jobs(), ids=lambda v: str(v)[:20])
def test_invalid_jobs_are_reported_failed_without_touching_memory(
        label: str, job: TransferJob, message: str, caplog: pytest.LogCaptureFixture) -> None:
    caches = [_cache(), mamba_states(16, torch.Generator().manual_seed(9), layers=1)]
    worker = make_worker(caches, num_slots=8)
    worker.host_pool.arena.fill_(SENTINEL)
    before = [[c.block(b).clone() for b in range(1, 16)] for c in caches]
    plan = StepPlan(stores=(job,)) if job.direction is Direction.STORE else StepPlan(loads=(job,))
    with caplog.at_level(logging.WARNING):
        report = run_step(worker, plan)
    assert report.failed == (job.job_id,) and report.finished == (), label
    assert any(message in r.getMessage() for r in caplog.records), caplog.text
    assert bool((worker.host_pool.arena == SENTINEL).all())
    for c, old in zip(caches, before, strict=True):
        assert all(torch.equal(c.block(b), old[b - 1]) for b in range(1, 16))
    # The worker goes on normally.
    ok = store(0, [1], [0])
    assert run_all(worker, [ok]).finished == (ok.job_id,)
    worker.shutdown()


def test_a_job_listed_in_the_wrong_direction_fails() -> None:
    worker = make_worker([_cache()])
    misplaced = load(0, [1], [0])
    assert run_step(worker, StepPlan(stores=(misplaced,))).failed == (misplaced.job_id,)
    worker.shutdown()


@pytest.mark.parametrize("native", COPY_PATHS)
def test_resubmitting_a_job_in_flight_is_a_planner_bug(native: bool) -> None:
    backend = cpu_backend(native_copy=native)
    worker = make_worker([_cache()], backend=backend)
    backend.hold(Direction.STORE)
    s = store(0, [1], [0])
    worker.execute(StepPlan(stores=(s,)))
    with pytest.raises(InvariantError, match=f"job {s.job_id} submitted while already"):
        worker.execute(StepPlan(stores=(s,)))
    backend.hold(Direction.STORE, False)
    worker.shutdown()


def test_stats_count_bytes_and_time_per_direction() -> None:
    cache = _cache()
    worker = make_worker([cache], factor=2, num_slots=4)
    page = worker.layout.groups[0].page_bytes
    s = store(0, [1, 2, 3], [0, 1], first_block_index=1)
    stats = run_all(worker, [s]).stats
    assert (stats.stored_bytes, stats.loaded_bytes) == (3 * page, 0)
    assert stats.store_seconds > 0 and stats.load_seconds == 0
    ld = load(0, [4, 5], [0, 1], first_block_index=1)
    stats = run_all(worker, [ld]).stats
    assert (stats.stored_bytes, stats.loaded_bytes) == (0, 2 * page)
    worker.shutdown()


def test_large_jobs_split_over_copy_threads_round_trip() -> None:
    gen = torch.Generator().manual_seed(11)
    # 64 KiB pages with factor 2: jobs of 2 MiB are split into sub-grain pieces.
    cache = kv_separate(40, gen, layers=1, block_size=64, heads=4, head_dim=64)
    worker = make_worker([cache], factor=2, num_slots=12,
                         backend=cpu_backend(copy_threads=3, parallel_bytes=1 << 16))
    src, dst = list(range(1, 17)), list(range(20, 36))
    expected = [cache.block(b).clone() for b in src]
    s = store(0, src, list(range(8)))
    assert run_all(worker, [s]).finished == (s.job_id,)
    ld = load(0, dst, list(range(8)))
    assert run_all(worker, [ld]).finished == (ld.job_id,)
    assert all(torch.equal(cache.block(b), e) for b, e in zip(dst, expected, strict=True))
    worker.shutdown()


def test_misuse_before_registration_and_on_the_wrong_device() -> None:
    cache = _cache()
    worker = TransferWorker(make_config([cache]))
    with pytest.raises(RuntimeError, match="no caches registered"):
        worker.execute(StepPlan(stores=(store(0, [1], [0]),)))
    worker.wait([JobId(1)])  # harmless before registration
    with pytest.raises(ValueError, match="rank 2 outside"):
        TransferWorker(make_config([cache]), rank=2)
    cuda_worker = TransferWorker(make_config([cache]), backend=CudaBackend())
    with pytest.raises(LayoutError, match="CUDA backend copies CUDA tensors"):
        cuda_worker.register_kv_caches([cache.tensors(0)])
    worker.register_kv_caches([cache.tensors(0)])
    with pytest.raises(RuntimeError, match="already called"):
        worker.register_kv_caches([cache.tensors(0)])
    worker.shutdown()
    worker.shutdown()  # idempotent


class BrokenPiecesBackend(GatedCpuBackend):
    """Raises a real (not injected) error while preparing one chosen job's copy."""

    def __init__(self, broken: JobId) -> None:
        super().__init__()
        self.broken = broken

    def _pieces(self, job: TransferJob) -> list[tuple[int, int, int]]:
        if job.job_id == self.broken:
            raise RuntimeError("simulated copy error")
        return super()._pieces(job)


@pytest.mark.parametrize("kind", ["injected", "exception"])
def test_a_failure_inside_a_batch_fails_only_its_own_job(kind: str) -> None:
    cache = _cache(num_blocks=20)
    jobs = [store(0, [1 + i], [i]) for i in range(5)]
    bad = jobs[2].job_id
    backend = (GatedCpuBackend(fault_hook=FailJobs([bad])) if kind == "injected"
               else BrokenPiecesBackend(bad))
    worker = make_worker([cache], backend=backend, num_slots=8)
    backend.gate.clear()  # the first job holds the lane; the rest queue up into one batch
    worker.execute(StepPlan(stores=tuple(jobs)))
    while len(backend.started) < 1:
        time.sleep(0.001)
    backend.gate.set()
    worker.wait([j.job_id for j in jobs])
    report = worker.poll()
    assert report.failed == (bad,)
    assert report.finished == tuple(j.job_id for j in jobs if j.job_id != bad)
    if isinstance(backend.fault_hook, FailJobs):
        assert backend.fault_hook.fired == [bad]
    for i, job in enumerate(jobs):
        if job.job_id != bad:
            assert torch.equal(worker.host_pool.slot_view(i, 0), cache.block(1 + i))
    worker.shutdown()


@pytest.mark.parametrize("native", COPY_PATHS)
def test_an_injected_fault_fails_only_its_job_and_is_logged_on_either_copy_path(
        native: bool, caplog: pytest.LogCaptureFixture) -> None:
    cache = _cache(num_blocks=20, seed=3)
    jobs = [store(0, [1 + i], [i]) for i in range(5)]
    bad = jobs[2].job_id
    backend = cpu_backend(fault_hook=FailJobs([bad]), native_copy=native)
    worker = make_worker([cache], backend=backend, num_slots=8)
    backend.hold(Direction.STORE)  # all five queue up behind each other
    worker.execute(StepPlan(stores=tuple(jobs)))
    backend.hold(Direction.STORE, False)
    with caplog.at_level(logging.WARNING):
        worker.wait([j.job_id for j in jobs])
        report = worker.poll()
    assert report.failed == (bad,)
    assert report.finished == tuple(j.job_id for j in jobs if j.job_id != bad)
    assert any(f"job {bad} failed" in r.getMessage() and r.exc_info for r in caplog.records)
    for i, job in enumerate(jobs):
        if job.job_id != bad:
            assert torch.equal(worker.host_pool.slot_view(i, 0), cache.block(1 + i))
    retry = store(0, [9], [2])  # the failed job's slot is reusable
    assert run_all(worker, [retry]).finished == (retry.job_id,)
    assert torch.equal(worker.host_pool.slot_view(2, 0), cache.block(9))
    worker.shutdown()


@settings(max_examples=300, deadline=None)
@given(data=st.data(), factor=st.integers(1, 4),
       direction=st.sampled_from([Direction.STORE, Direction.LOAD]))
def test_the_fast_validation_agrees_with_the_exact_one(data: st.DataObject, factor: int,
                                                       direction: Direction) -> None:
    """Jobs near the edges (null, out-of-range and repeated blocks or slots, wrong slot
    counts, a slot split over two transfers, unknown groups): ``_check`` accepts exactly
    the jobs the page-by-page check accepts, and names the same problem."""
    worker = _validation_worker(factor)
    groups = worker.layout.groups
    transfers = []
    for _ in range(data.draw(st.integers(1, 3), "transfers")):
        group = data.draw(st.integers(0, 2), "group")  # 2 is not registered
        num_blocks = groups[group].num_blocks if group in groups else 16
        first = data.draw(st.integers(0, 2 * factor), "first block index")
        n = data.draw(st.integers(0, 2 * factor + 1), "blocks")
        ids = data.draw(st.lists(st.integers(-1, num_blocks), min_size=n, max_size=n), "ids")
        need = -(-(first % factor + n) // factor)
        count = data.draw(st.sampled_from([need, need, need, max(0, need - 1), need + 1]))
        slots = data.draw(st.lists(st.integers(-1, 8), min_size=count, max_size=count),
                          "slots")
        transfers.append(GroupTransfer(group, tuple(ids), first, tuple(slots)))
    job = TransferJob(next_job_id(), direction, "r", tuple(transfers))
    assert worker._check(job, direction) == worker._find_problem(job)


_VALIDATION_WORKERS: dict[int, TransferWorker] = {}


def _validation_worker(factor: int) -> TransferWorker:
    """One registered worker per factor (validation never copies), shared by examples."""
    if factor not in _VALIDATION_WORKERS:
        caches = [_cache(), mamba_states(12, torch.Generator().manual_seed(9), layers=1)]
        worker = make_worker(caches, factor=factor, num_slots=8)
        worker.shutdown()
        _VALIDATION_WORKERS[factor] = worker
    return _VALIDATION_WORKERS[factor]


def test_a_slot_shared_by_two_partial_transfers_of_one_group_is_accepted() -> None:
    """Sub-blocks 0-1 and 2-3 of slot 5 named by two transfers of one store: the fast check
    does not clear it (slot 5 named twice), the exact one accepts it, and it round-trips."""
    cache = _cache(num_blocks=16)
    worker = make_worker([cache], factor=4, num_slots=8)
    job = TransferJob(next_job_id(), Direction.STORE, "r", (
        GroupTransfer(0, (3, 4), 0, (5,)), GroupTransfer(0, (7, 8), 2, (5,))))
    assert not worker._plainly_valid(job)
    assert worker._check(job, Direction.STORE) is None
    assert run_all(worker, [job]).finished == (job.job_id,)
    back = load(0, [10, 11, 12, 13], [5])
    assert run_all(worker, [back]).finished == (back.job_id,)
    for a, b in zip((3, 4, 7, 8), (10, 11, 12, 13), strict=True):
        assert torch.equal(cache.block(a), cache.block(b))
    worker.shutdown()


@pytest.mark.parametrize("native", COPY_PATHS)
def test_a_suspended_worker_waits_for_its_transfers_then_touches_no_cache(
        native: bool) -> None:
    """The engine releases its cache memory between ``suspend`` and ``resume`` (vLLM's
    ``unregister_kv_caches``): what was in flight is done first, and a job arriving
    meanwhile is reported failed without a byte moved."""
    cache = _cache(seed=7)
    backend = cpu_backend(native_copy=native)
    worker = make_worker([cache], backend=backend)
    backend.hold(Direction.STORE)
    s = store(0, [1, 2], [0, 1])
    worker.execute(StepPlan(stores=(s,)))
    suspended = threading.Event()
    thread = threading.Thread(target=lambda: (worker.suspend(), suspended.set()))
    thread.start()
    assert not suspended.wait(0.2)  # the store in flight holds the suspension
    backend.hold(Direction.STORE, False)
    thread.join(5)
    assert suspended.is_set() and worker.suspended
    assert worker.poll().finished == (s.job_id,)
    engine_before = cache.block(5).clone()
    host_before = worker.host_pool.slot_view(2, 0).clone()
    refused_load, refused_store = load(0, [5], [0]), store(0, [6], [2])
    worker.execute(StepPlan(stores=(refused_store,), loads=(refused_load,)))
    report = worker.poll()
    assert set(report.failed) == {refused_load.job_id, refused_store.job_id}
    assert report.finished == ()
    assert torch.equal(cache.block(5), engine_before)
    assert torch.equal(worker.host_pool.slot_view(2, 0), host_before)
    worker.resume()
    again = load(0, [5], [0])
    worker.execute(StepPlan(loads=(again,)))
    worker.wait([again.job_id])
    assert worker.poll().finished == (again.job_id,)
    assert torch.equal(cache.block(5), cache.block(1))  # slot 0 holds block 1's store
    worker.shutdown()
