"""The CPU backend's native copy queue (``_copy.c``, ``_copy_plan.c``), when the install
built it.

Python hands the library a layout table once (``encode_layout``, ``NativeCopy.layout``),
then pushes each job as pages (``encode_job``: block ids and slots per group, which C checks
against the table and turns into pieces, refusing the job whole if any page is out of
bounds) or as ready-made pieces ``(destination, source, bytes)``, and returns at once; C
threads copy them with no Python involved, so copies overlap the planning of the next jobs
and several threads copy in parallel without handing the GIL back and forth between pages.
Jobs complete in push order. The formats are in ``_copy.h``. Without the library (no C
compiler at install, or ``KVOFFLOAD_NATIVE_COPY=0``) the CPU backend copies piece by piece
with ``ctypes.memmove`` from Python threads (``MemmoveCpuBackend``): the same bytes,
slower.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import struct
import threading
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Piece = tuple[int, int, int]
"""``(destination address, source address, bytes)``: one ``memmove``."""

DISABLE_ENV = "KVOFFLOAD_NATIVE_COPY"
"""Set to ``0`` to copy with ``ctypes.memmove`` even where the native queue is built."""


def pack(pieces: Iterable[Piece]) -> array[int]:
    """Pieces as the flat ``uint64`` triples the native queue reads."""
    return array("Q", chain.from_iterable(pieces))


class _Library:
    """The loaded ``_copy`` library with its signatures declared."""

    def __init__(self, path: Path) -> None:
        # Only calls that block release the GIL (through a CDLL). The quick ones keep it
        # (through a PyDLL): a thread that releases the GIL for a microsecond many times a
        # second keeps resetting the switch timer of a thread waiting for it, and starved
        # that thread (the remote tier's index thread, behind an idle engine's step loop).
        blocking, quick = ctypes.CDLL(str(path)), ctypes.PyDLL(str(path))
        u64, ptr = ctypes.c_uint64, ctypes.c_void_p
        self.new = _declare(blocking.kvoffload_queue_new, [ctypes.c_int, u64], ptr)
        self.wait = _declare(blocking.kvoffload_queue_wait, [ptr, u64], None)
        self.free = _declare(blocking.kvoffload_queue_free, [ptr], None)
        self.push = _declare(quick.kvoffload_queue_push, [ptr, ptr, u64, ptr], u64)
        self.push_job = _declare(quick.kvoffload_queue_push_job, [ptr, ptr, ptr, u64], u64)
        self.plan_job = _declare(quick.kvoffload_plan_job, [ptr, ptr, u64, ptr, u64], u64)
        self.layout_new = _declare(quick.kvoffload_layout_new,
                                   [ptr, u64, ctypes.POINTER(ptr)], ctypes.c_int)
        self.layout_free = _declare(quick.kvoffload_layout_free, [ptr], None)
        self.hold = _declare(quick.kvoffload_queue_hold, [ptr, ctypes.c_int], None)
        self.completed = _declare(quick.kvoffload_queue_completed, [ptr], u64)


def _declare(function: Any, argtypes: list[Any], restype: Any) -> Any:
    function.argtypes = argtypes
    function.restype = restype
    return function


# -- the formats of ``_copy.h`` ----------------------------------------------------------

STORE_FLAG = 1
"""A job's flag: engine to arena (else arena to engine)."""
FAIL_MIDWAY_FLAG = 2
"""A job's flag: copy only the first half of its pieces (fault injection)."""

Part = tuple[int, int, Sequence[int], Sequence[int]]
"""``(group id, first_block_index, engine block ids, slots)``: one group transfer."""

Segment = tuple[int, int, int, int]
"""``(engine address of block 0, bytes between engine blocks, page bytes, arena address of
the segment's sub-block 0 in slot 0)``."""


_ZEROS = array("q", bytes(8 * 1024))
_FORMATS: dict[int, struct.Struct] = {}


def _format(count: int) -> struct.Struct:
    """The ``struct`` packing ``count`` native ``int64`` values."""
    fmt = _FORMATS.get(count)
    if fmt is None:
        fmt = _FORMATS[count] = struct.Struct(f"={count}q")
    return fmt


def encode_job(flags: int, parts: Sequence[Part]) -> array[int]:
    """A job as the native planner reads it (``_copy.h``): an ``int64`` array whose first
    two values the library writes (``held_ns``, ``bytes``). ``struct.error`` if a value
    does not fit 64 bits."""
    if len(parts) == 1:
        return encode_one_part(flags, *parts[0])
    values = [0, 0, flags, len(parts)]
    for group, first, block_ids, slots in parts:
        values += (group, first, len(block_ids), len(slots), *block_ids, *slots)
    job = array("q", bytes(8 * len(values)))
    _format(len(values)).pack_into(job, 0, *values)
    return job


