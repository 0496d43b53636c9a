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

The staging budget. The copier's device memory is fixed at bind, whatever the jobs move:
one buffer per direction of at most ``staging_bytes`` (default ``DEFAULT_STAGING_BYTES``,
64 MiB), allocated once and reused by every job of that direction. A group copy is split
into chunks of consecutive slot images that fit the buffer; each chunk is staged and
copied before the next one starts (a store: gather, then copy to the host; a load: copy
from the host, then scatter). The buffer holds a chunk's slot images and, behind them, the
pages of one segment on their way between the engine rows and the slot images (written by
``index_select``/``index`` with ``out=``, so no copy allocates a temporary of its own). The
only other device allocations are the index tensors: 24 bytes per engine block of a job.
A group whose single slot image (with its gather pages) exceeds the budget is refused at
bind with a ``LayoutError`` saying how much it needs.

Why reusing one buffer is safe: every copy of one direction runs on that direction's
stream, in the order it is enqueued, and jobs of a direction follow each other on it
(step 2 above). The copies to and from the pinned arena are ``cudaMemcpyAsync`` calls on
that stream (``non_blocking=True`` with pinned host memory), so the next chunk's gather
(store) or host-to-device copy (load), enqueued after them, starts only once they are
done with the buffer. Each group copy uploads its index tensor once (a non-blocking copy
from pinned memory, on the same stream, before the kernels that read it); the host and
device index tensors are returned by ``copy`` and kept until the job's end event
completes, so neither is freed or reused while a copy may still read it. The buffers live
as long as the backend; ``shutdown`` synchronizes both streams.

Where a store has read the engine. A store enqueues all its reads of engine blocks (the
gathers) chunk by chunk; after the last gather, ``copy`` calls its ``after_engine_reads``
callback, before the last chunk's copies to the host. Work recorded on the stream at that
point (an event) completes once every engine block of the job has been read: the engine
may reuse the blocks then, while the copies to the host still run from the staging
buffer. ``CudaBackend._store_reads_enqueued`` is that point for the backend.

The module imports without CUDA; ``CudaBackend.bind`` requires it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kvoffload.errors import LayoutError
from kvoffload.jobs import Direction, JobId, TransferJob, TransferStats
from kvoffload.sizes import format_size, parse_size
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


DEFAULT_STAGING_BYTES = 64 << 20
"""The staging budget per direction (64 MiB): 128 MiB of device memory for both.

A chunk moves about ``budget // block_bytes`` slot images (one slot image is one
offloaded block, ``block_bytes``: every layer's pages of ``block_size_factor`` engine
blocks; a chunk also passes one segment's pages, a few percent more). With vLLM's 16-token
blocks a slot image is 2 MiB for an 8B model (32 layers, K and V apart) and 5 MiB for a
70B one at tensor-parallel 1, so a chunk holds 12 to 31 of them: a decode step's stores
move in one chunk, a 2048-token prefill chunk's store (128 blocks, 256 MiB for the 8B
model) in four. Each chunk costs two kernel launches per page segment (64 segments for
that model) and a host copy per run of slots, enqueued on the engine's thread; at a few
microseconds per launch that is well under the 2-3 ms 64 MiB take over PCIe, and the
launches of one chunk overlap the copies of the previous one. A smaller budget leaves the
engine more memory and costs more launches per byte; near a few slot images per chunk the
launches, not the bus, set the speed. ``benchmarks/gpu_check.sh`` measures both against
an unsplit copy."""

_ALIGN = 64
"""Alignment of the gather pages behind the slot images in a staging buffer."""


