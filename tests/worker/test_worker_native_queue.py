"""The CPU backend's native copy queue (``_copy.c``): the C queue itself, then the backend
running on it (the default wherever the install built it).

CI sets ``KVOFFLOAD_REQUIRE_NATIVE_COPY=1``, so a build that silently lost the library
fails there instead of quietly testing only the ``memmove`` path.
"""

from __future__ import annotations

import gc
import os
import random
import time
from array import array

import pytest
import torch
from worker_kit import (
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
from kvoffload.worker import CpuBackend, NativeCpuBackend, cpu_backend
from kvoffload.worker.native_copy import (
    DISABLE_ENV,
    STORE_FLAG,
    BadJobError,
    NativeCopy,
    encode_job,
    load_native_copy,
    pack,
)

NATIVE = load_native_copy()


def test_the_native_queue_is_built_where_required() -> None:
    if os.environ.get("KVOFFLOAD_REQUIRE_NATIVE_COPY") != "1":
        pytest.skip("set KVOFFLOAD_REQUIRE_NATIVE_COPY=1 to require the native queue")
    assert NATIVE is not None, "kvoffload.worker._copy was not built: is a C compiler there?"
    assert cpu_backend().native_copy


def test_native_copy_true_without_the_library_says_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert not cpu_backend().native_copy
    with pytest.raises(RuntimeError, match="reinstall kvoffload where a C compiler"):
        cpu_backend(native_copy=True)
    with pytest.raises(RuntimeError, match="reinstall kvoffload where a C compiler"):
        NativeCpuBackend()


def _native() -> NativeCopy:
    assert NATIVE is not None
    return NATIVE


@needs_native
@pytest.mark.parametrize("threads", [1, 3])
def test_random_jobs_of_odd_sizes_and_alignments_copy_exactly_and_complete_in_order(
        threads: int) -> None:
    """Pieces from 1 byte to 70 KB at every alignment (the streaming-store path and its
    unaligned head and tail), jobs of 0 to 40 pieces, one to three threads."""
    rng = random.Random(threads)
    size = 4 << 20
    src = torch.randint(0, 256, (size,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(threads))
    dst = torch.zeros(size, dtype=torch.uint8)
    expected = dst.clone()
    queue = _native().queue(threads, 1 << 14)
    jobs, packs = [], []
    cursor = 0  # destinations never overlap (jobs in flight write disjoint memory)
    for _ in range(60):
        pieces = []
        for _ in range(rng.randint(0, 40)):
            n = rng.choice([1, 15, 63, 4095, 4096, 4097, 65536 + 13, rng.randint(1, 70000)])
            if cursor + n + 16 > size:
                break
            at = cursor + rng.randint(0, 15)
            frm = rng.randint(0, size - n)
            pieces.append((dst.data_ptr() + at, src.data_ptr() + frm, n))
            expected[at : at + n] = src[frm : frm + n]
            cursor = at + n
        packs.append(pack(pieces))
        jobs.append(queue.push(packs[-1]))
    assert [j.seq for j in jobs] == list(range(1, 61))
    queue.wait(jobs[-1].seq)
    assert queue.completed() == jobs[-1].seq
    assert torch.equal(dst, expected)
    assert all(j.seconds >= 0 for j in jobs) and sum(j.seconds for j in jobs) > 0
    queue.close()
    queue.close()  # idempotent


@needs_native
def test_a_held_queue_keeps_jobs_in_flight_and_completes_them_in_push_order() -> None:
    src = torch.arange(1 << 20, dtype=torch.int64).view(torch.uint8)
    dst = torch.zeros_like(src)
    queue = _native().queue(2, 1 << 16)
    queue.hold(True)
    half = src.numel() // 2
    queue.push(pack([(dst.data_ptr(), src.data_ptr(), half)]))
    empty = queue.push(pack([]))  # completes only after the job before it
    time.sleep(0.05)
    assert queue.completed() == 0 and not bool(dst.any())
    queue.hold(False)
    queue.wait(empty.seq)
    assert queue.completed() == empty.seq
    assert torch.equal(dst[:half], src[:half]) and not bool(dst[half:].any())
    # Closing a held queue still copies what was queued.
    queue.hold(True)
    last = pack([(dst.data_ptr() + half, src.data_ptr() + half, half)])
    final = queue.push(last)
    queue.close()
    assert torch.equal(dst, src)
    assert queue.completed() == final.seq  # all of it, and no call into a freed queue
    queue.wait(final.seq)
    with pytest.raises(RuntimeError, match="closed"):
        queue.push(pack([]))


@needs_native
def test_waiting_for_a_job_never_pushed_returns() -> None:
    queue = _native().queue(1, 1 << 16)
    start = time.monotonic()
    queue.wait(10**6)
    assert time.monotonic() - start < 1
    queue.close()


# -- the backend on the native queue ------------------------------------------------------


@needs_native
def test_stores_and_loads_in_flight_together_round_trip_on_padded_mamba_pages() -> None:
    cache = mamba_raw_padded(40, torch.Generator().manual_seed(2), layers=2)
    worker = make_worker([cache], factor=2, num_slots=12,
                         backend=cpu_backend(copy_threads=3, parallel_bytes=1 << 10))
    first = store(0, list(range(1, 9)), [0, 1, 2, 3])
    assert run_all(worker, [first]).finished == (first.job_id,)
    want = [cache.block(b).clone() for b in range(1, 9)]
    second = store(0, list(range(9, 17)), [4, 5, 6, 7], first_block_index=0)
    back = load(0, list(range(20, 28)), [0, 1, 2, 3])
    worker.execute(StepPlan(stores=(second,), loads=(back,)))
    worker.wait([second.job_id, back.job_id])
    report = worker.poll()
    assert set(report.finished) == {second.job_id, back.job_id} and not report.failed
    for b, expected in zip(range(20, 28), want, strict=True):
        assert torch.equal(cache.block(b), expected), b
    worker.shutdown()


@needs_native
def test_jobs_copied_at_shutdown_are_reported_by_the_next_poll() -> None:
    cache = kv_separate(16, torch.Generator().manual_seed(8), layers=1)
    worker = make_worker([cache])
    backend = worker.backend
    assert isinstance(backend, CpuBackend)
    backend.hold(Direction.STORE)
    s = store(0, [3, 4], [0, 1])
    worker.execute(StepPlan(stores=(s,)))
    worker.shutdown()  # copies what is queued
    assert torch.equal(worker.host_pool.slot_view(1, 0), cache.block(4))
    worker.wait([s.job_id])  # returns: the queue is closed and everything was copied
    assert worker.poll().finished == (s.job_id,)


@needs_native
def test_a_backend_dropped_with_jobs_queued_copies_them_before_its_memory_goes() -> None:
    cache = kv_separate(16, torch.Generator().manual_seed(9), layers=1)
    worker = make_worker([cache])
    backend = worker.backend
    assert isinstance(backend, CpuBackend)
    pool = worker.host_pool  # kept to look at afterwards
    backend.hold(Direction.STORE)
    s = store(0, [5, 6], [2, 3])
    worker.execute(StepPlan(stores=(s,)))
    want = cache.block(6).clone()
    del worker, backend
    gc.collect()  # the finalizer closes the queue: the held store is copied first
    assert torch.equal(pool.slot_view(3, 0), want)


# -- the native planner's formats --------------------------------------------------------


@needs_native
def test_the_native_planner_refuses_malformed_jobs_and_layouts() -> None:
    """A job whose lengths do not add up, or a layout table that is not one, is refused at
    the library's boundary (nothing planned), not read past its end."""
    cache = kv_separate(16, torch.Generator().manual_seed(4), layers=1)
    worker = make_worker([cache], factor=2, num_slots=4)
    backend = worker.backend
    assert isinstance(backend, NativeCpuBackend) and backend._native_layout is not None
    native, layout = _native(), backend._native_layout
    good = encode_job(STORE_FLAG, [(0, 1, (3, 4, 5), (1, 2))])
    pieces = native.plan_job(layout, good)
    assert pieces == backend._pieces(store(0, [3, 4, 5], [1, 2], first_block_index=1))
    assert good[1] == 3 * cache.page_bytes  # the bytes field, written by the planner
    broken = {
        "truncated": good[:-1],
        "one value too many": good + array("q", [0]),
        "more parts than given": encode_job(STORE_FLAG, [(0, 1, (3,), (1,))])[:4]
        + array("q", [2]) + encode_job(STORE_FLAG, [(0, 1, (3,), (1,))])[4:],
        "negative block count": encode_job(STORE_FLAG, [(0, 0, (), ())])[:6]
        + array("q", [-1, 0]),
        "header only": array("q", [0, 0, STORE_FLAG]),
    }
    for name, job in broken.items():
        with pytest.raises(BadJobError):
            native.plan_job(layout, job)
        queue = native.queue(1, 1 << 16)
        with pytest.raises(BadJobError):
            queue.push_job(layout, job)
        assert queue.completed() == 0, name  # nothing was queued
        queue.close()
    segment = (cache.layers[0][1][0].data_ptr(), 64, 64, 0)
    tables = {
        "too short": [1, 2, 3],
        "fewer values than groups say": [4, 64, 0, 0, 1, 0, 1, 16, 1],
        "factor 0": [4, 64, 0, 0, 1, 0, 0, 16, 1, *segment],
        "a group id twice": [4, 64, 0, 0, 2, 0, 1, 16, 1, *segment, 0, 1, 16, 1, *segment],
        "a value left over": [4, 64, 0, 0, 1, 0, 1, 16, 1, *segment, 9],
    }
    for table in tables.values():
        with pytest.raises(ValueError, match="malformed layout table"):
            native.layout(array("Q", table))
    worker.shutdown()


@needs_native
def test_a_job_over_two_groups_is_one_native_job_counting_both_groups_bytes() -> None:
    a = kv_separate(16, torch.Generator().manual_seed(10), layers=1)
    b = mamba_raw_padded(16, torch.Generator().manual_seed(11), layers=2)
    worker = make_worker([a, b], num_slots=6)
    job = TransferJob(next_job_id(), Direction.STORE, "r",
                      (GroupTransfer(0, (3, 4), 0, (0, 1)), GroupTransfer(1, (7,), 0, (2,))))
    report = run_all(worker, [job])
    assert report.finished == (job.job_id,)
    layout = worker.layout
    assert report.stats.stored_bytes == 2 * layout.groups[0].page_bytes + \
        layout.groups[1].page_bytes
    pool = worker.host_pool
    assert torch.equal(pool.slot_view(0, 0), a.block(3))
    assert torch.equal(pool.slot_view(1, 0), a.block(4))
    assert torch.equal(pool.slot_view(2, 1), b.block(7))
    worker.shutdown()
