"""The CPU backend's fallback copy path: ``ctypes.memmove`` from Python threads.

Used where the native copy queue is not built (no C compiler at install) or is turned off
(``KVOFFLOAD_NATIVE_COPY=0``, ``cpu_backend(native_copy=False)``); the same bytes as the
native queue, slower.

``submit`` plans the job's pieces on the caller's thread (``CpuBackend._pieces``) and
queues it. One Python thread per direction takes queued jobs, up to ``batch_bytes`` at a
time, into one pass; its pieces are copied by ``ctypes.memmove``, which releases the GIL
per piece, by the direction thread and helper threads taking pieces from one shared
iterator (``_SharedPass``). Each pass first checks that the tensors' storage is still where
it was at ``bind``; a failing pass is redone job by job so the failure is reported for the
job that caused it.

Measured on a 2-core VM (``benchmarks/transfer_bandwidth.py``, 64 MiB in jobs of 16
scattered 64 KiB blocks): about 0.5 of torch's two-thread contiguous ``copy_`` (the native
queue: about 0.87); a thread returning from one copy waits for the GIL before the next.
See docs/transfer.md.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import starmap
from operator import itemgetter
from typing import ClassVar

from kvoffload.jobs import Direction, JobId, TransferJob
from kvoffload.worker.backend import FaultHook, InjectedFaultError
from kvoffload.worker.cpu_common import (
    CHUNK_BYTES,
    PARALLEL_BYTES,
    SORTED_PIECE_BYTES,
    CopyEntry,
    CpuBackend,
    log_uncopyable,
)
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.native_copy import Piece

logger = logging.getLogger(__name__)

_memmove = ctypes.memmove  # releases the GIL while it copies
_source = itemgetter(1)
"""Sort key of a ``Piece``: its source address."""
BATCH_BYTES = 16 << 20
"""Default ``batch_bytes``."""


@dataclass
class _MemmoveEntry(CopyEntry):
    pieces: list[Piece] = field(default_factory=list)
    """The job's copies, planned at submit; released once the job is done."""


