"""CPU transfer backend: engine caches in host memory (a CPU engine, tests, the simulator).

Same semantics as the CUDA backend: one background thread per direction takes jobs in
submission order, so completion is in order per direction and ``submit`` never blocks.

How bytes move. Each job becomes a list of (destination view, source view) pairs, one per
segment per contiguous run of pages (``backend.coalesce``), in the widest element type the
pages allow, and the whole list is copied by ``torch._foreach_copy_``: one call, the loop in
C++, the GIL released. Gather-then-scatter through index ops (``index_select`` + ``index_put_``)
reads and writes every byte twice and measured at about half the bandwidth of this path.
A direction thread copies the jobs already queued behind the one it takes in the same pass
(up to ``batch_bytes``), and passes of at least ``parallel_bytes`` are cut into pieces below
torch's intra-op grain and spread over ``copy_threads`` threads, so scattered pages use
every core the way one large contiguous ``copy_`` does. Jobs of one direction that are in
flight together never write the same destination (slots and engine blocks stay owned by a
job until it completes), so copying them in one pass keeps their results; a failing pass
is redone job by job so the failure is reported for the job that caused it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvoffload.errors import LayoutError
from kvoffload.jobs import Direction, JobId, TransferJob, TransferStats
from kvoffload.worker.backend import (
    FaultHook,
    InjectedFaultError,
    StatsAccumulator,
    TransferBackend,
    job_bytes,
    plan_job,
)
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import CacheLayout, as_elements, widest_dtype

logger = logging.getLogger(__name__)

_PIECE_ELEMENTS = 16384
"""Largest piece (in elements) one copy thread copies at once: below torch's intra-op
grain (32768), so a piece never fans out into OpenMP threads of its own."""


@dataclass
class _Entry:
    job: TransferJob
    nbytes: int
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    inject: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class _SegmentViews:
    engine: torch.Tensor  # (num_blocks, page_elems) in the segment's wide dtype
    host: torch.Tensor  # (num_slots, factor, page_elems), same dtype, strided


Piece = tuple[torch.Tensor, torch.Tensor]  # (destination, source), same shape and dtype


class CpuBackend(TransferBackend):
    """Asynchronous copies between CPU engine caches and the host arena."""

    def __init__(self, *, copy_threads: int | None = None, parallel_bytes: int = 1 << 19,
                 batch_bytes: int = 16 << 20, chunk_bytes: int = 1 << 21,
                 fault_hook: FaultHook | None = None) -> None:
        """Args:
            copy_threads: threads sharing one job's copy (default: CPU count, at most 8).
            parallel_bytes: batches smaller than this are copied by their direction thread
                alone (splitting costs more than it saves).
            batch_bytes: a direction thread copies the jobs already queued behind the one
                it takes, up to this many bytes, in one pass (completion stays in order).
            chunk_bytes: bytes handed to a copy thread at a time in a parallel pass.
            fault_hook: test hook; a job it selects fails midway through its copy.
        """
        if copy_threads is None:
            copy_threads = min(8, os.cpu_count() or 1)
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        self.copy_threads = copy_threads
        self.parallel_bytes = parallel_bytes
        self.batch_bytes = batch_bytes
        self.chunk_bytes = chunk_bytes
        self.fault_hook = fault_hook
        self._layout: CacheLayout | None = None
        self._views: dict[int, list[_SegmentViews]] = {}
        self._lock = threading.Lock()
        self._fifo: dict[Direction, deque[_Entry]] = {d: deque() for d in Direction}
        self._in_flight: dict[JobId, _Entry] = {}
        self._queues: dict[Direction, queue.SimpleQueue[_Entry | None]] = {}
        self._threads: list[threading.Thread] = []
        self._helpers: ThreadPoolExecutor | None = None
        self._stats = StatsAccumulator()
        self._closed = False

    # -- contract -----------------------------------------------------------------------

    def bind(self, layout: CacheLayout, pool: HostPool) -> None:
        if self._layout is not None:
            raise RuntimeError("CpuBackend is already bound")
        if layout.device.type != "cpu":
            raise LayoutError(f"the CPU backend copies CPU tensors; the caches are on "
                              f"{layout.device}. Use the CUDA backend.")
        self._layout = layout
        arena_addr = pool.arena.data_ptr()
        for group, glayout in layout.groups.items():
            views = []
            for index, seg in enumerate(glayout.segments):
                dtype = widest_dtype(seg.page_bytes, seg.row_stride, seg.pages.data_ptr(),
                                     seg.host_offset, pool.slot_bytes, arena_addr)
                views.append(_SegmentViews(
                    engine=as_elements(seg.pages, dtype),
                    host=as_elements(pool.segment_view(group, index), dtype)))
            self._views[group] = views
        if self.copy_threads > 1:
            self._helpers = ThreadPoolExecutor(self.copy_threads,
                                               thread_name_prefix="kvoffload-copy")
        for direction in Direction:
            q: queue.SimpleQueue[_Entry | None] = queue.SimpleQueue()
            self._queues[direction] = q
            thread = threading.Thread(target=self._lane, args=(direction, q), daemon=True,
                                      name=f"kvoffload-{direction.value}")
            thread.start()
            self._threads.append(thread)

    def submit(self, job: TransferJob) -> None:
        if self._layout is None:
            raise RuntimeError("CpuBackend.submit before bind (register the caches first)")
        if self._closed:
            raise RuntimeError("CpuBackend.submit after shutdown")
        entry = _Entry(job=job, nbytes=job_bytes(job, self._layout))
        with self._lock:
            if job.job_id in self._in_flight:
                raise RuntimeError(f"job {job.job_id} is already in flight")
            self._in_flight[job.job_id] = entry
            self._fifo[job.direction].append(entry)
        self._queues[job.direction].put(entry)

    def poll(self) -> tuple[list[JobId], list[JobId]]:
        finished: list[JobId] = []
        failed: list[JobId] = []
        with self._lock:
            for direction, fifo in self._fifo.items():
                while fifo and fifo[0].done.is_set():
                    entry = fifo.popleft()
                    del self._in_flight[entry.job.job_id]
                    if entry.ok:
                        finished.append(entry.job.job_id)
                        self._stats.add(direction, entry.nbytes, entry.seconds)
                    else:
                        failed.append(entry.job.job_id)
        return finished, failed

    def wait(self, job_ids: Iterable[JobId]) -> None:
        with self._lock:
            entries = [self._in_flight[j] for j in job_ids if j in self._in_flight]
        for entry in entries:
            entry.done.wait()

    def take_stats(self) -> TransferStats:
        return self._stats.take()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    # -- the direction threads ----------------------------------------------------------

    def _lane(self, direction: Direction, q: queue.SimpleQueue[_Entry | None]) -> None:
        stop = False
        while not stop:
            entry = q.get()
            if entry is None:
                return
            # Take whatever else is already queued (up to batch_bytes) into one copy pass:
            # fewer hand-offs, and small jobs get split over the copy threads together.
            batch, nbytes = [entry], entry.nbytes
            while nbytes < self.batch_bytes:
                try:
                    more = q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
                nbytes += more.nbytes
            self._run(direction, batch)

    def _run(self, direction: Direction, batch: list[_Entry]) -> None:
        """Copy a batch; mark its jobs done in order. Failures are attributed per job."""
        start = time.perf_counter()
        for entry in batch:
            entry.inject = self.fault_hook is not None and self.fault_hook(entry.job)
        try:
            if len(batch) > 1 and not any(e.inject for e in batch):
                try:
                    self._copy(batch)
                    for entry in batch:
                        entry.ok = True
                    return
                except Exception:
                    logger.debug("batch copy failed; retrying its jobs one by one",
                                 exc_info=True)
            for entry in batch:
                try:
                    self._copy([entry])
                    entry.ok = True
                except Exception:
                    logger.warning("%s job %s failed; reporting it failed", direction.value,
                                   entry.job.job_id, exc_info=True)
        finally:
            seconds = time.perf_counter() - start
            total = sum(e.nbytes for e in batch) or 1
            for entry in batch:
                entry.seconds = seconds * (entry.nbytes or 1) / total
                entry.done.set()

    def _copy(self, batch: list[_Entry]) -> None:
        """Copy every job of ``batch``; raise if any copy fails (or a fault is injected)."""
        assert self._layout is not None
        if any(e.inject for e in batch):
            pieces = [p for entry in batch for p in self._pieces(entry.job)]
            # Fail midway, like a real fault: half the pages are already written.
            _copy_all(pieces[: len(pieces) // 2])
            ids = [e.job.job_id for e in batch if e.inject]
            raise InjectedFaultError(f"injected fault in {batch[0].job.direction.value} "
                                     f"job(s) {ids}")
        if self._helpers is None or sum(e.nbytes for e in batch) < self.parallel_bytes:
            _copy_all([p for entry in batch for p in self._pieces(entry.job)])
            return
        # Pipeline: hand out chunks to the copy threads while building the next ones, so
        # the Python work of building views overlaps the copies.
        futures: list[Future[None]] = []
        try:
            chunk: list[Piece] = []
            chunk_bytes = 0
            for entry in batch:
                for piece in self._pieces(entry.job):
                    for part in _split(piece):
                        chunk.append(part)
                        chunk_bytes += part[0].numel() * part[0].element_size()
                        if chunk_bytes >= self.chunk_bytes:
                            futures.append(self._helpers.submit(_copy_all, chunk))
                            chunk, chunk_bytes = [], 0
            _copy_all(chunk)
        finally:
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def _pieces(self, job: TransferJob) -> list[Piece]:
        assert self._layout is not None
        store = job.direction is Direction.STORE
        pieces: list[Piece] = []
        for copy in plan_job(job, self._layout):
            views = self._views[copy.layout.group]
            for run in copy.runs:
                end = run.block_id + run.length
                sub_end = run.sub_block + run.length
                for seg in views:
                    engine = seg.engine[run.block_id : end]  # (length, page_elems)
                    host = seg.host[run.slot, run.sub_block : sub_end]  # (length, page_elems)
                    pieces.append((host, engine) if store else (engine, host))
        return pieces


def _copy_all(pieces: list[Piece]) -> None:
    if pieces:
        torch._foreach_copy_([d for d, _ in pieces], [s for _, s in pieces])


def _split(piece: Piece) -> Iterator[Piece]:
    """Cut a (rows, elems) piece into pieces of at most ``_PIECE_ELEMENTS`` elements."""
    dst, src = piece
    rows, elems = int(dst.shape[0]), int(dst.shape[1])
    if rows * elems <= _PIECE_ELEMENTS:
        yield piece
        return
    if elems <= _PIECE_ELEMENTS:
        step = _PIECE_ELEMENTS // elems
        for r in range(0, rows, step):
            yield dst[r : r + step], src[r : r + step]  # (<=step, elems)
        return
    for r in range(rows):
        # One row is dense: split it along its elements.
        yield from zip(torch.split(dst[r], _PIECE_ELEMENTS),
                       torch.split(src[r], _PIECE_ELEMENTS), strict=True)
