"""CPU transfer backend: engine caches in host memory (a CPU engine, tests, the simulator).

Same semantics as the CUDA backend: jobs of one direction complete in submission order,
``submit`` never blocks, a failure is reported for the job that caused it.

Planning. At ``bind`` every page segment is reduced to four integers: the address of its
engine block 0, its row stride, its page size, and the arena address of its sub-block 0 in
slot 0. ``submit`` checks every page of a job against the bounds of the registered tensors
and of the arena (block ids, slots) on the caller's thread; a job failing it is reported
failed without touching memory. The job then becomes ``(destination, source, bytes)``
pieces, one per segment per page: pages that continue the previous one on both sides
(consecutive engine blocks in dense rows going to consecutive sub-blocks of a slot, or to
consecutive slots when one segment fills the slot) merge into one piece, pieces longer than
``chunk_bytes`` are cut so that copy threads can share them, and a job whose pieces average
32 KiB or more is copied in ascending source address order (reading memory front to back
rather than in the scattered order of block ids).

Copying, the native queue (default; ``native_copy.py``, ``_copy.c``). ``submit`` hands the
job's block ids and slots to a C queue per direction, which does the checks and the
planning above in C and returns at once; ``copy_threads`` C threads copy them with no
Python involved, so copies overlap the planning of the next jobs and the threads never
wait for the GIL. Each thread takes about
``parallel_bytes / 2`` at a time, so a small job keeps one thread and a large one spreads
over all; pages of 4 KiB and more are written with streaming stores (x86-64), which skip
reading the destination into the cache. The copy threads run at a lower priority (nice 5)
than the engine's own threads. Jobs of one direction in flight together never write the
same destination (slots and engine blocks stay owned by a job until it completes), so they
may be copied concurrently; they complete in order.

Copying without it (``native_copy=False``, or no C compiler at install). One Python thread
per direction takes queued jobs, up to ``batch_bytes`` at a time, into one pass; its pieces
are copied by ``ctypes.memmove``, which releases the GIL per piece, by the direction thread
and helper threads taking pieces from one shared iterator (``_SharedPass``). Each pass first
checks that the tensors' storage is still where it was at ``bind``; a failing pass is redone
job by job so the failure is reported for the job that caused it.

Measured on a 2-core VM (``benchmarks/transfer_bandwidth.py``, 64 MiB in jobs of 16
scattered 64 KiB blocks, against torch's two-thread contiguous ``copy_``, both starting from
clean caches): the native queue about 0.87 of the contiguous copy, the ``memmove`` path
about 0.5 (a thread returning from one copy waits for the GIL before the next). What the
native queue still loses is the Python side, about 13 us per job on the caller's thread,
which shares the two cores with the copies. See docs/transfer.md.

The native queue checks that the tensors' storage is still where it was at ``bind`` once
per ``poll`` (once per engine step) rather than per job: the check costs about a
microsecond per cache tensor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count, pairwise, repeat, starmap
from operator import itemgetter
from operator import sub as _minus
from typing import Any, NamedTuple

import torch

from kvoffload.errors import LayoutError
from kvoffload.jobs import Direction, GroupTransfer, JobId, TransferJob, TransferStats
from kvoffload.worker.backend import (
    FaultHook,
    InjectedFaultError,
    StatsAccumulator,
    TransferBackend,
)
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import CacheLayout
from kvoffload.worker.native_copy import (
    NativeCopy,
    NativeQueue,
    Piece,
    PushedJob,
    load_native_copy,
)

logger = logging.getLogger(__name__)


class _Pages(NamedTuple):
    """The pages of one group transfer, in order, checked against the registered memory."""

    block_ids: Sequence[int]
    slot_offsets: Sequence[int]
    """``slot * slot_bytes`` of every page."""
    subs: Sequence[int] | None
    """Sub-block of every page; ``None``: all 0 (``block_size_factor`` 1)."""
    consecutive: bool
    """Some engine block id is its predecessor's plus one (pages may merge)."""


_memmove = ctypes.memmove  # releases the GIL while it copies
_source = itemgetter(1)
"""Sort key of a ``Piece``: its source address."""
_SORTED_PIECE_BYTES = 32 << 10
"""Passes whose pieces average at least this many bytes are copied in address order."""


