"""CUDA transfer backend: engine caches in GPU memory, host arena in pinned memory.

One CUDA stream per direction. For every job, on its direction's stream:

1. the stream waits on the engine's current (compute) stream, so a store never reads KV
   that a kernel is still writing (vLLM issue #31341) and a load never overwrites a block
   a kernel still reads;
2. it waits on the previous job's end event of the same direction, so jobs of one
   direction run, and complete, strictly in submission order;
3. a start event is recorded, the copies are enqueued, an end event is recorded.

``poll`` pops jobs from the front of each direction's queue while their end event has
completed (``Event.query``), so it never blocks; ``wait`` synchronizes on end events. A job
whose copies fail to enqueue midway still records its end event, and is reported failed
(and waited for) only once what it did enqueue has run: the engine may reuse its blocks as
soon as it learns of the failure, and a copy still queued must not write into them then.

How bytes move (``StagedCopier``). Engine pages of one job are scattered over the cache,
host pages are scattered over slots; per-page DMA would cost one ``cudaMemcpyAsync`` per
page per layer. Instead a store gathers the job's pages on the device, with one
``index_select``/``index_put_`` pair per segment, into a device staging buffer laid out
exactly like the destination slots (the slot layout of ``kvoffload.worker.layout``), then
copies each slot image to the pinned arena with one non-blocking copy (consecutive slots
merged into one). A load does the reverse: slot images to the device, then a scatter into
the engine blocks. Partial slots (a load starting mid-block, a store whose first blocks are
null) copy only the sub-block ranges they hold, so unrelated bytes of a slot are never
touched. ``StagedCopier`` is device-agnostic; the CPU tests exercise it on CPU tensors.

The module imports without CUDA; ``CudaBackend.bind`` requires it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvoffload.errors import LayoutError
from kvoffload.jobs import Direction, JobId, TransferJob, TransferStats
from kvoffload.worker.backend import (
    FaultHook,
    GroupCopy,
    InjectedFaultError,
    StatsAccumulator,
    TransferBackend,
    job_bytes,
    plan_job,
)
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import CacheLayout, GroupLayout, as_elements, widest_dtype

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _SlotPart:
    """One slot touched by a group transfer: its position in the staging buffer and the
    sub-blocks ``[first, end)`` the transfer holds."""

    slot: int
    position: int
    first: int
    end: int


class StagedCopier:
    """Enqueues a job's copies on the current stream through a device staging buffer.

    ``copy(job)`` returns the temporaries (staging buffers, index tensors) that must stay
    alive until the enqueued work completes.
    """

    def __init__(self, layout: CacheLayout, pool: HostPool) -> None:
        self.layout = layout
        self.pool = pool
        self.device = layout.device
        self._pin_index = self.device.type == "cuda"
        # Per group: (engine rows in a wide dtype, that dtype) for each segment.
        self._engine: dict[int, list[tuple[torch.Tensor, torch.dtype]]] = {}
        for group, glayout in layout.groups.items():
            rows = []
            for seg in glayout.segments:
                dtype = widest_dtype(seg.page_bytes, seg.row_stride, seg.pages.data_ptr(),
                                     seg.host_offset, glayout.block_bytes)
                rows.append((as_elements(seg.pages, dtype), dtype))  # (num_blocks, elems)
            self._engine[group] = rows

    def copy(self, job: TransferJob) -> list[torch.Tensor]:
        keep: list[torch.Tensor] = []
        for group_copy in plan_job(job, self.layout):
            keep.extend(self._copy_group(group_copy, job.direction))
        return keep

    def _copy_group(self, copy: GroupCopy, direction: Direction) -> list[torch.Tensor]:
        glayout = copy.layout
        parts = _slot_parts(copy)
        position = {p.slot: p.position for p in parts}
        # (3, pages) int64: engine block id, staging position, sub-block of every page.
        host_index = torch.tensor(
            [[b for b, _, _ in copy.pairs], [position[s] for _, s, _ in copy.pairs],
             [j for _, _, j in copy.pairs]],
            dtype=torch.int64, pin_memory=self._pin_index)
        index = host_index.to(self.device, non_blocking=True)
        block_ids, positions, subs = index[0], index[1], index[2]  # (pages,) each
        # (slots touched, block_bytes) uint8: slot images in transfer order.
        stage = torch.empty((len(parts), glayout.block_bytes), dtype=torch.uint8,
                            device=self.device)
        if direction is Direction.STORE:
            for seg_index, (engine, dtype) in enumerate(self._engine[glayout.group]):
                staged = _stage_segment(stage, glayout, seg_index, dtype)
                # (pages, elems) gathered on the device, then placed in the slot images.
                staged.index_put_((positions, subs), engine.index_select(0, block_ids))
            self._host_copies(copy, parts, stage, to_host=True)
        else:
            self._host_copies(copy, parts, stage, to_host=False)
            for seg_index, (engine, dtype) in enumerate(self._engine[glayout.group]):
                staged = _stage_segment(stage, glayout, seg_index, dtype)
                engine.index_put_((block_ids,), staged[positions, subs])  # (pages, elems)
        return [host_index, index, stage]

    def _host_copies(self, copy: GroupCopy, parts: list[_SlotPart], stage: torch.Tensor,
                     *, to_host: bool) -> None:
        """Copy slot images between ``stage`` and the arena (non-blocking)."""
        glayout = copy.layout
        arena = self.pool.arena  # (num_slots, slot_bytes) uint8
        block_bytes = glayout.block_bytes
        whole_rows = block_bytes == self.pool.slot_bytes
        i = 0
        while i < len(parts):
            part = parts[i]
            if part.first == 0 and part.end == glayout.factor:
                # Merge a run of full slots with consecutive ids into one copy.
                j = i + 1
                while (whole_rows and j < len(parts) and parts[j].first == 0
                       and parts[j].end == glayout.factor
                       and parts[j].slot == part.slot + (j - i)):
                    j += 1
                host = arena[part.slot : part.slot + (j - i), :block_bytes]  # (n, block_bytes)
                dev = stage[part.position : part.position + (j - i)]  # (n, block_bytes)
                _copy(host, dev, to_host)
                i = j
                continue
            for seg in glayout.segments:
                start = seg.host_offset + part.first * seg.page_bytes
                end = seg.host_offset + part.end * seg.page_bytes
                _copy(arena[part.slot, start:end], stage[part.position, start:end], to_host)
            i += 1


def _copy(host: torch.Tensor, dev: torch.Tensor, to_host: bool) -> None:
    if to_host:
        host.copy_(dev, non_blocking=True)
    else:
        dev.copy_(host, non_blocking=True)


def _stage_segment(stage: torch.Tensor, glayout: GroupLayout, segment: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """``(slots, factor, elems)`` view of one segment's pages inside the slot images."""
    seg = glayout.segments[segment]
    span = stage[:, seg.host_offset : seg.host_offset + seg.page_bytes * glayout.factor]
    slots = int(stage.shape[0])
    return as_elements(span.view(slots, glayout.factor, seg.page_bytes), dtype)


