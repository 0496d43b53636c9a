"""The CPU backend's default copy path: the native C copy queue (``native_copy.py``,
``_copy.c``, ``_copy_plan.c``), where the install built it.

At ``bind`` the backend hands the library a layout table once: per group, per page segment,
the engine base address, block stride and page bytes, the arena address, and the bounds
(blocks, slots). ``submit`` then makes one C call per job with the job's block ids and
slots: C checks every page of every part against the table before it queues anything (a
job with one bad part is refused whole: reported failed, nothing copied, its slots
reusable at once), plans the pieces as ``cpu_common``'s Python planner would, queues them
and returns. ``copy_threads`` C threads copy them with no Python involved, so copies
overlap the planning of the next jobs and the threads never wait for the GIL. Each thread
takes about ``parallel_bytes / 2`` at a time, so a small job keeps one thread and a large
one spreads over all; pages of 4 KiB and more are written with streaming stores (x86-64),
which skip reading the destination into the cache, while the start of the next piece is
prefetched. The copy threads run at a lower priority (nice 5) than the engine's own
threads. Jobs of one direction in flight together never write the same destination (slots
and engine blocks stay owned by a job until it completes), so they may be copied
concurrently; they complete in order.

What is left on the caller's thread is a few microseconds of Python per job (building the
job's array, the bookkeeping of ``CpuBackend``), plus the worker's own validation:
``benchmarks/transfer_bandwidth.py`` prints the total per job (``submit``). See
docs/transfer.md for throughput.

The tensors' storage is checked to be where it was at ``bind`` once per ``poll`` (once per
engine step) rather than per job: the check costs about a microsecond per cache tensor.
"""

from __future__ import annotations

