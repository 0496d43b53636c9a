"""The CUDA backend on a real device: bytes, ordering against the compute stream, flush,
in-order completion, failures. Skipped where CUDA is not available."""

from __future__ import annotations

import time

import pytest
import torch

from kvoffload.jobs import Direction, GroupTransfer, JobId, StepPlan, TransferJob, merge_reports
from kvoffload.worker import CudaBackend, FailJobs
from worker.worker_kit import (
    LAYOUTS,
    kv_fused_kv_first,
    kv_separate,
    load,
    make_worker,
    mamba_states,
    next_job_id,
    run_all,
    store,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"


@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cuda_round_trip(name: str, factor: int) -> None:
    cache = LAYOUTS[name](40, torch.Generator().manual_seed(factor), device=DEV)
    worker = make_worker([cache], factor=factor, num_slots=10)
    assert isinstance(worker.backend, CudaBackend)
    assert worker.host_pool.pinned and worker.host_pool.arena.is_pinned()
    before = {b: cache.block(b).clone() for b in range(1, 40)}
    # Three slots from logical index 1: the first one partly (factor 1 has no partial slot).
    n = 3 * factor - 1 if factor > 1 else 3
    src, dst = list(range(1, 1 + n)), list(range(39, 39 - n, -1))
    s = store(0, src, [4, 5, 1], first_block_index=1)
    assert run_all(worker, [s]).finished == (s.job_id,)
    ld = load(0, dst, [4, 5, 1], first_block_index=1)
    report = run_all(worker, [ld])
    assert report.finished == (ld.job_id,)
    assert report.stats.load_seconds > 0
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(cache.block(b), before[a])
    for other in set(range(1, 40)) - set(dst):
        assert torch.equal(cache.block(other), before[other])
    worker.shutdown()


def test_store_waits_for_the_compute_stream() -> None:
    """A kernel still writing a block when the store is submitted must finish first."""
    cache = kv_separate(8, torch.Generator().manual_seed(0), layers=1, block_size=64, heads=8,
                        head_dim=128, dtype=torch.float32, device=DEV)
    worker = make_worker([cache], num_slots=4)
    k = cache.layers[0][1][0]
    x = torch.randn(4096, 4096, device=DEV)
    torch.cuda.synchronize()
    for _ in range(8):  # tens of ms of queued work on the current stream
        x = torch.tanh(x @ x)
    k[2].copy_(x.flatten()[: k[2].numel()].view_as(k[2]))
    s = store(0, [2], [3])
    worker.execute(StepPlan(stores=(s,)))
    worker.wait([s.job_id])
    torch.cuda.synchronize()
    assert worker.poll().finished == (s.job_id,)
    assert torch.equal(worker.host_pool.slot_view(3, 0), cache.block(2))
    worker.shutdown()


def test_flush_in_order_and_failure_on_cuda() -> None:
    cache = kv_fused_kv_first(64, torch.Generator().manual_seed(1), device=DEV)
    jobs = [store(0, [1 + 2 * i, 2 + 2 * i], [2 * i, 2 * i + 1]) for i in range(8)]
    hook = FailJobs([jobs[3].job_id])
    worker = make_worker([cache], factor=1, num_slots=20, backend=CudaBackend(fault_hook=hook))
    worker.execute(StepPlan(flush=(jobs[0].job_id,), stores=tuple(jobs)))
    assert torch.equal(worker.host_pool.slot_view(0, 0), cache.block(1))  # flushed
    seen: list[JobId] = []
    failed: list[JobId] = []
    deadline = time.monotonic() + 30
    while len(seen) + len(failed) < len(jobs) and time.monotonic() < deadline:
        report = worker.poll()
        seen.extend(report.finished)
        failed.extend(report.failed)
    assert failed == [jobs[3].job_id]
    assert seen == [j.job_id for j in jobs if j is not jobs[3]]
    retry = store(0, [7, 8], [6, 7])
    assert run_all(worker, [retry]).finished == (retry.job_id,)
    ld = load(0, [40, 41], [6, 7])
    assert run_all(worker, [ld]).finished == (ld.job_id,)
    assert torch.equal(cache.block(40), cache.block(7))
    worker.shutdown()


def test_two_ranks_on_one_device() -> None:
    shards = [[kv_separate(16, torch.Generator().manual_seed(10 + r), device=DEV),
               mamba_states(16, torch.Generator().manual_seed(20 + r), device=DEV)]
              for r in range(2)]
    workers = [make_worker(shards[r], factor=2, num_slots=8, rank=r, num_workers=2)
               for r in range(2)]
    job = TransferJob(next_job_id(), Direction.STORE, "r", (
        GroupTransfer(0, (1, 2, 3, 4), 0, (0, 1)), GroupTransfer(1, (5, 6), 0, (2,))))
    back = TransferJob(next_job_id(), Direction.LOAD, "r", (
        GroupTransfer(0, (9, 10, 11, 12), 0, (0, 1)), GroupTransfer(1, (13, 14), 0, (2,))))
    befores = [[{b: c.block(b).clone() for b in range(1, 16)} for c in s] for s in shards]
    assert merge_reports([run_all(w, [job]) for w in workers]) == ({job.job_id: 2}, set())
    assert merge_reports([run_all(w, [back]) for w in workers]) == ({back.job_id: 2}, set())
    for r in range(2):
        for a, b in zip((1, 2, 3, 4), (9, 10, 11, 12), strict=True):
            assert torch.equal(shards[r][0].block(b), befores[r][0][a])
        for a, b in zip((5, 6), (13, 14), strict=True):
            assert torch.equal(shards[r][1].block(b), befores[r][1][a])
    for w in workers:
        w.shutdown()


def test_the_host_arena_is_pinned_in_place_at_its_exact_size() -> None:
    """Not through torch's caching host allocator, which would round 33 MiB + 33 bytes up
    to 64 MiB: the arena is registered in place and copies to it run asynchronously."""
    from kvoffload.worker.host_pool import allocate_arena

    torch.cuda.init()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    arena, pinned = allocate_arena((33, (1 << 20) + 1), True, torch.device(DEV))
    assert pinned and arena.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    src = torch.randint(0, 256, arena.shape, dtype=torch.uint8, device=DEV)
    arena.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(arena, src.cpu())