def _slot_parts(copy: GroupCopy) -> list[_SlotPart]:
    """The slots a group transfer touches, in order, with their sub-block ranges.

    Consecutive pages naming the same slot form one part (a slot's sub-blocks are
    consecutive positions of the transfer); one ``_SlotPart`` is built per part.
    """
    parts: list[_SlotPart] = []
    slot: int | None = None
    first = end = 0
    for _, page_slot, sub in copy.pairs:
        if page_slot == slot:
            end = sub + 1
            continue
        if slot is not None:
            parts.append(_SlotPart(slot, len(parts), first, end))
        slot, first, end = page_slot, sub, sub + 1
    if slot is not None:
        parts.append(_SlotPart(slot, len(parts), first, end))
    return parts


@dataclass
class _Entry:
    job: TransferJob
    nbytes: int
    start: torch.Event | None = None
    end: torch.Event | None = None
    keep: list[torch.Tensor] = field(default_factory=list)
    failed: bool = False


class CudaBackend(TransferBackend):
    """Asynchronous copies between GPU caches and a pinned host arena (module docstring)."""

    def __init__(self, *, fault_hook: FaultHook | None = None) -> None:
        """Args:
            fault_hook: test hook; a job it selects fails at submit and is reported failed.
        """
        self.fault_hook = fault_hook
        self._copier: StagedCopier | None = None
        self._device: torch.device | None = None
        self._streams: dict[Direction, torch.Stream] = {}
        self._last_end: dict[Direction, torch.Event | None] = {d: None for d in Direction}
        self._lock = threading.Lock()
        self._fifo: dict[Direction, deque[_Entry]] = {d: deque() for d in Direction}
        self._in_flight: dict[JobId, _Entry] = {}
        self._stats = StatsAccumulator()
        self._closed = False

    def bind(self, layout: CacheLayout, pool: HostPool) -> None:
        if self._copier is not None:
            raise RuntimeError("CudaBackend is already bound")
        if layout.device.type != "cuda":
            raise LayoutError(f"the CUDA backend copies CUDA tensors; the caches are on "
                              f"{layout.device}. Use the CPU backend.")
        if not pool.pinned:
            raise LayoutError("the CUDA backend needs a pinned host arena "
                              "(TransferWorker(pin_memory=True) or the default)")
        self._device = layout.device
        self._streams = {d: torch.Stream(device=layout.device) for d in Direction}
        self._copier = StagedCopier(layout, pool)

    def submit(self, job: TransferJob) -> None:
        if self._copier is None:
            raise RuntimeError("CudaBackend.submit before bind (register the caches first)")
        if self._closed:
            raise RuntimeError("CudaBackend.submit after shutdown")
        entry = _Entry(job=job, nbytes=job_bytes(job, self._copier.layout))
        with self._lock:
            if job.job_id in self._in_flight:
                raise RuntimeError(f"job {job.job_id} is already in flight")
            self._in_flight[job.job_id] = entry
            self._fifo[job.direction].append(entry)
        try:
            if self.fault_hook is not None and self.fault_hook(job):
                raise InjectedFaultError(
                    f"injected fault in {job.direction.value} job {job.job_id}")
            self._launch(entry)
        except Exception:
            logger.warning("%s job %s failed to start; reporting it failed",
                           job.direction.value, job.job_id, exc_info=True)
            entry.failed = True

    def _launch(self, entry: _Entry) -> None:
        assert self._copier is not None and self._device is not None
        direction = entry.job.direction
        stream = self._streams[direction]
        start = torch.Event(device=self._device, enable_timing=True)
        end = torch.Event(device=self._device, enable_timing=True)
        # Never read (store) or overwrite (load) pages a queued kernel still uses.
        stream.wait_stream(torch.accelerator.current_stream(self._device))
        previous = self._last_end[direction]
        if previous is not None:
            stream.wait_event(previous)
        with stream:
            start.record(stream)
            entry.start, entry.end = start, end
            self._last_end[direction] = end
            try:
                entry.keep = self._copier.copy(entry.job)
            finally:
                # Also when ``copy`` raised midway: the job is over only once what it
                # enqueued has run.
                end.record(stream)

    def _done(self, entry: _Entry) -> bool:
        """Whether ``entry`` is over: its end event completed, or it never enqueued work."""
        if entry.end is None:
            return entry.failed
        try:
            return entry.end.query()
        except RuntimeError:
            logger.error("%s job %s: device error while polling; reporting it failed",
                         entry.job.direction.value, entry.job.job_id, exc_info=True)
            entry.failed = True
            return True

    def poll(self) -> tuple[list[JobId], list[JobId]]:
        finished: list[JobId] = []
        failed: list[JobId] = []
        with self._lock:
            for direction, fifo in self._fifo.items():
                while fifo and self._done(fifo[0]):
                    entry = fifo.popleft()
                    del self._in_flight[entry.job.job_id]
                    entry.keep = []
                    if entry.failed:
                        failed.append(entry.job.job_id)
                        continue
                    assert entry.start is not None and entry.end is not None
                    seconds = entry.start.elapsed_time(entry.end) / 1000.0
                    self._stats.add(direction, entry.nbytes, seconds)
                    finished.append(entry.job.job_id)
        return finished, failed

    def wait(self, job_ids: Iterable[JobId]) -> None:
        with self._lock:
            entries = [self._in_flight[j] for j in job_ids if j in self._in_flight]
        for entry in entries:
            if entry.end is not None:  # failed jobs too: their enqueued copies may still run
                entry.end.synchronize()

    def take_stats(self) -> TransferStats:
        return self._stats.take()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            stream.synchronize()
