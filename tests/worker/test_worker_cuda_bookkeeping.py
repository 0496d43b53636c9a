"""The CUDA backend's job bookkeeping (events, order, failures), run on CPU tensors.

Streams and events are replaced by fakes whose events complete only when the test says
so, standing in for a device that has not yet run the enqueued copies. The copies
themselves run at once on CPU tensors through the real ``StagedCopier``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from worker_kit import CacheSet, kv_separate, load, make_config, store

from kvoffload.jobs import Direction, JobId, TransferJob
from kvoffload.worker import CacheLayout, CudaBackend, FailJobs, HostPool, StagedCopier


class FakeEvent:
    """An event that completes when its stream is drained (or it is synchronized)."""

    def __init__(self, device: object = None, enable_timing: bool = False) -> None:
        self.recorded = False
        self.complete = False

    def record(self, stream: FakeStream) -> None:
        self.recorded = True
        stream.pending.append(self)

    def query(self) -> bool:
        return self.complete or not self.recorded

    def synchronize(self) -> None:
        self.complete = True

    def elapsed_time(self, other: FakeEvent) -> float:
        return 2.0


class FakeStream:
    """A stream whose recorded events complete only on ``drain``."""

    def __init__(self) -> None:
        self.pending: list[FakeEvent] = []

    def wait_stream(self, other: FakeStream) -> None:
        pass

    def wait_event(self, event: FakeEvent) -> None:
        pass

    def synchronize(self) -> None:
        self.drain()

    def drain(self) -> None:
        for event in self.pending:
            event.complete = True
        self.pending.clear()

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(torch, "Event", FakeEvent)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: FakeStream())
    yield


def _bound(cache: CacheSet, backend: CudaBackend, slots: int = 8) -> HostPool:
    """Attach ``backend`` to CPU caches as ``bind`` would to CUDA ones, with fake streams."""
    config = make_config([cache], num_slots=slots)
    layout = CacheLayout.build(config, [cache.tensors(0)])
    pool = HostPool(layout, config.num_host_slots, pin=False)
    backend._device = layout.device
    backend._streams = {d: FakeStream() for d in Direction}  # type: ignore[misc]
    backend._copier = StagedCopier(layout, pool)
    return pool


def _drain(backend: CudaBackend, direction: Direction) -> None:
    stream = backend._streams[direction]
    assert isinstance(stream, FakeStream)
    stream.drain()


class CopyThenRaise(StagedCopier):
    """Enqueues a job's copies, then fails (as an allocation failing midway would)."""

    def __init__(self, inner: StagedCopier, broken: JobId) -> None:
        super().__init__(inner.layout, inner.pool)
        self.broken = broken

    def copy(self, job: TransferJob, *,
             after_engine_reads: Callable[[], None] | None = None) -> list[torch.Tensor]:
        keep = super().copy(job, after_engine_reads=after_engine_reads)
        if job.job_id == self.broken:
            raise RuntimeError("out of device memory")
        return keep


def test_jobs_report_when_their_end_event_completes_in_order(fake_device: None) -> None:
    cache = kv_separate(16, torch.Generator().manual_seed(1), layers=1)
    backend = CudaBackend()
    pool = _bound(cache, backend)
    jobs = [store(0, [1 + i], [i]) for i in range(3)]
    for job in jobs:
        backend.submit(job)
    assert backend.poll() == ([], [])  # nothing ran on the "device" yet
    _drain(backend, Direction.STORE)
    assert backend.poll() == ([j.job_id for j in jobs], [])
    assert backend.take_stats().stored_bytes == 3 * pool.layout.groups[0].page_bytes
    for i in range(3):
        assert torch.equal(pool.slot_view(i, 0), cache.block(1 + i))


def test_a_job_failing_midway_is_reported_only_after_its_enqueued_copies(
        fake_device: None) -> None:
    """A load that enqueued part of its copies before failing may still write engine
    blocks: it must not be reported failed (the engine would recompute into those blocks)
    before its end event completes, and ``wait`` must wait for it too."""
    cache = kv_separate(16, torch.Generator().manual_seed(2), layers=1)
    backend = CudaBackend()
    _bound(cache, backend)
    broken, ok = load(0, [2], [1]), load(0, [3], [2])
    assert backend._copier is not None
    backend._copier = CopyThenRaise(backend._copier, broken.job_id)
    backend.submit(broken)
    backend.submit(ok)
    entry = backend._in_flight[broken.job_id]
    assert entry.failed and entry.end is not None
    assert backend.poll() == ([], [])  # its copies have not run yet
    backend.wait([broken.job_id])  # waits for the failed job's enqueued copies too
    assert entry.end.query()
    assert backend.poll() == ([], [broken.job_id])
    _drain(backend, Direction.LOAD)
    assert backend.poll() == ([ok.job_id], [])
    assert not backend._in_flight


def test_a_job_failing_before_it_enqueues_anything_reports_at_once(fake_device: None) -> None:
    cache = kv_separate(16, torch.Generator().manual_seed(3), layers=1)
    first, second = store(0, [1], [0]), store(0, [2], [1])
    backend = CudaBackend(fault_hook=FailJobs([first.job_id]))
    _bound(cache, backend)
    backend.submit(first)
    backend.submit(second)
    assert backend.poll() == ([], [first.job_id])  # in order: the first job failed
    _drain(backend, Direction.STORE)
    assert backend.poll() == ([second.job_id], [])


def test_the_store_reads_point_is_reached_once_per_store_before_its_end(
        fake_device: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_store_reads_enqueued`` (where a later change records the event the compute
    stream waits on) runs inside the store's launch, on the store stream, before the job's
    end event; a load never reaches it."""
    cache = kv_separate(16, torch.Generator().manual_seed(4), layers=1)
    backend = CudaBackend()
    _bound(cache, backend)
    seen: list[tuple[JobId, bool, bool]] = []

    def reads_enqueued(entry: object, stream: object) -> None:
        assert entry is backend._in_flight[s.job_id]
        end = backend._in_flight[s.job_id].end
        seen.append((s.job_id, stream is backend._streams[Direction.STORE],
                     end is not None and not end.recorded))  # type: ignore[attr-defined]

    monkeypatch.setattr(backend, "_store_reads_enqueued", reads_enqueued)
    s = store(0, [1, 2, 3], [0, 1, 2])
    backend.submit(s)
    backend.submit(load(0, [4], [0]))
    assert seen == [(s.job_id, True, True)]