class MemmoveCpuBackend(CpuBackend[_MemmoveEntry]):
    """CPU copies by ``ctypes.memmove`` from one Python thread per direction, with helper
    threads for large passes."""

    native_copy: ClassVar[bool] = False

    def __init__(self, *, copy_threads: int | None = None,
                 parallel_bytes: int = PARALLEL_BYTES, batch_bytes: int = BATCH_BYTES,
                 chunk_bytes: int = CHUNK_BYTES, fault_hook: FaultHook | None = None) -> None:
        """Args:
            copy_threads: threads copying one direction, the direction thread included
                (default: CPU count, at most 8).
            parallel_bytes: passes smaller than this are copied by their direction thread
                alone.
            batch_bytes: a direction thread copies the jobs already queued behind the one
                it takes, up to this many bytes, in one pass.
            chunk_bytes: longest single copy; longer contiguous runs are cut into pieces of
                this size so copy threads share them.
            fault_hook: test hook; a job it selects fails midway through its copy.
        """
        super().__init__(copy_threads=copy_threads, parallel_bytes=parallel_bytes,
                         chunk_bytes=chunk_bytes, fault_hook=fault_hook)
        self.batch_bytes = batch_bytes
        self._queues: dict[Direction, queue.SimpleQueue[_MemmoveEntry | None]] = {}
        self._threads: list[threading.Thread] = []
        self._helpers: ThreadPoolExecutor | None = None

    def wait(self, job_ids: Iterable[JobId]) -> None:
        with self._done:
            entries = [self._in_flight[j] for j in job_ids if j in self._in_flight]
            while not all(e.done for e in entries):
                self._done.wait()

    # -- the copy path's part of the contract ----------------------------------------------

    def _start(self, pool: HostPool) -> None:
        """Start the helper pool and one thread per direction (until ``shutdown``)."""
        if self.copy_threads > 1:
            self._helpers = ThreadPoolExecutor(self.copy_threads - 1,
                                               thread_name_prefix="kvoffload-copy")
        for direction in Direction:
            q: queue.SimpleQueue[_MemmoveEntry | None] = queue.SimpleQueue()
            self._queues[direction] = q
            thread = threading.Thread(target=self._lane, args=(direction, q), daemon=True,
                                      name=f"kvoffload-{direction.value}")
            thread.start()
            self._threads.append(thread)

    def _prepare(self, job: TransferJob) -> _MemmoveEntry:
        """Plan the pieces here, on the caller's thread: the direction threads then go from
        one job to the next without a planning pause."""
        entry = _MemmoveEntry(job=job, nbytes=self._job_bytes(job))
        try:
            entry.pieces = self._pieces(job)
            # Large pages are copied in ascending source address order, which reads memory
            # front to back instead of in the scattered order of block ids: a few percent
            # faster from 32 KiB pages; below that the sort costs more than it saves (the
            # native queue sorts the same way, in C).
            if entry.nbytes >= SORTED_PIECE_BYTES * len(entry.pieces):
                entry.pieces.sort(key=_source)
        except Exception:
            log_uncopyable(job)
            entry.done = True
        return entry

    def _enqueue(self, entry: _MemmoveEntry) -> None:
        self._queues[entry.job.direction].put(entry)

    def _stop(self) -> None:
        """Let each direction thread finish its queue, then join it and the helpers."""
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    # -- the direction threads ----------------------------------------------------------

    def _lane(self, direction: Direction, q: queue.SimpleQueue[_MemmoveEntry | None]) -> None:
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

    def _run(self, direction: Direction, batch: list[_MemmoveEntry]) -> None:
        """Copy a batch; mark its jobs done in order. Failures are attributed per job."""
        self._released[direction].wait()
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
            with self._done:
                for entry in batch:
                    entry.seconds = seconds * (entry.nbytes or 1) / total
                    entry.done = True
                    entry.pieces = []
                self._done.notify_all()

    def _copy(self, batch: list[_MemmoveEntry]) -> None:
        """Copy every job of ``batch``; raise if any copy fails (or a fault is injected)."""
        self._check_storage({t.group for e in batch for t in e.job.groups})
        if any(e.inject for e in batch):
            pieces = [p for entry in batch for p in entry.pieces]
            # Fail midway, like a real fault: half the pages are already written.
            _drain(iter(pieces[: len(pieces) // 2]))
            ids = [e.job.job_id for e in batch if e.inject]
            raise InjectedFaultError(f"injected fault in {batch[0].job.direction.value} "
                                     f"job(s) {ids}")
        nbytes = sum(e.nbytes for e in batch)
        pieces = [p for entry in batch for p in entry.pieces]
        helpers = 0
        if self._helpers is not None and nbytes >= self.parallel_bytes:
            helpers = min(self.copy_threads, len(pieces)) - 1
        _SharedPass(pieces).run(self._helpers, helpers)


def _drain(pieces: Iterator[Piece]) -> None:
    """Copy pieces until ``pieces`` is exhausted (the loop runs in C)."""
    deque(starmap(_memmove, pieces), maxlen=0)


class _SharedPass:
    """The pieces of one pass, copied by the direction thread and up to ``helpers`` copy
    threads, all taking pieces from one list iterator (taking the next item is atomic under
    the GIL), so no thread waits for a slower one.

    ``ctypes.memmove`` releases the GIL per piece: a thread whose copy returns while another
    holds the GIL sleeps until it is handed back (tens of microseconds on a VM), which is
    why the native queue, one C call per pass, copies faster with several threads.

    The direction thread never waits for a helper that has not started: a helper that
    starts after the direction thread found the iterator empty copies nothing.
    """

    def __init__(self, pieces: list[Piece]) -> None:
        self._pieces = iter(pieces)
        self._cond = threading.Condition()
        self._busy = 0
        self._closed = False
        self._error: BaseException | None = None

    def run(self, pool: ThreadPoolExecutor | None, helpers: int) -> None:
        """Copy every piece, with up to ``helpers`` threads of ``pool``; raise the first
        error any thread met (after every thread that started has stopped: the memory the
        pieces point into is not written after ``run`` returns)."""
        if pool is not None:
            for _ in range(helpers):
                pool.submit(self._help)
        try:
            _drain(self._pieces)
        finally:
            with self._cond:
                self._closed = True
                while self._busy:
                    self._cond.wait()
        if self._error is not None:
            raise self._error

    def _help(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._busy += 1
        try:
            _drain(self._pieces)
        except BaseException as exc:  # raised by the direction thread
            self._error = exc
        finally:
            with self._cond:
                self._busy -= 1
                if not self._busy:
                    self._cond.notify_all()