@dataclass
class _Entry:
    job: TransferJob
    nbytes: int
    done: bool = False
    """Set, under the backend's lock, once the copy finished or failed."""
    ok: bool = False
    inject: bool = False
    seconds: float = 0.0
    pieces: list[Piece] = field(default_factory=list)
    """The job's copies, planned at submit; released once the job is done."""
    pushed: list[PushedJob] = field(default_factory=list)
    """The job's parts in the native queue (one per group transfer) until it completes."""
    broken: bool = False
    """A part could not be queued after others were: the job fails, but only once the
    parts already queued are copied (its blocks stay the job's until then)."""


@dataclass(frozen=True)
class _Segment:
    """Addresses of one page segment, on both sides."""

    pages: torch.Tensor  # the engine view (kept to check its storage has not moved)
    engine: int  # address of engine block 0
    stride: int  # bytes between consecutive engine blocks
    page: int  # bytes of one page
    host: int  # arena address of sub-block 0 of this segment in slot 0


@dataclass(frozen=True)
class _Group:
    segments: tuple[_Segment, ...]
    factor: int
    num_blocks: int
    native_segments: array[int]
    """``(engine, stride, page, host)`` of every segment, for the native queue."""


class CpuBackend(TransferBackend):
    """Asynchronous copies between CPU engine caches and the host arena."""

    def __init__(self, *, copy_threads: int | None = None, parallel_bytes: int = 1 << 19,
                 batch_bytes: int = 16 << 20, chunk_bytes: int = 1 << 18,
                 native_copy: bool | None = None,
                 fault_hook: FaultHook | None = None) -> None:
        """Args:
            copy_threads: threads copying one direction (default: CPU count, at most 8).
            parallel_bytes: native queue: a copy thread takes about this many bytes at a
                time, so smaller jobs are copied by one thread. ``memmove`` path: passes
                smaller than this are copied by their direction thread alone.
            batch_bytes: ``memmove`` path: a direction thread copies the jobs already
                queued behind the one it takes, up to this many bytes, in one pass.
            chunk_bytes: longest single copy; longer contiguous runs are cut into pieces of
                this size so copy threads share them.
            native_copy: copy with the native queue (``_copy.c``): ``None`` (default)
                where the install built it, ``True`` requires it (error if missing),
                ``False`` copies page by page with ``ctypes.memmove`` from Python threads.
            fault_hook: test hook; a job it selects fails midway through its copy.
        """
        if copy_threads is None:
            copy_threads = min(8, os.cpu_count() or 1)
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.copy_threads = copy_threads
        self.parallel_bytes = parallel_bytes
        self.batch_bytes = batch_bytes
        self.chunk_bytes = chunk_bytes
        self.fault_hook = fault_hook
        self._native: NativeCopy | None = load_native_copy() if native_copy is not False \
            else None
        if native_copy and self._native is None:
            raise RuntimeError("native_copy=True but kvoffload's native copy queue is not "
                               "available: reinstall kvoffload where a C compiler is "
                               "present (pip install -e .), or pass native_copy=None")
        self._layout: CacheLayout | None = None
        self._pool: HostPool | None = None
        self._arena = 0
        self._slot_bytes = 0
        self._num_slots = 0
        self._groups: dict[int, _Group] = {}
        self._page_bytes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)  # notified when entries complete
        self._fifo: dict[Direction, deque[_Entry]] = {d: deque() for d in Direction}
        self._in_flight: dict[JobId, _Entry] = {}
        self._queues: dict[Direction, queue.SimpleQueue[_Entry | None]] = {}
        self._threads: list[threading.Thread] = []
        self._helpers: ThreadPoolExecutor | None = None
        self._native_queues: dict[Direction, NativeQueue] = {}
        self._close_native: Callable[[], object] = lambda: None
        self._storage_checked = False
        """Native queue: the tensors' storage was checked since the last ``poll`` (once per
        engine step: a check costs about a microsecond per cache tensor)."""
        self._released = {d: threading.Event() for d in Direction}  # cleared: held
        for released in self._released.values():
            released.set()
        self._stats = StatsAccumulator()
        self._closed = False

    @property
    def native_copy(self) -> bool:
        """Whether jobs are copied by the native queue (else by ``ctypes.memmove``)."""
        return self._native is not None

    def hold(self, direction: Direction, held: bool = True) -> None:
        """Test hook: while held, jobs of ``direction`` stay queued (submitted, neither
        copied nor completed); releasing lets them run in order. ``shutdown`` releases."""
        if held:
            self._released[direction].clear()
        else:
            self._released[direction].set()
        if self._native_queues:
            self._native_queues[direction].hold(held)

    # -- contract -----------------------------------------------------------------------

    def bind(self, layout: CacheLayout, pool: HostPool) -> None:
        if self._layout is not None:
            raise RuntimeError("CpuBackend is already bound")
        if layout.device.type != "cpu":
            raise LayoutError(f"the CPU backend copies CPU tensors; the caches are on "
                              f"{layout.device}. Use the CUDA backend.")
        if pool.arena.device.type != "cpu" or not pool.arena.is_contiguous():
            raise LayoutError("the host arena must be one contiguous CPU tensor")
        self._layout, self._pool = layout, pool
        self._arena = pool.arena.data_ptr()
        self._slot_bytes = pool.slot_bytes
        self._num_slots = pool.num_slots
        for group, glayout in layout.groups.items():
            segments = tuple(_Segment(pages=seg.pages, engine=seg.pages.data_ptr(),
                                      stride=seg.row_stride, page=seg.page_bytes,
                                      host=self._arena + seg.host_offset)
                             for seg in glayout.segments)
            self._groups[group] = _Group(
                segments=segments, factor=glayout.factor, num_blocks=glayout.num_blocks,
                native_segments=array("Q", [v for seg in segments
                                            for v in (seg.engine, seg.stride, seg.page,
                                                      seg.host)]))
            self._page_bytes[group] = glayout.page_bytes
        if self._native is not None:
            self._native_queues = {d: self._native.queue(self.copy_threads,
                                                         self.parallel_bytes // 2)
                                   for d in Direction}
            # Closing copies what is queued: it must happen before the tensors the C threads
            # read and write can be freed, also when the backend is dropped without
            # ``shutdown`` (the finalizer holds the tensors until it has run).
            self._close_native = weakref.finalize(
                self, _close_queues, list(self._native_queues.values()),
                (pool.arena, [seg.pages for g in self._groups.values() for seg in g.segments]))
            for direction, released in self._released.items():
                if not released.is_set():
                    self._native_queues[direction].hold(True)
            return
        if self.copy_threads > 1:
            self._helpers = ThreadPoolExecutor(self.copy_threads - 1,
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
        page_bytes = self._page_bytes
        entry = _Entry(job=job, nbytes=sum(len(t.block_ids) * page_bytes.get(t.group, 0)
                                           for t in job.groups))  # unknown group: fails below
        # Planned here, on the caller's thread: the copy threads go from one job to the
        # next without a planning pause.
        # The native queue checks the pages and builds the pieces in C (``_push``).
        if not self._native_queues:
            try:
                entry.pieces = self._pieces(job)
                # Large pages are copied in ascending source address order, which reads
                # memory front to back instead of in the scattered order of block ids: a
                # few percent faster from 32 KiB pages; below that the sort costs more
                # than it saves (the native queue sorts the same way, in C).
                if entry.nbytes >= _SORTED_PIECE_BYTES * len(entry.pieces):
                    entry.pieces.sort(key=_source)
            except Exception:
                logger.warning("%s job %s cannot be copied; reporting it failed",
                               job.direction.value, job.job_id, exc_info=True)
                entry.done = True
        with self._lock:
            if job.job_id in self._in_flight:
                raise RuntimeError(f"job {job.job_id} is already in flight")
            self._in_flight[job.job_id] = entry
            self._fifo[job.direction].append(entry)
            if not entry.done and self._native_queues:
                self._push(entry)
                return
        if not entry.done:
            self._queues[job.direction].put(entry)

    def _push(self, entry: _Entry) -> None:
        """Queue ``entry`` in the native queue of its direction, one part per group
        transfer (under the lock, so each direction's queue order is its FIFO order). The
        entry completes with its last part: the queue completes parts in order."""
        job = entry.job
        native = self._native_queues[job.direction]
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
                    **self._native_pages(transfer, store), sort_bytes=_SORTED_PIECE_BYTES,
                    fail_midway=entry.inject))
        except Exception:
            logger.warning("%s job %s cannot be copied; reporting it failed",
                           job.direction.value, job.job_id, exc_info=True)
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
        return {"segments": group.native_segments,
                "block_ids": array("q", transfer.block_ids),
                "slots": array("q", transfer.slots), "num_blocks": group.num_blocks,
                "num_slots": self._num_slots, "slot_bytes": self._slot_bytes,
                "factor": group.factor, "skip": transfer.first_block_index % group.factor,
                "store": store, "chunk": self.chunk_bytes}

    def _collect_native(self) -> None:
        """Mark done the entries the native queues completed (under the lock)."""
        for direction, native in self._native_queues.items():
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

    def poll(self) -> tuple[list[JobId], list[JobId]]:
        finished: list[JobId] = []
        failed: list[JobId] = []
        self._storage_checked = False
        with self._lock:
            self._collect_native()
            for direction, fifo in self._fifo.items():
                while fifo and fifo[0].done:
                    entry = fifo.popleft()
                    del self._in_flight[entry.job.job_id]
                    if entry.ok:
                        finished.append(entry.job.job_id)
                        self._stats.add(direction, entry.nbytes, entry.seconds)
                    else:
                        failed.append(entry.job.job_id)
        return finished, failed

    def wait(self, job_ids: Iterable[JobId]) -> None:
        if self._native_queues:
            self._wait_native(job_ids)
            return
        with self._done:
            entries = [self._in_flight[j] for j in job_ids if j in self._in_flight]
            while not all(e.done for e in entries):
                self._done.wait()

    def _wait_native(self, job_ids: Iterable[JobId]) -> None:
        last: dict[Direction, int] = {}
        with self._lock:
            for job_id in job_ids:
                entry = self._in_flight.get(job_id)
                if entry is not None and entry.pushed:
                    direction = entry.job.direction
                    last[direction] = max(last.get(direction, 0), entry.pushed[-1].seq)
        for direction, seq in last.items():  # blocks without the GIL or the lock
            self._native_queues[direction].wait(seq)
        with self._lock:
            self._collect_native()

    def take_stats(self) -> TransferStats:
        return self._stats.take()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for released in self._released.values():
            released.set()
        for q in self._queues.values():
            q.put(None)
        for thread in self._threads:
            thread.join()
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
        self._close_native()
        with self._lock:  # every queued job is copied now: report them
            self._collect_native()

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

    def _copy(self, batch: list[_Entry]) -> None:
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

    def _check_storage(self, groups: Iterable[int]) -> None:
        """Raise if the storage of the arena or of a tensor of ``groups`` moved since
        ``bind`` (resized or freed): the addresses computed there would be stale."""
        assert self._pool is not None
        if self._pool.arena.data_ptr() != self._arena:
            raise RuntimeError("the host arena moved since bind")
        for group in groups:
            for seg in self._groups[group].segments:
                if seg.pages.data_ptr() != seg.engine:
                    raise RuntimeError(f"a cache tensor of group {group} was reallocated "
                                       "after register_kv_caches; register caches once, for "
                                       "good")

    def _pieces(self, job: TransferJob) -> list[Piece]:
        """Every copy of ``job`` as bounds-checked ``(destination, source, bytes)``."""
        store = job.direction is Direction.STORE
        out: list[Piece] = []
        for transfer in job.groups:
            group = self._groups[transfer.group]
            pages = self._checked_pages(transfer, group)
            for seg in group.segments:
                _segment_pieces(out, seg, pages, store=store, chunk=self.chunk_bytes)
        return out

    def _check_bounds(self, transfer: GroupTransfer, group: _Group) -> int:
        """Raise unless every page of ``transfer`` (which names at least one block) lies
        inside the registered memory; returns the sub-block of its first page."""
        factor = group.factor
        block_ids = transfer.block_ids
        slots = transfer.slots
        skip = transfer.first_block_index % factor
        needed = -(-(skip + len(block_ids)) // factor)
        if len(slots) != needed:
            raise ValueError(f"group {transfer.group}: {len(block_ids)} blocks from logical "
                             f"index {transfer.first_block_index} need {needed} slots, got "
                             f"{len(slots)}")
        if min(block_ids) < 0 or max(block_ids) >= group.num_blocks:
            raise IndexError(f"group {transfer.group}: engine block outside "
                             f"[0, {group.num_blocks})")
        if min(slots) < 0 or max(slots) >= self._num_slots:
            raise IndexError(f"group {transfer.group}: slot outside [0, {self._num_slots})")
        return skip

    def _checked_pages(self, transfer: GroupTransfer, group: _Group) -> _Pages:
        """``(engine block ids, slot byte offsets, sub-blocks)`` of every page, in order,
        after checking every one of them lies inside the registered memory."""
        factor = group.factor
        block_ids = transfer.block_ids
        slots = transfer.slots
        if not block_ids:
            return _Pages((), [], None, consecutive=False)
        skip = self._check_bounds(transfer, group)
        slot_bytes = self._slot_bytes
        consecutive = 1 in map(_minus, block_ids[1:], block_ids)
        if factor == 1:
            return _Pages(block_ids, [s * slot_bytes for s in slots], None, consecutive)
        positions = range(skip, skip + len(block_ids))
        return _Pages(block_ids, [slots[p // factor] * slot_bytes for p in positions],
                      [p % factor for p in positions], consecutive)


def _segment_pieces(out: list[Piece], seg: _Segment, pages: _Pages, *, store: bool,
                    chunk: int) -> None:
    """Append one segment's copies to ``out``, merging pages contiguous on both sides.

    Addresses are built by list comprehensions. An engine page can only continue its
    predecessor when rows are dense and the block ids are consecutive; without such a
    pair (scattered blocks, the common case) the pieces are zipped straight from the
    address lists, otherwise the pages that start a new copy are found by one more
    comprehension.
    """
    engine, stride, page, host = seg.engine, seg.stride, seg.page, seg.host
    block_ids, slot_offsets, subs, consecutive = pages
    if not block_ids:
        return
    engine_at = [engine + block_id * stride for block_id in block_ids]
    if subs is None:
        host_at = [host + offset for offset in slot_offsets]
    else:
        host_at = [host + offset + sub * page
                   for offset, sub in zip(slot_offsets, subs, strict=True)]
    dst, src = (host_at, engine_at) if store else (engine_at, host_at)
    if not (consecutive and stride == page):
        if page <= chunk:
            out.extend(zip(dst, src, repeat(page)))
        else:
            for to, frm in zip(dst, src, strict=True):
                _emit(out, to, frm, page, chunk)
        return
    starts = [0]
    starts += [i for i, e, prev_e, h, prev_h in zip(count(1), engine_at[1:], engine_at,
                                                     host_at[1:], host_at)
               if e != prev_e + page or h != prev_h + page]
    if len(starts) == len(block_ids) and page <= chunk:
        out.extend(zip(dst, src, repeat(page)))
        return
    starts.append(len(block_ids))
    for first, end in pairwise(starts):
        _emit(out, dst[first], src[first], (end - first) * page, chunk)


def _emit(out: list[Piece], dst: int, src: int, n: int, chunk: int) -> None:
    """Append the copy of ``n`` bytes ``src -> dst``, cut into pieces of at most ``chunk``."""
    if n <= chunk:
        out.append((dst, src, n))
        return
    for off in range(0, n, chunk):
        out.append((dst + off, src + off, min(chunk, n - off)))


def _close_queues(queues: list[NativeQueue], keep_alive: object) -> None:
    """Close ``queues`` (copying what they hold); ``keep_alive`` (the tensors their threads
    use) is only referenced, so that it outlives them."""
    for native in queues:
        native.close()


def _drain(pieces: Iterator[Piece]) -> None:
    """Copy pieces until ``pieces`` is exhausted (the loop runs in C)."""
    deque(starmap(_memmove, pieces), maxlen=0)


class _SharedPass:
    """The pieces of one pass, copied without the native pool: by the direction thread and
    up to ``helpers`` copy threads, all taking pieces from one list iterator (taking the
    next item is atomic under the GIL), so no thread waits for a slower one.

    ``ctypes.memmove`` releases the GIL per piece: a thread whose copy returns while another
    holds the GIL sleeps until it is handed back (tens of microseconds on a VM), which is
    why the native pool, one C call per pass, copies faster with several threads.

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
        error any thread met (after every thread that started has stopped)."""
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
