"""The CPU backend's copy path: address pieces, merging, cutting, bounds, copy threads.

Both copy paths are covered: the native queue (``NativeCpuBackend``, the default of
``cpu_backend`` where the install built it) and the ``memmove`` path from Python threads
(``MemmoveCpuBackend``, ``native_copy=False``). Tests of the Python lanes' internals
(passes, helpers) use ``MemmoveCpuBackend``.
"""

from __future__ import annotations

import ctypes
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from worker_kit import (
    LAYOUTS,
    CacheSet,
    kv_fused_block_major,
    kv_separate,
    load,
    make_worker,
    mamba_raw_padded,
    needs_native,
    next_job_id,
    run_all,
    store,
)

from kvoffload.jobs import Direction, GroupTransfer, StepPlan, TransferJob
from kvoffload.worker import (
    CpuBackend,
    MemmoveCpuBackend,
    NativeCpuBackend,
    TransferWorker,
    cpu_backend,
    cpu_memmove,
)

SENTINEL = 0xEE

BACKENDS = {
    "one-thread": dict(copy_threads=1),
    "threads-cut": dict(copy_threads=3, parallel_bytes=0, chunk_bytes=100),
    "threads-default-cut": dict(copy_threads=2, parallel_bytes=0),
    "memmove-one-thread": dict(copy_threads=1, native_copy=False),
    "memmove-threads-cut": dict(copy_threads=3, parallel_bytes=0, chunk_bytes=100,
                                native_copy=False),
}