def encode_one_part(flags: int, group: int, first: int, block_ids: Sequence[int],
                    slots: Sequence[int]) -> array[int]:
    """:func:`encode_job` of a job of one part (the common case), in one packing call."""
    count = 8 + len(block_ids) + len(slots)
    job = _ZEROS[:count] if count <= len(_ZEROS) else array("q", bytes(8 * count))
    _format(count).pack_into(job, 0, 0, 0, flags, 1, group, first, len(block_ids),
                             len(slots), *block_ids, *slots)
    return job


def encode_layout(*, num_slots: int, slot_bytes: int, chunk: int, sort_bytes: int,
                  groups: Sequence[tuple[int, int, int, Sequence[Segment]]]) -> array[int]:
    """The layout table (``_copy.h``) of ``groups``: ``(group id, factor, num_blocks,
    segments)`` each, a segment being ``(engine, stride, page, host)``."""
    values = [num_slots, slot_bytes, chunk, sort_bytes, len(groups)]
    for group, factor, num_blocks, segments in groups:
        values += (group, factor, num_blocks, len(segments))
        for segment in segments:
            values += segment
    return array("Q", values)


class PushedJob:
    """A job in a :class:`NativeQueue`: its sequence number, and the memory the C threads
    read and write until it completes (kept alive here)."""

    __slots__ = ("_cells", "_packed", "seq")

    def __init__(self, cells: array[int], packed: array[int] | None, seq: int) -> None:
        self._cells = cells  # [0]: held_ns, [1]: bytes (jobs given as pages)
        self._packed = packed
        self.seq = seq

    @property
    def seconds(self) -> float:
        """Time the job alone held the queue (valid once it completed)."""
        return self._cells[0] / 1e9

    @property
    def nbytes(self) -> int:
        """Bytes the job moves (jobs given as pages; 0 for ready-made pieces)."""
        return self._cells[1] if len(self._cells) > 1 else 0


class BadJobError(ValueError):
    """The native planner refused a job: malformed, or a page outside the layout."""


class NativeLayout:
    """The layout table held by the library (``_copy.h``), against which jobs given as pages
    are checked and planned. Must outlive every queue it is pushed to."""

    def __init__(self, library: _Library, table: array[int]) -> None:
        self._lib = library
        handle = ctypes.c_void_p()
        status = library.layout_new(table.buffer_info()[0], len(table), ctypes.byref(handle))
        if status == 1:
            raise ValueError("malformed layout table (see _copy.h)")
        if status != 0 or not handle.value:
            raise MemoryError("kvoffload_layout_new failed: no memory left")
        self._handle: int | None = handle.value

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise RuntimeError("the native layout is closed")
        return self._handle

    def close(self) -> None:
        """Free the table (idempotent); only once no queue can still plan against it."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._lib.layout_free(handle)


class NativeQueue:
    """C threads copying pushed jobs in push order (one queue per transfer direction)."""

    def __init__(self, library: _Library, threads: int, grab_bytes: int) -> None:
        self._lib = library
        handle = library.new(threads, grab_bytes)
        if not handle:
            raise MemoryError("kvoffload_queue_new failed: no memory or threads left")
        self._handle: int | None = handle
        self._unfinished_lock = threading.Lock()
        self._unfinished: deque[PushedJob] = deque()
        """Pushed jobs not yet seen completed: the C threads write their memory (the
        pieces, the cells), so it stays alive here whatever the caller keeps."""
        self._last_seq = 0  # the last job pushed

    def push(self, packed: array[int]) -> PushedJob:
        """Queue the pieces of ``packed`` (see :func:`pack`) as one job; returns at once."""
        handle = self._live()
        job = PushedJob(array("q", [0]), packed, 0)
        seq = self._lib.push(handle, packed.buffer_info()[0] if packed else None,
                             len(packed) // 3, job._cells.buffer_info()[0])
        return self._track(job, int(seq), "kvoffload_queue_push")

    def push_job(self, layout: NativeLayout, job: array[int]) -> PushedJob:
        """Queue ``job`` (see :func:`encode_job`), checked and planned in C against
        ``layout``; returns at once. ``BadJobError`` (nothing queued) if the planner
        refuses it: every part is checked before any is queued, so a job is queued whole
        or not at all."""
        handle = self._live()
        seq = int(self._lib.push_job(handle, layout.handle, job.buffer_info()[0], len(job)))
        if seq == _REFUSED:
            raise BadJobError("the native planner refused the job: malformed, or a page "
                              "outside the registered memory")
        return self._track(PushedJob(job, None, seq), seq, "kvoffload_queue_push_job")

    def _track(self, job: PushedJob, seq: int, call: str) -> PushedJob:
        """``job`` as queued under ``seq`` (0: ``call`` found no memory, nothing queued),
        kept alive until seen completed."""
        if not seq:
            raise MemoryError(f"{call} failed: no memory left")
        job.seq = seq
        self._unfinished.append(job)  # atomic; ``completed`` pops under the lock
        self._last_seq = seq
        return job

    def completed(self) -> int:
        """Sequence number of the last completed job; every job before it completed too.
        After ``close``, every pushed job has completed."""
        handle = self._handle  # read once: a close elsewhere sets it to None
        if handle is None:
            return self._last_seq
        completed = int(self._lib.completed(handle))
        with self._unfinished_lock:
            unfinished = self._unfinished
            while unfinished and unfinished[0].seq <= completed:
                unfinished.popleft()
        return completed

    def wait(self, seq: int) -> None:
        """Block (without the GIL) until job ``seq`` has completed (at once after
        ``close``). Not to be called while another thread closes the queue."""
        handle = self._handle
        if handle is None:
            return
        self._lib.wait(handle, seq)  # the next ``completed`` lets go of finished jobs

    def hold(self, held: bool) -> None:
        """While held, the queue's threads take no new pieces (those taken are finished):
        for tests that need jobs to stay in flight. ``close`` copies held jobs too."""
        self._lib.hold(self._live(), int(held))

    def close(self) -> None:
        """Copy every queued job, then stop and join the threads (idempotent). Not to be
        called while another thread pushes."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._lib.free(handle)
            with self._unfinished_lock:
                self._unfinished.clear()

    def _live(self) -> int:
        if self._handle is None:
            raise RuntimeError("the native copy queue is closed")
        return self._handle


