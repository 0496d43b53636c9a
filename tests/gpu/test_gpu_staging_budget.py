"""The CUDA backend's staging budget on a real device: a job many budgets large moves the
right bytes and allocates no device memory beyond its index tensors; the store-reads
point completes before the job's end. Skipped where CUDA is not available."""

from __future__ import annotations

import pytest
import torch

from kvoffload.jobs import Direction, GroupTransfer, StepPlan, TransferJob
from kvoffload.worker import CudaBackend
from kvoffload.worker.cuda import staging_need
from worker.worker_kit import (
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


@pytest.mark.parametrize("factor", [1, 2])
def test_a_job_of_many_budgets_moves_the_right_bytes_within_the_budget(factor: int) -> None:
    cache = kv_separate(400, torch.Generator().manual_seed(factor), layers=4, block_size=16,
                        heads=4, head_dim=64, device=DEV)
    probe = make_worker([cache], factor=factor, num_slots=180)
    budget = staging_need(probe.layout.groups[0], 2)
    probe.shutdown()
    worker = make_worker([cache], factor=factor, num_slots=180, staging_bytes=budget)
    backend = worker.backend
    assert isinstance(backend, CudaBackend) and backend._copier is not None
    assert all(b.numel() <= budget for b in backend._copier.staging.values())
    before = {b: cache.block(b).clone() for b in range(1, 400)}
    n = 180 * factor - 1  # from logical index 1: a partial first slot
    src, dst = list(range(1, 1 + n)), list(range(399, 399 - n, -1))
    slots = list(range(180))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    s = store(0, src, slots, first_block_index=1)
    assert run_all(worker, [s]).finished == (s.job_id,)
    ld = load(0, dst, slots, first_block_index=1)
    assert run_all(worker, [ld]).finished == (ld.job_id,)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    index_bytes = 3 * 8 * n
    assert extra <= 2 * (index_bytes + 512), (extra, budget)  # the indices, nothing staged
    assert n * probe.layout.groups[0].page_bytes > 50 * budget
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(cache.block(b), before[a])
    worker.shutdown()


def test_a_hybrid_job_under_a_small_budget() -> None:
    gen = torch.Generator().manual_seed(9)
    caches = [kv_separate(64, gen, device=DEV), kv_fused_kv_first(64, gen, device=DEV),
              mamba_states(64, gen, device=DEV)]
    probe = make_worker(caches, factor=2, num_slots=40)
    budget = max(staging_need(g, 2) for g in probe.layout.groups.values())
    probe.shutdown()
    worker = make_worker(caches, factor=2, num_slots=40, staging_bytes=budget)
    before = [{b: c.block(b).clone() for b in range(1, 64)} for c in caches]
    groups = (GroupTransfer(0, tuple(range(1, 20)), 1, tuple(range(10))),
              GroupTransfer(1, tuple(range(20, 40)), 0, tuple(range(10, 20))),
              GroupTransfer(2, tuple(range(40, 60)), 0, tuple(range(20, 30))))
    s = TransferJob(next_job_id(), Direction.STORE, "r", groups)
    assert run_all(worker, [s]).finished == (s.job_id,)
    for c in caches:
        for t in c.layers:
            for x in (t[1] if isinstance(t[1], tuple) else (t[1],)):
                x.zero_()
    back = TransferJob(next_job_id(), Direction.LOAD, "r", groups)
    assert run_all(worker, [back]).finished == (back.job_id,)
    for g, transfer in enumerate(groups):
        for b in transfer.block_ids:
            assert torch.equal(caches[g].block(b), before[g][b])
    worker.shutdown()


def test_the_store_reads_point_completes_before_the_store_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = kv_separate(200, torch.Generator().manual_seed(2), layers=4, block_size=16,
                        heads=4, head_dim=64, device=DEV)
    probe = make_worker([cache], num_slots=100)
    budget = staging_need(probe.layout.groups[0], 4)
    probe.shutdown()
    worker = make_worker([cache], num_slots=100, staging_bytes=budget)
    backend = worker.backend
    assert isinstance(backend, CudaBackend)
    events: list[torch.Event] = []

    def reads_enqueued(entry: object, stream: torch.Stream) -> None:
        event = torch.Event(device=torch.device(DEV), enable_timing=True)
        event.record(stream)
        events.append(event)

    monkeypatch.setattr(backend, "_store_reads_enqueued", reads_enqueued)
    s = store(0, list(range(1, 101)), list(range(100)))
    assert run_all(worker, [s]).finished == (s.job_id,)
    assert len(events) == 1 and events[0].query()
    worker.shutdown()


@pytest.mark.parametrize("fenced", [True, False])
def test_a_fenced_store_has_read_its_blocks_before_the_engine_overwrites_them(
        fenced: bool) -> None:
    """vLLM's V2 runner zeroes blocks before the next flush (``worker_side``): once a store
    is fenced, the engine's next kernels on its stream run after the store's reads, so a
    block zeroed right away is stored as it was. Unfenced, the zeroing races the copy (the
    control: it may or may not win, so only the fenced case is asserted)."""
    cache = kv_separate(400, torch.Generator().manual_seed(3), layers=8, block_size=16,
                        heads=8, head_dim=128, device=DEV)
    worker = make_worker([cache], num_slots=300)
    before = {b: cache.block(b).clone() for b in range(1, 301)}
    s = store(0, list(range(1, 301)), list(range(300)))
    worker.execute(StepPlan(stores=(s,)))
    if fenced:
        worker.fence_engine_reads([s.job_id])
    for _, kv in cache.layers:  # what vLLM's zeroing does, on its own stream
        for tensor in kv if isinstance(kv, tuple) else (kv,):
            tensor[1:301].zero_()
    worker.wait([s.job_id])
    assert worker.poll().finished == (s.job_id,)
    if fenced:
        for i, b in enumerate(range(1, 301)):
            assert torch.equal(worker.host_pool.slot_view(i, 0), before[b]), b
    worker.shutdown()
