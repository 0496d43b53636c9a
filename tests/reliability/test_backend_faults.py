"""Faults inside a rank's copy backend (``FaultyBackend`` around the real CPU backend),
seen through the real ``TransferWorker``: failed copies leave garbage and report failed,
stuck copies land when a flush waits for them, and a backend's duplicate report is caught
by the worker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvoffload.faults.backend import FaultyBackend
from kvoffload.faults.plan import FaultKind, FaultPlan
from kvoffload.jobs import JobId, StepPlan, TransferJob
from kvoffload.worker import TransferWorker, cpu_backend
from worker.worker_kit import CacheSet, kv_separate, load, make_worker, mamba_states, store


class Harness:
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.sets: list[CacheSet] = [kv_separate(12, gen), mamba_states(12, gen)]
        self.faults: dict[JobId, FaultKind] = {}
        self.backend = FaultyBackend(cpu_backend(copy_threads=1), FaultPlan(0.0),
                                     choose=lambda job: self.faults.get(job.job_id))
        self.worker: TransferWorker = make_worker(self.sets, num_slots=8, backend=self.backend,
                                                  pin_memory=False)

    def submit(self, *jobs: TransferJob, kind: FaultKind | None = None) -> None:
        for job in jobs:
            if kind is not None:
                self.faults[job.job_id] = kind
        self.worker.execute(StepPlan(stores=tuple(j for j in jobs if j.direction.value == "store"),
                                     loads=tuple(j for j in jobs if j.direction.value == "load")))

    def settle(self) -> tuple[set[JobId], set[JobId]]:
        """Wait for everything submitted and collect two polls' worth of reports."""
        self.worker.backend.inner.wait(list(range(10_000)))  # type: ignore[attr-defined]
        finished: set[JobId] = set()
        failed: set[JobId] = set()
        for _ in range(2):
            report = self.worker.poll()
            finished.update(report.finished)
            failed.update(report.failed)
        return finished, failed


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.worker.shutdown()


def test_a_failed_load_reports_failed_and_leaves_garbage_not_data(h: Harness) -> None:
    h.submit(store(0, [1], [0]))
    assert h.settle()[0]
    job = load(0, [5], [0])
    h.submit(job, kind=FaultKind.FAIL)
    finished, failed = h.settle()
    assert failed == {job.job_id} and not finished
    assert not torch.equal(h.sets[0].block(5), h.sets[0].block(1))
    assert bool((h.sets[0].block(5) == 0xA5).all())


def test_a_failed_store_reports_failed_and_garbles_its_slot(h: Harness) -> None:
    job = store(1, [2], [3])
    h.submit(job, kind=FaultKind.FAIL)
    assert h.settle() == (set(), {job.job_id})
    assert bool((h.worker.host_pool.slot_view(3, 1) == 0x5A).all())


def test_a_stuck_copy_lands_when_a_flush_waits_for_it(h: Harness) -> None:
    h.submit(store(0, [1], [0]))
    h.settle()
    job = load(0, [6], [0])
    h.submit(job, kind=FaultKind.HANG)
    assert h.settle() == (set(), set())  # stuck: not reported, not copied
    assert h.backend.hung == {job.job_id}
    assert not torch.equal(h.sets[0].block(6), h.sets[0].block(1))
    h.worker.begin_step(StepPlan(flush=(job.job_id,)))  # the engine reuses a block
    h.worker.end_step()
    assert torch.equal(h.sets[0].block(6), h.sets[0].block(1))  # landed before the step
    assert h.settle() == ({job.job_id}, set())


def test_a_duplicate_report_from_the_backend_is_dropped_and_counted(h: Harness) -> None:
    job = store(0, [1], [0])
    h.submit(job, kind=FaultKind.DUPLICATE)
    finished, _ = h.settle()
    assert finished == {job.job_id}
    assert h.worker.poll().finished == ()
    assert h.worker.backend_errors == 1


def test_a_reordered_report_arrives_after_a_later_job(h: Harness) -> None:
    first, second = store(0, [1], [0]), store(0, [2], [1])
    h.submit(first, kind=FaultKind.REORDER)
    h.submit(second)
    h.worker.backend.inner.wait([first.job_id, second.job_id])  # type: ignore[attr-defined]
    assert h.worker.poll().finished == (second.job_id,)
    assert h.worker.poll().finished == (first.job_id,)
