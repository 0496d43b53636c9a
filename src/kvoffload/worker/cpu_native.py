"""The CPU backend's default copy path: the native C copy queue (``native_copy.py``,
``_copy.c``), where the install built it.

``submit`` hands the job's block ids and slots to a C queue per direction, which does the
bounds checks and the planning of ``cpu_common`` in C and returns at once;
``copy_threads`` C threads copy them with no Python involved, so copies overlap the
planning of the next jobs and the threads never wait for the GIL. Each thread takes about
``parallel_bytes / 2`` at a time, so a small job keeps one thread and a large one spreads
over all; pages of 4 KiB and more are written with streaming stores (x86-64), which skip
reading the destination into the cache. The copy threads run at a lower priority (nice 5)
than the engine's own threads. Jobs of one direction in flight together never write the
same destination (slots and engine blocks stay owned by a job until it completes), so they
may be copied concurrently; they complete in order.

Measured on a 2-core VM (``benchmarks/transfer_bandwidth.py``, 64 MiB in jobs of 16
scattered 64 KiB blocks, against torch's two-thread contiguous ``copy_``, both starting from
clean caches): about 0.87 of the contiguous copy. What it still loses is the Python side,
about 13 us per job on the caller's thread, which shares the two cores with the copies.
See docs/transfer.md.

The tensors' storage is checked to be where it was at ``bind`` once per ``poll`` (once per
engine step) rather than per job: the check costs about a microsecond per cache tensor.
"""

from __future__ import annotations

import logging
import weakref
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvoffload.jobs import Direction, GroupTransfer, JobId, TransferJob
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
from kvoffload.worker.native_copy import NativeCopy, NativeQueue, PushedJob, load_native_copy

logger = logging.getLogger(__name__)


@dataclass
class _NativeEntry(CopyEntry):
    pushed: list[PushedJob] = field(default_factory=list)
    """The job's parts in the native queue (one per group transfer) until it completes."""
    broken: bool = False
    """A part could not be queued after others were: the job fails, but only once the
    parts already queued are copied (its blocks stay the job's until then)."""


def require_native_copy() -> NativeCopy:
    """The native copy queue's library; ``RuntimeError`` (saying how to get it) where it
    is not built or is turned off by ``KVOFFLOAD_NATIVE_COPY=0``."""
    library = load_native_copy()
    if library is None:
        raise RuntimeError("native_copy=True but kvoffload's native copy queue is not "
                           "available: reinstall kvoffload where a C compiler is "
                           "present (pip install -e .), or pass native_copy=None")
    return library