_REFUSED = 2**64 - 1
"""What the C side returns for a job its planner refuses."""


class NativeCopy:
    """Factory of native queues and layouts; :func:`load_native_copy` gives one where the
    library is built."""

    def __init__(self, path: Path) -> None:
        self._lib = _Library(path)

    def layout(self, table: array[int]) -> NativeLayout:
        """The library's copy of layout table ``table`` (see :func:`encode_layout`)."""
        return NativeLayout(self._lib, table)

    def plan_job(self, layout: NativeLayout, job: array[int]) -> list[Piece]:
        """The pieces :meth:`NativeQueue.push_job` would queue for ``job`` (all of them,
        whatever its fail-midway flag), without copying anything; ``BadJobError`` if the
        planner refuses it."""
        address = job.buffer_info()[0]
        count = self._lib.plan_job(layout.handle, address, len(job), None, 0)
        if count == _REFUSED:
            raise BadJobError("the native planner refused the job")
        if count == _REFUSED - 1:
            raise MemoryError("kvoffload_plan_job failed: no memory left")
        out = array("Q", bytes(24 * count))
        if count:
            self._lib.plan_job(layout.handle, address, len(job), out.buffer_info()[0], count)
        return [(out[3 * i], out[3 * i + 1], out[3 * i + 2]) for i in range(count)]

    def queue(self, threads: int, grab_bytes: int) -> NativeQueue:
        """A queue with ``threads`` copy threads that take about ``grab_bytes`` at a time
        (a job up to that size is copied by one thread)."""
        return NativeQueue(self._lib, threads, grab_bytes)


def _library_path() -> Path | None:
    """The built ``_copy`` library next to this module, if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = Path(__file__).with_name("_copy" + suffix)
        if candidate.is_file():
            return candidate
    return None


def load_native_copy() -> NativeCopy | None:
    """The native copy queue's library, or ``None`` where it was not built or is turned off
    by ``KVOFFLOAD_NATIVE_COPY=0``."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("%s=0: copying with ctypes.memmove", DISABLE_ENV)
        return None
    path = _library_path()
    if path is None:
        logger.info("kvoffload's native copy queue was not built (no C compiler at install?); "
                    "copying with ctypes.memmove")
        return None
    try:
        return NativeCopy(path)
    except (OSError, AttributeError):
        logger.warning("cannot load %s; copying with ctypes.memmove", path, exc_info=True)
        return None