def _check_slots(worker: TransferWorker, cache: CacheSet,
                 pairs: list[tuple[int, int, int]]) -> None:
    glayout = worker.layout.groups[0]
    pool = worker.host_pool
    for block_id, slot, sub in pairs:
        engine = cache.block(block_id)
        start = 0
        for index, seg in enumerate(glayout.segments):
            host = pool.page_view(slot, 0, index, sub)
            assert torch.equal(host, engine[start : start + seg.page_bytes]), (block_id, slot)
            start += seg.page_bytes


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("factor", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_with_runs_cuts_and_scattered_pages(name: str, factor: int,
                                                       backend: str) -> None:
    """Consecutive blocks into consecutive slots (merged copies), scattered ones, a start in
    the middle of a slot, pieces cut at odd byte counts: every byte lands where the slot
    layout says, nothing else is written, and loads bring the same bytes back."""
    rng = random.Random(f"{name}-{factor}-{backend}")
    num_blocks = 12 * factor + 2
    cache = LAYOUTS[name](num_blocks, torch.Generator().manual_seed(factor))
    worker = make_worker([cache], factor=factor, num_slots=10,
                         backend=cpu_backend(**BACKENDS[backend]))  # type: ignore[arg-type]
    worker.host_pool.arena.fill_(SENTINEL)
    n = 3 * factor - 1 if factor > 1 else 3  # three slots, the first one partly
    run_src = list(range(1, 1 + n))  # consecutive engine blocks
    scattered = rng.sample(range(1 + n, num_blocks), n)
    jobs = [store(0, run_src, [2, 3, 4], first_block_index=1),  # consecutive slots
            store(0, scattered, [8, 0, 6], first_block_index=1)]
    before = {b: cache.block(b).clone() for b in range(1, num_blocks)}
    report = run_all(worker, jobs)
    assert report.finished == tuple(j.job_id for j in jobs) and not report.failed
    for job in jobs:
        _check_slots(worker, cache, job.groups[0].pairs(factor))
    written = {2, 3, 4, 8, 0, 6}
    for slot in range(10):
        if slot not in written:
            assert bool((worker.host_pool.arena[slot] == SENTINEL).all()), slot
    # Load back: the scattered pages into the run of blocks, the run into scattered blocks.
    free = [b for b in range(1, num_blocks) if b not in run_src and b not in scattered]
    dst_scattered = rng.sample(free, n)
    loads = [load(0, run_src, [8, 0, 6], first_block_index=1),
             load(0, dst_scattered, [2, 3, 4], first_block_index=1)]
    report = run_all(worker, loads)
    assert report.finished == tuple(j.job_id for j in loads) and not report.failed
    expected = dict(before)
    expected.update(zip(run_src, (before[b] for b in scattered), strict=True))
    expected.update(zip(dst_scattered, (before[b] for b in run_src), strict=True))
    for b in range(1, num_blocks):
        assert torch.equal(cache.block(b), expected[b]), b
    worker.shutdown()


def _pieces(worker: TransferWorker, job: TransferJob) -> list[tuple[int, int, int]]:
    """The pieces the ``memmove`` path plans for ``job``."""
    backend = worker.backend
    assert isinstance(backend, CpuBackend)
    return backend._pieces(job)


def _native_pieces(worker: TransferWorker, job: TransferJob, *,
                   sort_bytes: int = 1 << 62) -> list[tuple[int, int, int]]:
    """The pieces the native queue builds for ``job`` (unsorted unless ``sort_bytes``
    says so), from the very job the backend pushes, by the C planner."""
    backend = worker.backend
    assert isinstance(backend, NativeCpuBackend)
    return backend.plan(job, sort_bytes=sort_bytes)


def test_contiguous_pages_become_one_copy_and_long_copies_are_cut() -> None:
    # One segment per block that fills the whole slot: consecutive engine blocks into
    # consecutive slots are one contiguous range on both sides.
    cache = kv_fused_block_major(20, torch.Generator().manual_seed(1), layers=1)
    worker = make_worker([cache], factor=2, num_slots=8,
                         backend=cpu_backend(copy_threads=1))
    page = worker.layout.groups[0].page_bytes
    arena = worker.host_pool.arena.data_ptr()
    engine = worker.layout.groups[0].segments[0].pages.data_ptr()
    slot_bytes = worker.host_pool.slot_bytes
    job = store(0, [3, 4, 5, 6], [1, 2])
    assert _pieces(worker, job) == [(arena + slot_bytes, engine + 3 * page, 4 * page)]
    # A break on the engine side (block 9 after 4) starts a new copy.
    job = store(0, [3, 4, 9, 10], [1, 2])
    assert _pieces(worker, job) == [(arena + slot_bytes, engine + 3 * page, 2 * page),
                                    (arena + 2 * slot_bytes, engine + 9 * page, 2 * page)]
    # Loads copy the other way.
    job = load(0, [3, 4], [5])
    assert _pieces(worker, job) == [(engine + 3 * page, arena + 5 * slot_bytes, 2 * page)]
    worker.shutdown()
    chunked = make_worker([cache], factor=2, num_slots=8,
                          backend=cpu_backend(copy_threads=1, chunk_bytes=page + 7))
    arena = chunked.host_pool.arena.data_ptr()
    pieces = _pieces(chunked, store(0, [3, 4, 5, 6], [1, 2]))
    assert [n for _, _, n in pieces] == [page + 7] * 3 + [4 * page - 3 * (page + 7)]
    assert [d for d, _, _ in pieces] == [arena + slot_bytes + k * (page + 7) for k in range(4)]
    chunked.shutdown()


def test_pages_are_not_merged_across_segments_padding_or_slots() -> None:
    # K and V segments: consecutive sub-blocks of one slot merge per segment, but slot 2's
    # K pages do not continue slot 1's (its V pages lie between).
    cache = kv_separate(20, torch.Generator().manual_seed(2), layers=1)
    worker = make_worker([cache], factor=2, num_slots=8, backend=cpu_backend(copy_threads=1))
    pieces = _pieces(worker, store(0, [3, 4, 5, 6], [1, 2]))
    assert len(pieces) == 4  # (K, V) x (slot 1, slot 2)
    assert sum(n for _, _, n in pieces) == 4 * worker.layout.groups[0].page_bytes
    worker.shutdown()
    # Padded engine rows (stride > page): every page is its own copy.
    padded = mamba_raw_padded(20, torch.Generator().manual_seed(3), layers=1)
    worker = make_worker([padded], factor=2, num_slots=8, backend=cpu_backend(copy_threads=1))
    assert len(_pieces(worker, store(0, [3, 4, 5, 6], [1, 2]))) == 4
    worker.shutdown()


def test_scattered_pages_longer_than_a_chunk_are_cut_page_by_page() -> None:
    # No two consecutive block ids: the one-piece-per-page path, still cut at chunk_bytes.
    cache = kv_fused_block_major(20, torch.Generator().manual_seed(7), layers=1)
    worker = make_worker([cache], factor=1, num_slots=8,
                         backend=cpu_backend(copy_threads=1, chunk_bytes=1000))
    page = worker.layout.groups[0].page_bytes
    arena = worker.host_pool.arena.data_ptr()
    engine = worker.layout.groups[0].segments[0].pages.data_ptr()
    slot_bytes = worker.host_pool.slot_bytes
    pieces = _pieces(worker, store(0, [9, 3], [1, 2]))
    expected = []
    for block, slot in ((9, 1), (3, 2)):
        for off in range(0, page, 1000):
            expected.append((arena + slot * slot_bytes + off, engine + block * page + off,
                             min(1000, page - off)))
    assert pieces == expected
    worker.shutdown()


def test_consecutive_blocks_into_scattered_slots_stay_separate_copies() -> None:
    # Consecutive engine blocks (a candidate run) whose slots do not continue each other.
    cache = kv_fused_block_major(20, torch.Generator().manual_seed(8), layers=1)
    worker = make_worker([cache], factor=1, num_slots=8, backend=cpu_backend(copy_threads=1))
    page = worker.layout.groups[0].page_bytes
    pieces = _pieces(worker, store(0, [3, 4, 5, 9], [6, 1, 2, 3]))
    assert [n for _, _, n in pieces] == [page, 2 * page, page]  # 3 | 4-5 | 9
    worker.shutdown()


class _RecordingBackend(MemmoveCpuBackend):
    """The ``memmove`` path, recording the pieces of every pass it copies."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.passes: list[list[tuple[int, int, int]]] = []

    def _copy(self, batch: list[cpu_memmove._MemmoveEntry]) -> None:
        self.passes.append([p for e in batch for p in e.pieces])
        super()._copy(batch)


@pytest.mark.parametrize("sorted_from", [0, 1 << 40])
def test_a_job_is_copied_in_source_address_order_if_its_pieces_are_large(
        sorted_from: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_memmove, "SORTED_PIECE_BYTES", sorted_from)
    cache = kv_separate(40, torch.Generator().manual_seed(9), layers=2)
    backend = _RecordingBackend(copy_threads=1)
    worker = make_worker([cache], factor=2, num_slots=20, backend=backend)
    rng = random.Random(9)
    ids = rng.sample(range(1, 40), 8)
    job = store(0, ids, rng.sample(range(20), 4))
    in_job_order = _pieces(worker, job)
    assert run_all(worker, [job]).finished == (job.job_id,)
    (pieces,) = backend.passes
    if sorted_from:  # small pieces: kept in job order
        assert pieces == in_job_order
    else:
        assert sorted(pieces) == sorted(in_job_order)
        assert [src for _, src, _ in pieces] == sorted(src for _, src, _ in pieces)
    worker.shutdown()


@needs_native
def test_the_native_queue_sorts_large_pieces_by_source_address_too() -> None:
    cache = kv_separate(40, torch.Generator().manual_seed(9), layers=2)
    rng = random.Random(9)
    job = store(0, rng.sample(range(1, 40), 8), rng.sample(range(20), 4))
    native = make_worker([cache], factor=2, num_slots=20, backend=cpu_backend(copy_threads=1))
    unsorted = _native_pieces(native, job)
    assert unsorted == _pieces(native, job)
    by_source = _native_pieces(native, job, sort_bytes=0)
    assert sorted(by_source) == sorted(unsorted)
    assert [src for _, src, _ in by_source] == sorted(src for _, src, _ in unsorted)
    native.shutdown()


class _FirstPassGate(MemmoveCpuBackend):
    """Holds the first pass of each direction until ``gate`` is set, so that the jobs
    submitted meanwhile queue up and are copied together in the next pass."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.passes: list[int] = []

    def _copy(self, batch: list[cpu_memmove._MemmoveEntry]) -> None:
        self.passes.append(len(batch))
        self.gate.wait()
        super()._copy(batch)


@pytest.mark.parametrize("factor", [1, 2, 4])
def test_jobs_copied_together_in_one_pass_round_trip(factor: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Many small jobs of one pass, sorted together: consecutive blocks of different jobs,
    partial slots, scattered slots, both directions, two copy threads."""
    monkeypatch.setattr(cpu_memmove, "SORTED_PIECE_BYTES", 0)  # sort even small pages
    rng = random.Random(factor)
    num_blocks = 40 * factor
    cache = kv_separate(num_blocks, torch.Generator().manual_seed(factor), layers=2)
    backend = _FirstPassGate(copy_threads=2, parallel_bytes=0, chunk_bytes=512)
    worker = make_worker([cache], factor=factor, num_slots=24, backend=backend)
    before = {b: cache.block(b).clone() for b in range(1, num_blocks)}
    slots = rng.sample(range(24), 12)
    src = list(range(1, 1 + 12 * factor))  # consecutive blocks, split over 6 jobs
    dst = rng.sample(range(1 + 12 * factor, num_blocks), 12 * factor)
    per_job = 2 * factor

    def jobs(make: Callable[..., TransferJob], blocks: list[int]) -> list[TransferJob]:
        return [make(0, blocks[k * per_job : (k + 1) * per_job], slots[2 * k : 2 * k + 2])
                for k in range(6)]

    stores = jobs(store, src)
    worker.execute(StepPlan(stores=tuple(stores)))
    backend.gate.set()
    worker.wait([j.job_id for j in stores])
    assert worker.poll().finished == tuple(j.job_id for j in stores)
    loads = jobs(load, dst)
    assert run_all(worker, loads).finished == tuple(j.job_id for j in loads)
    assert max(backend.passes) > 1  # some pass held several jobs
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(cache.block(b), before[a]), (a, b)
    for other in set(range(1, num_blocks)) - set(dst):
        assert torch.equal(cache.block(other), before[other])
    worker.shutdown()


def _submit_direct(worker: TransferWorker, job: TransferJob) -> tuple[list[int], list[int]]:
    """Submit straight to the backend (no worker validation) and collect the outcome."""
    backend = worker.backend
    backend.submit(job)
    backend.wait([job.job_id])
    finished, failed = backend.poll()
    return [int(j) for j in finished], [int(j) for j in failed]


@pytest.mark.parametrize("native", [None, False])
@pytest.mark.parametrize("transfer", [
    GroupTransfer(0, (1, 16), 0, (0, 1)),  # engine block past the end
    GroupTransfer(0, (1, -1), 0, (0, 1)),  # negative engine block
    GroupTransfer(0, (1, 2), 0, (0, 4)),  # slot past the end
    GroupTransfer(0, (1, 2, 3), 0, (0, 1)),  # too few slots
    GroupTransfer(5, (1, 2), 0, (0, 1)),  # a group never registered
])
def test_out_of_bounds_pages_fail_the_job_without_touching_memory(
        transfer: GroupTransfer, native: bool | None) -> None:
    cache = kv_separate(16, torch.Generator().manual_seed(4), layers=1)
    worker = make_worker([cache], num_slots=4,
                         backend=cpu_backend(copy_threads=1, native_copy=native))
    worker.host_pool.arena.fill_(SENTINEL)
    job = TransferJob(next_job_id(), Direction.STORE, "req", (transfer,))
    assert _submit_direct(worker, job) == ([], [int(job.job_id)])
    assert bool((worker.host_pool.arena == SENTINEL).all())
    ok = store(0, [1, 2], [0, 1])
    assert _submit_direct(worker, ok) == ([int(ok.job_id)], [])
    worker.shutdown()


@pytest.mark.parametrize("native", [None, False])
def test_a_cache_whose_storage_moved_after_registration_fails_jobs_safely(
        native: bool | None) -> None:
    cache = kv_separate(16, torch.Generator().manual_seed(5), layers=1)
    worker = make_worker([cache], num_slots=4,
                         backend=cpu_backend(copy_threads=1, native_copy=native))
    key = cache.layers[0][1][0]
    assert isinstance(key, torch.Tensor)
    storage = key.untyped_storage()
    storage.resize_(storage.nbytes() * 2)  # reallocates: the registered addresses are stale
    job = store(0, [1, 2], [0, 1])
    report = run_all(worker, [job])
    assert report.failed == (job.job_id,) and report.finished == ()
    worker.shutdown()


def test_copy_threads_share_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    names: list[str] = []

    def slow_memmove(dst: int, src: int, n: int) -> None:
        names.append(threading.current_thread().name)
        time.sleep(0.002)
        ctypes.memmove(dst, src, n)

    monkeypatch.setattr(cpu_memmove, "_memmove", slow_memmove)
    cache = kv_separate(40, torch.Generator().manual_seed(6), layers=2)
    worker = make_worker([cache], num_slots=20,
                         backend=cpu_backend(copy_threads=2, parallel_bytes=0, native_copy=False))
    src, dst = list(range(1, 17)), list(range(20, 36))
    expected = [cache.block(b).clone() for b in src]
    slots = random.Random(6).sample(range(20), 16)
    assert run_all(worker, [s := store(0, src, slots)]).finished == (s.job_id,)
    assert any(n.startswith("kvoffload-copy") for n in names)
    assert any(n.startswith("kvoffload-store") for n in names)
    assert run_all(worker, [ld := load(0, dst, slots)]).finished == (ld.job_id,)
    assert all(torch.equal(cache.block(b), e) for b, e in zip(dst, expected, strict=True))
    worker.shutdown()


def _buffers(n: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    src = torch.arange(n * 64, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    pieces = [(dst.data_ptr() + 64 * k, src.data_ptr() + 64 * k, 64) for k in range(n)]
    return src, dst, pieces


@pytest.mark.parametrize("helpers", [1, 2])
def test_a_pass_does_not_wait_for_a_helper_that_never_started(helpers: int) -> None:
    src, dst, pieces = _buffers(50)
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(gate.wait)  # the only helper thread is busy elsewhere
        cpu_memmove._SharedPass(pieces).run(pool, helpers=helpers)
        assert torch.equal(src, dst)
        gate.set()


def test_helpers_share_the_pieces_of_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst, pieces = _buffers(60)
    threads: set[str] = set()

    def memmove(dst_: int, src_: int, n: int) -> None:
        threads.add(threading.current_thread().name)
        time.sleep(0.002)
        ctypes.memmove(dst_, src_, n)

    monkeypatch.setattr(cpu_memmove, "_memmove", memmove)
    with ThreadPoolExecutor(2, thread_name_prefix="helper") as pool:
        cpu_memmove._SharedPass(pieces).run(pool, helpers=2)
    assert torch.equal(src, dst)
    assert len(threads) >= 2


def test_an_error_in_a_helper_fails_the_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst, pieces = _buffers(50)  # (kept alive: the pieces point into them)
    main = threading.current_thread()

    def memmove(dst: int, src: int, n: int) -> None:
        time.sleep(0.001)
        if threading.current_thread() is not main:
            raise OSError("helper failed")
        ctypes.memmove(dst, src, n)

    monkeypatch.setattr(cpu_memmove, "_memmove", memmove)
    with ThreadPoolExecutor(1) as pool, pytest.raises(OSError, match="helper failed"):
        cpu_memmove._SharedPass(pieces).run(pool, helpers=1)
    del src, dst  # alive until every thread stopped


BAD_PARTS = {
    "block out of range": GroupTransfer(1, (999,), 0, (1,)),
    "slot out of range": GroupTransfer(1, (4,), 0, (10**6,)),
    "unregistered group": GroupTransfer(7, (4,), 0, (1,)),
    "slot count": GroupTransfer(1, (4,), 0, (1, 2)),
    "negative block": GroupTransfer(1, (-1,), 0, (1,)),
}


@pytest.mark.parametrize("backend", ["one-thread", "memmove-one-thread"])
@pytest.mark.parametrize("bad", sorted(BAD_PARTS))
@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_a_job_with_one_bad_part_is_refused_whole(direction: Direction, bad: str,
                                                  backend: str) -> None:
    """A job with a valid part for group 0 and a bad part for group 1, submitted straight
    to the backend (the worker would reject it up front): reported failed at once, even
    while its direction is held, and nothing of it is copied, not even its valid part;
    its slots and blocks are reusable by the next job at once."""
    a = kv_separate(16, torch.Generator().manual_seed(6), layers=1)
    b = kv_separate(16, torch.Generator().manual_seed(7), layers=1)
    worker = make_worker([a, b], num_slots=4,
                         backend=cpu_backend(**BACKENDS[backend]))  # type: ignore[arg-type]
    cpu = worker.backend
    assert isinstance(cpu, CpuBackend)
    pool = worker.host_pool
    if direction is Direction.LOAD:  # slot 0 holds engine block 5's bytes
        assert run_all(worker, [store(0, [5], [0])]).finished
    pool.arena[1:].fill_(SENTINEL)
    arena, engine = pool.arena.clone(), a.block(3).clone()
    cpu.hold(direction)
    job = TransferJob(next_job_id(), direction, "r",
                      (GroupTransfer(0, (3,), 0, (0,) if direction is Direction.LOAD
                                     else (1,)), BAD_PARTS[bad]))
    cpu.submit(job)
    assert cpu.poll() == ([], [job.job_id])  # failed at once: nothing of it is queued
    cpu.hold(direction, False)
    cpu.wait([job.job_id])
    time.sleep(0.02)
    assert torch.equal(a.block(3), engine) and torch.equal(pool.arena, arena)
    retry = store(0, [3], [1]) if direction is Direction.STORE else load(0, [3], [0])
    assert run_all(worker, [retry]).finished == (retry.job_id,)
    if direction is Direction.STORE:
        assert torch.equal(pool.slot_view(1, 0), a.block(3))
    else:
        assert torch.equal(a.block(3), a.block(5))
    worker.shutdown()


def test_bad_arguments() -> None:
    for make in (cpu_backend, MemmoveCpuBackend, NativeCpuBackend):
        with pytest.raises(ValueError, match="copy_threads"):
            make(copy_threads=0)
        with pytest.raises(ValueError, match="chunk_bytes"):
            make(chunk_bytes=0)


def _reference_pieces(worker: TransferWorker, job: TransferJob,
                      chunk: int) -> list[tuple[int, int, int]]:
    """The copies of ``job`` worked out page by page from the slot layout: one piece per
    segment per page, merged while both sides continue, then cut at ``chunk`` bytes."""
    layout, pool = worker.layout, worker.host_pool
    arena = pool.arena.data_ptr()
    out: list[tuple[int, int, int]] = []
    for transfer in job.groups:
        glayout = layout.groups[transfer.group]
        for index, seg in enumerate(glayout.segments):
            runs: list[list[int]] = []  # [dst, src, bytes]
            for block_id, slot, sub in transfer.pairs(layout.factor):
                engine = seg.pages.data_ptr() + block_id * seg.row_stride
                host = arena + slot * pool.slot_bytes + glayout.host_offset(index, sub)
                dst, src = (host, engine) if job.direction is Direction.STORE \
                    else (engine, host)
                if runs and runs[-1][0] + runs[-1][2] == dst and \
                        runs[-1][1] + runs[-1][2] == src:
                    runs[-1][2] += seg.page_bytes
                else:
                    runs.append([dst, src, seg.page_bytes])
            for dst, src, n in runs:
                out.extend((dst + off, src + off, min(chunk, n - off))
                           for off in range(0, n, chunk))
    return out


@needs_native  # compares the native planner with Python's
@settings(max_examples=60, deadline=None)
@given(data=st.data(), factor=st.integers(1, 4), layout=st.sampled_from(sorted(LAYOUTS)),
       direction=st.sampled_from([Direction.STORE, Direction.LOAD]),
       chunk=st.sampled_from([100, 1000, 1 << 18]))
def test_planned_pieces_match_the_page_by_page_reference(
        data: st.DataObject, factor: int, layout: str, direction: Direction,
        chunk: int) -> None:
    """Runs of consecutive blocks (merged or not), scattered blocks, partial first and
    last slots, consecutive and scattered slots, padded rows, K/V planes, Mamba states,
    pages longer than a chunk: both planners' pieces (Python's for the ``memmove`` path,
    C's for the native queue) are exactly the reference's."""
    num_blocks, num_slots = 30, 8
    cache = LAYOUTS[layout](num_blocks, torch.Generator().manual_seed(factor))
    worker = make_worker([cache], factor=factor, num_slots=num_slots,
                         backend=cpu_backend(copy_threads=1, chunk_bytes=chunk))
    try:
        skip = data.draw(st.integers(0, factor - 1), "skip")
        n = data.draw(st.integers(1, 3 * factor - skip), "blocks")
        need = -(-(skip + n) // factor)
        if data.draw(st.booleans(), "consecutive blocks"):
            start = data.draw(st.integers(1, num_blocks - n), "first block")
            ids = list(range(start, start + n))
        else:
            ids = data.draw(st.permutations(range(1, num_blocks)), "ids")[:n]
        if data.draw(st.booleans(), "consecutive slots"):
            first = data.draw(st.integers(0, num_slots - need), "first slot")
            slots = list(range(first, first + need))
        else:
            slots = data.draw(st.permutations(range(num_slots)), "slots")[:need]
        first_index = skip + factor * data.draw(st.integers(0, 3), "offloaded block")
        make = store if direction is Direction.STORE else load
        job = make(0, ids, slots, first_block_index=first_index)
        reference = _reference_pieces(worker, job, chunk)
        assert _pieces(worker, job) == reference
        assert _native_pieces(worker, job) == reference
    finally:
        worker.shutdown()