class NativeCpuBackend(CpuBackend[_NativeEntry]):
    """CPU copies by the native queue's C threads, one queue per direction."""

    native_copy: ClassVar[bool] = True

    def __init__(self, *, library: NativeCopy | None = None, copy_threads: int | None = None,
                 parallel_bytes: int = PARALLEL_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 fault_hook: FaultHook | None = None) -> None:
        """Args:
            library: the loaded native library (default: loaded here; ``RuntimeError``
                where it is missing, see ``require_native_copy``).
            copy_threads: C threads copying one direction (default: CPU count, at most 8).
            parallel_bytes: a copy thread takes about half this many bytes at a time, so
                smaller jobs are copied by one thread.
            chunk_bytes: longest single copy; longer contiguous runs are cut into pieces of
                this size so copy threads share them.
            fault_hook: test hook; a job it selects fails midway through its copy.
        """
        super().__init__(copy_threads=copy_threads, parallel_bytes=parallel_bytes,
                         chunk_bytes=chunk_bytes, fault_hook=fault_hook)
        self._native: NativeCopy = library if library is not None else require_native_copy()
        self._queues: dict[Direction, NativeQueue] = {}
        self._segments: dict[int, array[int]] = {}
        """``(engine, stride, page, host)`` of every segment of a group, as C reads them."""
        self._closer: Callable[[], object] = lambda: None
        self._storage_checked = False
        """The tensors' storage was checked since the last ``poll`` (once per engine step:
        a check costs about a microsecond per cache tensor)."""

    def hold(self, direction: Direction, held: bool = True) -> None:
        super().hold(direction, held)
        if self._queues:
            self._queues[direction].hold(held)

    def poll(self) -> tuple[list[JobId], list[JobId]]:
        self._storage_checked = False
        return super().poll()

    def wait(self, job_ids: Iterable[JobId]) -> None:
        last: dict[Direction, int] = {}
        with self._lock:
            for job_id in job_ids:
                entry = self._in_flight.get(job_id)
                if entry is not None and entry.pushed:
                    direction = entry.job.direction
                    last[direction] = max(last.get(direction, 0), entry.pushed[-1].seq)
        for direction, seq in last.items():  # blocks without the GIL or the lock
            self._queues[direction].wait(seq)
        with self._lock:
            self._collect()

    # -- the copy path's part of the contract ----------------------------------------------

    def _start(self, pool: HostPool) -> None:
        """Open one queue per direction (holding those already held). The queues, and the
        tensors their threads read and write, stay alive until ``shutdown`` closes them,
        or until this backend is collected."""
        self._segments = {group: array("Q", [v for seg in g.segments
                                             for v in (seg.engine, seg.stride, seg.page,
                                                       seg.host)])
                          for group, g in self._groups.items()}
        self._queues = {d: self._native.queue(self.copy_threads, self.parallel_bytes // 2)
                        for d in Direction}
        # Closing copies what is queued: it must happen before the tensors the C threads
        # read and write can be freed, also when the backend is dropped without
        # ``shutdown`` (the finalizer holds the tensors until it has run).
        self._closer = weakref.finalize(
            self, _close_queues, list(self._queues.values()),
            (pool.arena, [seg.pages for g in self._groups.values() for seg in g.segments]))
        for direction, released in self._released.items():
            if not released.is_set():
                self._queues[direction].hold(True)

    def _prepare(self, job: TransferJob) -> _NativeEntry:
        # Nothing to plan here: the queue checks the pages and builds the pieces in C.
        return _NativeEntry(job=job, nbytes=self._job_bytes(job))

    def _enqueue(self, entry: _NativeEntry) -> None:
        """Queue ``entry`` in the native queue of its direction, one part per group
        transfer. The entry completes with its last part: the queue completes parts in
        order."""
        job = entry.job
        native = self._queues[job.direction]
        store = job.direction is Direction.STORE
        try:
            if not self._storage_checked:
                self._check_storage(self._groups)
                self._storage_checked = True
            # An injected fault fails midway, like a real one: half the pages are written.
            entry.inject = self.fault_hook is not None and self.fault_hook(job)
            for transfer in job.groups:
                if not transfer.block_ids:
                    continue
                entry.pushed.append(native.push_pages(
                    **self._native_pages(transfer, store), sort_bytes=SORTED_PIECE_BYTES,
                    fail_midway=entry.inject))
        except Exception:
            log_uncopyable(job)
            if entry.pushed:  # fails when the parts already queued are done with its blocks
                entry.broken = True
            else:
                entry.done = True
        if not entry.pushed and not entry.done:  # nothing to copy
            entry.done, entry.ok = True, not entry.inject

    def _native_pages(self, transfer: GroupTransfer, store: bool) -> dict[str, Any]:
        """The pages of ``transfer`` as the native queue takes them (``push_pages`` and
        ``plan_pages`` arguments, less the sort threshold)."""
        group = self._groups[transfer.group]
        return {"segments": self._segments[transfer.group],
                "block_ids": array("q", transfer.block_ids),
                "slots": array("q", transfer.slots), "num_blocks": group.num_blocks,
                "num_slots": self._num_slots, "slot_bytes": self._slot_bytes,
                "factor": group.factor, "skip": transfer.first_block_index % group.factor,
                "store": store, "chunk": self.chunk_bytes}

    def _collect(self) -> None:
        """Mark done the entries the native queues completed (under the lock)."""
        for direction, native in self._queues.items():
            completed = native.completed()
            for entry in self._fifo[direction]:
                pushed = entry.pushed
                if entry.done or not pushed:
                    continue
                if pushed[-1].seq > completed:
                    break
                entry.done, entry.ok = True, not (entry.inject or entry.broken)
                entry.seconds = sum(part.seconds for part in pushed)
                entry.pushed = []
                if entry.inject:
                    fault = InjectedFaultError(f"injected fault in {direction.value} job "
                                               f"{entry.job.job_id}")
                    logger.warning("%s job %s failed; reporting it failed", direction.value,
                                   entry.job.job_id, exc_info=fault)

    def _stop(self) -> None:
        """Close the queues (which copies every queued job), then mark those jobs done."""
        self._closer()
        with self._lock:  # every queued job is copied now: report them
            self._collect()


def _close_queues(queues: list[NativeQueue], keep_alive: object) -> None:
    """Close ``queues`` (copying what they hold); ``keep_alive`` (the tensors their threads
    use) is only referenced, so that it outlives them."""
    for native in queues:
        native.close()