import logging
import weakref
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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
from kvoffload.worker.native_copy import (
    FAIL_MIDWAY_FLAG,
    STORE_FLAG,
    BadJobError,
    NativeCopy,
    NativeLayout,
    NativeQueue,
    Piece,
    PushedJob,
    encode_job,
    encode_layout,
    encode_one_part,
    load_native_copy,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _NativeEntry(CopyEntry):
    pushed: PushedJob | None = None
    """The job in the native queue until it completes."""


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
        self._native_layout: NativeLayout | None = None
        """The layout table the library plans every job against (from ``bind``)."""
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
                if entry is not None and entry.pushed is not None:
                    direction = entry.job.direction
                    last[direction] = max(last.get(direction, 0), entry.pushed.seq)
        for direction, seq in last.items():  # blocks without the GIL or the lock
            self._queues[direction].wait(seq)
        with self._lock:
            self._collect()

    def plan(self, job: TransferJob, *, sort_bytes: int = SORTED_PIECE_BYTES) -> list[Piece]:
        """The pieces the native queue copies for ``job`` (pieces averaging ``sort_bytes``
        or more in source address order), planned by the C planner without copying; for
        tests and diagnostics. ``BadJobError`` where ``submit`` would report it failed."""
        if self._native_layout is None:
            raise RuntimeError("NativeCpuBackend.plan before bind")
        layout = self._native_layout if sort_bytes == SORTED_PIECE_BYTES \
            else self._native.layout(self._layout_table(sort_bytes))
        try:
            return self._native.plan_job(layout, self._encode(job, inject=False))
        finally:
            if layout is not self._native_layout:
                layout.close()

    # -- the copy path's part of the contract ----------------------------------------------

    def _start(self, pool: HostPool) -> None:
        """Hand the layout table to the library and open one queue per direction (holding
        those already held). The queues, the table and the tensors their threads read and
        write stay alive until ``shutdown`` closes them, or until this backend is
        collected."""
        self._native_layout = self._native.layout(self._layout_table(SORTED_PIECE_BYTES))
        self._queues = {d: self._native.queue(self.copy_threads, self.parallel_bytes // 2)
                        for d in Direction}
        # Closing copies what is queued: it must happen before the tensors the C threads
        # read and write can be freed, also when the backend is dropped without
        # ``shutdown`` (the finalizer holds the tensors until it has run).
        self._closer = weakref.finalize(
            self, _close_queues, list(self._queues.values()), self._native_layout,
            (pool.arena, [seg.pages for g in self._groups.values() for seg in g.segments]))
        for direction, released in self._released.items():
            if not released.is_set():
                self._queues[direction].hold(True)

    def _layout_table(self, sort_bytes: int) -> array[int]:
        """The bound groups, arena and copy settings as the native planner reads them."""
        groups = [(group, g.factor, g.num_blocks,
                   [(seg.engine, seg.stride, seg.page, seg.host) for seg in g.segments])
                  for group, g in self._groups.items()]
        return encode_layout(num_slots=self._num_slots, slot_bytes=self._slot_bytes,
                             chunk=self.chunk_bytes, sort_bytes=sort_bytes, groups=groups)

    def _prepare(self, job: TransferJob) -> _NativeEntry:
        # Nothing to plan here: the queue checks the pages and builds the pieces in C
        # (and counts the job's bytes).
        return _NativeEntry(job, 0)

    def _enqueue(self, entry: _NativeEntry) -> None:
        """Queue ``entry`` in the native queue of its direction, as one job: the C planner
        checks every part before it queues any, so a job with a bad part is refused whole
        (reported failed, nothing copied)."""
        job = entry.job
        try:
            if not self._storage_checked:
                self._check_storage(self._groups)
                self._storage_checked = True
            # An injected fault fails midway, like a real one: half the pages are written.
            entry.inject = self.fault_hook is not None and self.fault_hook(job)
            assert self._native_layout is not None
            pushed = self._queues[job.direction].push_job(self._native_layout,
                                                          self._encode(job, entry.inject))
        except BadJobError:
            logger.warning("%s job %s cannot be copied (%s); reporting it failed",
                           job.direction.value, job.job_id, self._why_refused(job))
            entry.done = True
            return
        except Exception:
            log_uncopyable(job)
            entry.done = True
            return
        entry.pushed = pushed
        entry.nbytes = pushed.nbytes

    def _encode(self, job: TransferJob, inject: bool) -> array[int]:
        """``job`` as the native planner reads it."""
        flags = (STORE_FLAG if job.direction is Direction.STORE else 0) | \
            (FAIL_MIDWAY_FLAG if inject else 0)
        groups = job.groups
        if len(groups) == 1:
            t = groups[0]
            return encode_one_part(flags, t.group, t.first_block_index, t.block_ids, t.slots)
        return encode_job(flags, [(t.group, t.first_block_index, t.block_ids, t.slots)
                                  for t in groups])

    def _why_refused(self, job: TransferJob) -> str:
        """What the C planner found wrong with ``job``, in words (the Python checks,
        run only for a refused job, name the problem)."""
        for transfer in job.groups:
            group = self._groups.get(transfer.group)
            if group is None:
                return f"group {transfer.group} is not registered"
            if transfer.block_ids:
                try:
                    self._check_bounds(transfer, group)
                except (ValueError, IndexError) as problem:
                    return str(problem)
        return "the native planner refused it"

    def _collect(self) -> None:
        """Mark done the entries the native queues completed (under the lock)."""
        for direction, native in self._queues.items():
            completed = native.completed()
            for entry in self._fifo[direction]:
                pushed = entry.pushed
                if pushed is None:  # refused, or already collected
                    continue
                if pushed.seq > completed:
                    break
                entry.done, entry.ok = True, not entry.inject
                entry.seconds = pushed.seconds
                entry.pushed = None
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


def _close_queues(queues: list[NativeQueue], layout: NativeLayout, keep_alive: object) -> None:
    """Close ``queues`` (copying what they hold), then ``layout``; ``keep_alive`` (the
    tensors their threads use) is only referenced, so that it outlives them."""
    for native in queues:
        native.close()
    layout.close()
