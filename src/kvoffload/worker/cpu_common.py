"""What the CPU backend's two copy paths share: binding, bounds checks, pieces, stats.

A CPU backend copies between engine caches in host memory (a CPU engine, tests, the
simulator) and the host arena. Two copy paths exist, one class each:
``NativeCpuBackend`` (``cpu_native.py``: the C copy queue of ``_copy.c``, the default where
the install built it) and ``MemmoveCpuBackend`` (``cpu_memmove.py``: ``ctypes.memmove``
from Python threads). ``kvoffload.worker.worker.cpu_backend`` picks one. Both keep the
contract of ``TransferBackend``: jobs of one direction complete in submission order,
``submit`` never blocks, a failure is reported for the job that caused it.

Planning. At ``bind`` every page segment is reduced to four integers: the address of its
engine block 0, its row stride, its page size, and the arena address of its sub-block 0 in
slot 0. A job's pages are checked against the bounds of the registered tensors and of the
arena (block ids, slots), every part of the job before any of it is copied: a job failing
the check is reported failed without touching memory. The job then becomes
``(destination, source, bytes)`` pieces, one per segment per page: pages that continue the
previous one on both sides (consecutive engine blocks in dense rows going to consecutive
sub-blocks of a slot, or to consecutive slots when one segment fills the slot) merge into
one piece, pieces longer than ``chunk_bytes`` are cut so
that copy threads can share them, and a job whose pieces average ``SORTED_PIECE_BYTES``
(32 KiB) or more is copied in ascending source address order (reading memory front to back
rather than in the scattered order of block ids). The ``memmove`` path checks and plans
in Python (``CpuBackend._pieces``, here); the native queue checks and plans the same
pieces in C (``_copy_plan.c``, against a table of these integers handed over at ``bind``),
and the tests compare the two planners.

Bookkeeping, shared here: one FIFO of entries per direction (an entry is a submitted job
until ``poll`` reports it), the in-flight index, the hold switches of tests, the stats.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import abstractmethod
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import count, pairwise, repeat
from operator import sub as _minus
from typing import ClassVar, Generic, NamedTuple, TypeVar

import torch

from kvoffload.errors import LayoutError
from kvoffload.jobs import Direction, GroupTransfer, JobId, TransferJob, TransferStats
from kvoffload.worker.backend import FaultHook, StatsAccumulator, TransferBackend
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import CacheLayout
from kvoffload.worker.native_copy import Piece

logger = logging.getLogger(__name__)

SORTED_PIECE_BYTES = 32 << 10
"""Jobs whose pieces average at least this many bytes are copied in source address order
(both copy paths: the ``memmove`` path sorts in Python, the native queue in C)."""
PARALLEL_BYTES = 1 << 19
"""Default ``parallel_bytes`` (see ``CpuBackend.__init__``)."""
CHUNK_BYTES = 1 << 18
"""Default ``chunk_bytes``: the longest single copy."""


@dataclass
class CopyEntry:
    """A submitted job, from ``submit`` until ``poll`` reports it."""

    job: TransferJob
    nbytes: int
    done: bool = False
    """Set, under the backend's lock, once the copy finished or failed."""
    ok: bool = False
    inject: bool = False
    """The fault hook chose this job: its copy fails midway."""
    seconds: float = 0.0


EntryT = TypeVar("EntryT", bound=CopyEntry)
"""The entry type of one copy path (the fields it needs beyond ``CopyEntry``'s)."""


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


class _Pages(NamedTuple):
    """The pages of one group transfer, in order, checked against the registered memory."""

    block_ids: Sequence[int]
    slot_offsets: Sequence[int]
    """``slot * slot_bytes`` of every page."""
    subs: Sequence[int] | None
    """Sub-block of every page; ``None``: all 0 (``block_size_factor`` 1)."""
    consecutive: bool
    """Some engine block id is its predecessor's plus one (pages may merge)."""