def staging_need(glayout: GroupLayout, slots: int) -> int:
    """Bytes of staging a chunk of ``slots`` slot images of this group uses: the slot
    images, then (aligned) ``slots * factor`` pages of its largest segment."""
    images = -(-slots * glayout.block_bytes // _ALIGN) * _ALIGN
    return images + slots * glayout.factor * max(s.page_bytes for s in glayout.segments)


def chunk_slots(glayout: GroupLayout, staging_bytes: int, max_slots: int) -> int:
    """The most slot images of this group one chunk of ``staging_bytes`` holds (at most
    ``max_slots``, the arena's slot count: no group copy touches more); 0 if not one."""
    per_slot = glayout.block_bytes + glayout.factor * max(s.page_bytes for s in glayout.segments)
    slots = min(max_slots, staging_bytes // per_slot)
    while slots > 0 and staging_need(glayout, slots) > staging_bytes:
        slots -= 1
    return slots


@dataclass(frozen=True)
class _SlotPart:
    """One slot touched by a group transfer: its position in the transfer and the
    sub-blocks ``[first, end)`` the transfer holds, one page each."""

    slot: int
    position: int
    first: int
    end: int


class StagedCopier:
    """Enqueues a job's copies on the current stream through fixed device staging buffers
    (module docstring: the staging budget, and why reusing them is safe).

    ``copy(job)`` returns the temporaries (index tensors) that must stay alive until the
    enqueued work completes.
    """

    def __init__(self, layout: CacheLayout, pool: HostPool, *,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        """Args:
            staging_bytes: device bytes per direction for staging (``DEFAULT_STAGING_BYTES``).

        Raises ``LayoutError`` when one slot image of a group does not fit the budget.
        """
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) \
                or staging_bytes < 1:
            raise ValueError(f"staging_bytes must be a positive integer, got {staging_bytes!r}")
        self.layout = layout
        self.pool = pool
        self.device = layout.device
        self.staging_bytes = staging_bytes
        self._pin_index = self.device.type == "cuda"
        # Per group: (engine rows in a wide dtype, that dtype) for each segment.
        self._engine: dict[int, list[tuple[torch.Tensor, torch.dtype]]] = {}
        self._chunk_slots: dict[int, int] = {}
        for group, glayout in layout.groups.items():
            rows = []
            for seg in glayout.segments:
                dtype = widest_dtype(seg.page_bytes, seg.row_stride, seg.pages.data_ptr(),
                                     seg.host_offset, glayout.block_bytes)
                rows.append((as_elements(seg.pages, dtype), dtype))  # (num_blocks, elems)
            self._engine[group] = rows
            slots = chunk_slots(glayout, staging_bytes, max(1, pool.num_slots))
            if slots == 0:
                need = staging_need(glayout, 1)
                raise LayoutError(
                    f"group {group}: one offloaded block is {glayout.block_bytes} bytes "
                    f"(page_bytes {glayout.page_bytes} x block_size_factor {glayout.factor}) "
                    f"and staging it takes {need} bytes of device memory, more than the CUDA "
                    f"backend's staging budget of {staging_bytes} bytes. Raise staging_bytes "
                    f"to at least {format_size(need)} (kv_connector_extra_config.staging_bytes "
                    "in vLLM, TransferWorker(staging_bytes=...) or CudaBackend(staging_bytes="
                    "...)), or lower block_size_factor.")
            self._chunk_slots[group] = slots
        size = max(staging_need(g, self._chunk_slots[i]) for i, g in layout.groups.items())
        # One buffer per direction, (size,) uint8, reused by every job of that direction.
        self.staging: dict[Direction, torch.Tensor] = {
            d: torch.empty(size, dtype=torch.uint8, device=self.device) for d in Direction}

    def slots_per_chunk(self, group: int) -> int:
        """Slot images of ``group`` one chunk stages at most."""
        return self._chunk_slots[group]

    def copy(self, job: TransferJob, *,
             after_engine_reads: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """Enqueue ``job``'s copies on the current stream, chunk after chunk.

        ``after_engine_reads`` (stores only) is called once, right after the job's last read
        of engine blocks is enqueued and before the copies to the host that follow it.
        """
        store = job.direction is Direction.STORE
        copies = [c for c in plan_job(job, self.layout) if c.pairs]
        if store and not copies and after_engine_reads is not None:
            after_engine_reads()
        keep: list[torch.Tensor] = []
        for k, group_copy in enumerate(copies):
            last = k == len(copies) - 1
            keep.extend(self._copy_group(group_copy, store,
                                         after_engine_reads if store and last else None))
        return keep

    def _copy_group(self, copy: GroupCopy, store: bool,
                    after_reads: Callable[[], None] | None) -> list[torch.Tensor]:
        glayout = copy.layout
        parts = _slot_parts(copy)
        per_chunk = self._chunk_slots[glayout.group]
        # (3, pages) int64: engine block id, position in its chunk, sub-block of every page.
        host_index = torch.tensor(
            [[b for b, _, _ in copy.pairs],
             [p.position % per_chunk for p in parts for _ in range(p.first, p.end)],
             [j for _, _, j in copy.pairs]],
            dtype=torch.int64, pin_memory=self._pin_index)
        index = host_index.to(self.device, non_blocking=True)
        buffer = self.staging[Direction.STORE if store else Direction.LOAD]
        scratch_at = staging_need(glayout, per_chunk) \
            - per_chunk * glayout.factor * max(s.page_bytes for s in glayout.segments)
        segments = list(enumerate(self._engine[glayout.group]))
        page = 0
        for first in range(0, len(parts), per_chunk):
            chunk = parts[first : first + per_chunk]
            pages = sum(p.end - p.first for p in chunk)
            # (slot images of this chunk, block_bytes) uint8, in transfer order.
            stage = buffer[: len(chunk) * glayout.block_bytes].view(len(chunk), -1)
            block_ids, positions, subs = (index[i, page : page + pages] for i in range(3))
            page += pages
            if not store:
                self._host_copies(glayout, chunk, stage, to_host=False)
            for seg_index, (engine, dtype) in segments:
                staged = _stage_segment(stage, glayout, seg_index, dtype)
                nbytes = pages * glayout.segments[seg_index].page_bytes
                rows = as_elements(buffer[scratch_at : scratch_at + nbytes].view(pages, -1),
                                   dtype)  # (pages, elems)
                if store:  # engine rows -> gather pages -> slot images
                    torch.index_select(engine, 0, block_ids, out=rows)
                    staged.index_put_((positions, subs), rows)
                else:  # slot images -> gather pages -> engine rows
                    torch.ops.aten.index.Tensor_out(staged, [positions, subs], out=rows)
                    engine.index_put_((block_ids,), rows)
            if store:
                if after_reads is not None and first + per_chunk >= len(parts):
                    after_reads()
                self._host_copies(glayout, chunk, stage, to_host=True)
        return [host_index, index]

    def _host_copies(self, glayout: GroupLayout, parts: list[_SlotPart], stage: torch.Tensor,
                     *, to_host: bool) -> None:
        """Copy one chunk's slot images between ``stage`` (row ``i`` for ``parts[i]``) and
        the arena (non-blocking)."""
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
                _copy(host, stage[i:j], to_host)  # (n, block_bytes)
                i = j
                continue
            for seg in glayout.segments:
                start = seg.host_offset + part.first * seg.page_bytes
                end = seg.host_offset + part.end * seg.page_bytes
                _copy(arena[part.slot, start:end], stage[i, start:end], to_host)
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

    Consecutive pages naming the same slot at consecutive sub-blocks form one part (a
    slot's sub-blocks are consecutive positions of the transfer); one ``_SlotPart`` is
    built per part, so a part holds at most ``factor`` pages. A load naming one slot twice
    (the worker allows it: only destinations must differ) gets a part, and a staged slot
    image, per mention.
    """
    parts: list[_SlotPart] = []
    slot: int | None = None
    first = end = 0
    for _, page_slot, sub in copy.pairs:
        if page_slot == slot and sub == end:
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
    reads_done: torch.Event | None = None
    """A store's: completes once every engine block of it was read (``fence_engine_reads``)."""
    keep: list[torch.Tensor] = field(default_factory=list)
    failed: bool = False


class CudaBackend(TransferBackend):
    """Asynchronous copies between GPU caches and a pinned host arena (module docstring)."""

    def __init__(self, *, staging_bytes: int | str = DEFAULT_STAGING_BYTES,
                 fault_hook: FaultHook | None = None) -> None:
        """Args:
            staging_bytes: device memory for staging, per direction: a size in the grammar
                of ``kvoffload.sizes`` (default ``DEFAULT_STAGING_BYTES``, 64 MiB). Jobs are
                split into chunks that fit it; ``bind`` allocates it and refuses a layout
                whose single offloaded block does not fit (module docstring).
            fault_hook: test hook; a job it selects fails at submit and is reported failed.

        Raises ``ConfigError`` for a ``staging_bytes`` that is not a positive size.
        """
        self.staging_bytes = parse_size(staging_bytes, "staging_bytes", minimum=1)
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
        self._copier = StagedCopier(layout, pool, staging_bytes=self.staging_bytes)

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
                reads = None if direction is Direction.LOAD \
                    else (lambda: self._store_reads_enqueued(entry, stream))
                entry.keep = self._copier.copy(entry.job, after_engine_reads=reads)
            finally:
                # Also when ``copy`` raised midway: the job is over only once what it
                # enqueued has run.
                end.record(stream)

    def _store_reads_enqueued(self, entry: _Entry, stream: torch.Stream) -> None:
        """Called once per store job, inside ``_launch``, right after the last read of the
        job's engine blocks is enqueued on ``stream`` and before the copies to the host
        that follow it. An event recorded on ``stream`` here completes once every engine
        block of the job has been read (earlier chunks' reads precede it on the stream);
        what is still queued behind it reads only the staging buffer: that event is
        ``reads_done``, which ``fence_engine_reads`` makes the engine's stream wait on."""
        event = torch.Event(device=self._device)
        event.record(stream)
        entry.reads_done = event

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

    def fence_engine_reads(self, job_ids: Iterable[JobId]) -> None:
        """The engine's current stream waits, on the device, for each listed store's reads
        of the engine cache (``reads_done``): kernels the engine enqueues next (zeroing a
        block, copying into it, the next forward pass) run after them, while the copies to
        host memory go on from the staging buffer. The host does not block. A store that
        stopped midway has no ``reads_done``; the stream waits for its end instead."""
        if self._device is None:
            return
        compute = torch.accelerator.current_stream(self._device)
        with self._lock:
            entries = [self._in_flight[j] for j in job_ids if j in self._in_flight]
        for entry in entries:
            if entry.job.direction is not Direction.STORE:
                continue
            event = entry.reads_done if entry.reads_done is not None else entry.end
            if event is not None:
                compute.wait_event(event)

    def take_stats(self) -> TransferStats:
        return self._stats.take()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            stream.synchronize()