class CpuBackend(TransferBackend, Generic[EntryT]):
    """Asynchronous copies between CPU engine caches and the host arena: the part both
    copy paths share. A copy path supplies ``_prepare`` (its entry for a job), ``_enqueue``
    (hand it to its copy threads), ``_start``/``_stop`` (its threads) and ``wait``."""

    native_copy: ClassVar[bool]
    """Whether jobs are copied by the native queue (else by ``ctypes.memmove``)."""

    def __init__(self, *, copy_threads: int | None = None,
                 parallel_bytes: int = PARALLEL_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 fault_hook: FaultHook | None = None) -> None:
        """Args:
            copy_threads: threads copying one direction (default: CPU count, at most 8).
            parallel_bytes: how much a job needs before several threads share it (each
                copy path says how it uses it).
            chunk_bytes: longest single copy; longer contiguous runs are cut into pieces of
                this size so copy threads share them.
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
        self.chunk_bytes = chunk_bytes
        self.fault_hook = fault_hook
        self._layout: CacheLayout | None = None
        self._pool: HostPool | None = None
        self._arena = 0
        self._slot_bytes = 0
        self._num_slots = 0
        self._groups: dict[int, _Group] = {}
        self._page_bytes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)  # notified when entries complete
        self._fifo: dict[Direction, deque[EntryT]] = {d: deque() for d in Direction}
        self._in_flight: dict[JobId, EntryT] = {}
        self._released = {d: threading.Event() for d in Direction}  # cleared: held
        for released in self._released.values():
            released.set()
        self._stats = StatsAccumulator()
        self._closed = False

    def hold(self, direction: Direction, held: bool = True) -> None:
        """Test hook: while held, jobs of ``direction`` stay queued (submitted, neither
        copied nor completed); releasing lets them run in order. ``shutdown`` releases.
        May be called before ``bind``: the hold then applies from the first job."""
        if held:
            self._released[direction].clear()
        else:
            self._released[direction].set()

    # -- contract -----------------------------------------------------------------------

    def bind(self, layout: CacheLayout, pool: HostPool) -> None:
        """Record the addresses of every page segment and of the arena, then start the
        copy threads. From here until ``shutdown`` the tensors' storage must stay where it
        is (a job finding it moved fails); the backend references them until then."""
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
            self._groups[group] = _Group(segments=segments, factor=glayout.factor,
                                         num_blocks=glayout.num_blocks)
            self._page_bytes[group] = glayout.page_bytes
        self._start(pool)

    def submit(self, job: TransferJob) -> None:
        """Enter ``job`` in its direction's FIFO and hand it to the copy threads; returns
        at once. A job that cannot be copied (out of bounds, an unknown group) is entered
        already failed and touches no memory."""
        if self._layout is None:
            raise RuntimeError("CpuBackend.submit before bind (register the caches first)")
        if self._closed:
            raise RuntimeError("CpuBackend.submit after shutdown")
        entry = self._prepare(job)
        with self._lock:
            if job.job_id in self._in_flight:
                raise RuntimeError(f"job {job.job_id} is already in flight")
            self._in_flight[job.job_id] = entry
            self._fifo[job.direction].append(entry)
            # Under the lock: each direction's copy order is then its FIFO order.
            if not entry.done:
                self._enqueue(entry)

    def poll(self) -> tuple[list[JobId], list[JobId]]:
        finished: list[JobId] = []
        failed: list[JobId] = []
        with self._lock:
            self._collect()
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

    def take_stats(self) -> TransferStats:
        return self._stats.take()

    def shutdown(self) -> None:
        """Release every hold, copy what is queued and stop the copy threads; jobs copied
        meanwhile are reported by the next ``poll``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for released in self._released.values():
            released.set()
        self._stop()

    # -- what a copy path supplies --------------------------------------------------------

    @abstractmethod
    def _start(self, pool: HostPool) -> None:
        """Start the copy threads (``bind``, after the segments are recorded)."""

    @abstractmethod
    def _prepare(self, job: TransferJob) -> EntryT:
        """The entry of ``job``, planned as far as the path plans off the lock (on the
        caller's thread); ``done`` already set if it cannot be copied."""

    @abstractmethod
    def _enqueue(self, entry: EntryT) -> None:
        """Hand ``entry`` (not done) to the copy threads; called under the lock, in FIFO
        order. May mark it done (nothing to copy, or it cannot be queued)."""

    def _collect(self) -> None:
        """Mark done the entries whose copies completed elsewhere (under the lock, first
        thing in ``poll``); a path whose threads mark their entries themselves needs
        nothing here."""

    @abstractmethod
    def _stop(self) -> None:
        """Copy what is queued and stop the copy threads (``shutdown``, once)."""

    # -- shared by the copy paths -----------------------------------------------------------

    def _job_bytes(self, job: TransferJob) -> int:
        """Bytes ``job`` moves; a group never registered counts 0 (the job fails anyway)."""
        page_bytes = self._page_bytes
        return sum(len(t.block_ids) * page_bytes.get(t.group, 0) for t in job.groups)

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
        """Every copy of ``job`` as bounds-checked ``(destination, source, bytes)``, in job
        order (the Python planner; the native queue builds the same pieces in C)."""
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


def log_uncopyable(job: TransferJob) -> None:
    """Log (with the exception being handled) that ``job`` is reported failed unstarted."""
    logger.warning("%s job %s cannot be copied; reporting it failed",
                   job.direction.value, job.job_id, exc_info=True)


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
