"""The CPU backend's native copy queue (``_copy.c``), when the install built it.

Python pushes a job, as pages (block ids and slots, which C checks and turns into pieces)
or as ready-made pieces ``(destination, source, bytes)``, and returns at once; C threads
copy them with no Python involved, so copies overlap the planning of the next jobs and
several threads copy in parallel without handing the GIL back and forth between pages.
Jobs complete in push order. Without the library (no C compiler at install, or
``KVOFFLOAD_NATIVE_COPY=0``) the CPU backend copies piece by piece with ``ctypes.memmove``
from Python threads (``MemmoveCpuBackend``): the same bytes, slower.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import threading
from array import array
from collections import deque
from collections.abc import Iterable
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
        self.push_pages = _declare(quick.kvoffload_queue_push_pages, [ptr, ptr], u64)
        self.plan_pages = _declare(quick.kvoffload_plan_pages, [ptr, ptr, u64], u64)
        self.hold = _declare(quick.kvoffload_queue_hold, [ptr, ctypes.c_int], None)
        self.completed = _declare(quick.kvoffload_queue_completed, [ptr], u64)


def _declare(function: Any, argtypes: list[Any], restype: Any) -> Any:
    function.argtypes = argtypes
    function.restype = restype
    return function


class PushedJob:
    """A job in a :class:`NativeQueue`: its sequence number, and the memory the C threads
    read and write until it completes (kept alive here)."""

    __slots__ = ("_packed", "_seconds", "seq")

    def __init__(self, packed: array[int] | None, seq: int) -> None:
        self._packed = packed
        self._seconds = array("d", [0.0])
        self.seq = seq

    @property
    def seconds(self) -> float:
        """Time the job alone held the queue (valid once it completed)."""
        return float(self._seconds[0])


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
        self._last_seq = 0  # the last job pushed
        """Pushed jobs not yet seen completed: the C threads write their memory (the
        pieces, the seconds cell), so it stays alive here whatever the caller keeps."""

    def push(self, packed: array[int]) -> PushedJob:
        """Queue the pieces of ``packed`` (see :func:`pack`) as one job; returns at once."""
        handle = self._live()
        job = PushedJob(packed, 0)
        seq = self._lib.push(handle, packed.buffer_info()[0] if packed else None,
                             len(packed) // 3, job._seconds.buffer_info()[0])
        return self._track(job, int(seq), "kvoffload_queue_push")

    def push_pages(self, segments: array[int], block_ids: array[int], slots: array[int], *,
                   num_blocks: int, num_slots: int, slot_bytes: int, factor: int, skip: int,
                   store: bool, chunk: int, sort_bytes: int,
                   fail_midway: bool = False) -> PushedJob:
        """Queue one job given as pages; the queue builds (and owns) its pieces.

        ``segments`` holds four ``uint64`` per page segment: engine address of block 0,
        bytes between engine blocks, page bytes, arena address of the segment's sub-block 0
        in slot 0. Page ``i`` is engine block ``block_ids[i]`` and sub-block ``p % factor``
        of slot ``slots[p // factor]``, ``p = skip + i``, for ``int64`` arrays
        ``block_ids`` and ``slots``. The C side checks every block id against
        ``[0, num_blocks)`` and every slot against ``[0, num_slots)`` (``IndexError``,
        nothing queued, otherwise); the segments must describe memory holding that many
        blocks and slots. Pages contiguous on both sides merge, runs are cut at ``chunk``
        bytes, pieces averaging ``sort_bytes`` or more are copied in source address order;
        ``fail_midway`` copies only the first half of the pieces (fault injection).
        """
        handle = self._live()
        job = PushedJob(None, 0)
        pages = _pages(segments, block_ids, slots, num_blocks=num_blocks, num_slots=num_slots,
                       slot_bytes=slot_bytes, factor=factor, skip=skip, store=store,
                       chunk=chunk, sort_bytes=sort_bytes, fail_midway=fail_midway,
                       seconds=job._seconds.buffer_info()[0])
        seq = int(self._lib.push_pages(handle, pages.buffer_info()[0]))
        if seq == _OUT_OF_BOUNDS:
            raise IndexError(f"a page lies outside the registered memory (block ids in "
                             f"[0, {num_blocks}), slots in [0, {num_slots}))")
        return self._track(job, seq, "kvoffload_queue_push_pages")

    def _track(self, job: PushedJob, seq: int, call: str) -> PushedJob:
        """``job`` as queued under ``seq`` (0: ``call`` found no memory, nothing queued),
        kept alive until seen completed."""
        if not seq:
            raise MemoryError(f"{call} failed: no memory left")
        job.seq = seq
        with self._unfinished_lock:
            self._unfinished.append(job)
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


_OUT_OF_BOUNDS = 2**64 - 1
"""What the C side returns for a page outside the registered memory."""


def _pages(segments: array[int], block_ids: array[int], slots: array[int], *,
           num_blocks: int, num_slots: int, slot_bytes: int, factor: int, skip: int,
           store: bool, chunk: int, sort_bytes: int, fail_midway: bool,
           seconds: int) -> array[int]:
    """A ``kvoffload_pages`` struct (fifteen ``uint64``, see ``_copy.c``) for these pages;
    the arrays it points into must outlive the call that reads it. Raises ``ValueError``
    unless ``slots`` has exactly the slots the pages need."""
    if factor < 1 or not 0 <= skip < factor or \
            len(slots) != -(-(skip + len(block_ids)) // factor):
        raise ValueError(f"{len(block_ids)} pages from sub-block {skip} with factor "
                         f"{factor} need {-(-(skip + len(block_ids)) // factor)} slots, got "
                         f"{len(slots)}")
    return array("Q", (segments.buffer_info()[0], len(segments) // 4,
                       block_ids.buffer_info()[0], slots.buffer_info()[0], len(block_ids),
                       num_blocks, num_slots, slot_bytes, factor, skip, int(store), chunk,
                       sort_bytes, int(fail_midway), seconds))


class NativeCopy:
    """Factory of native queues; :func:`load_native_copy` gives one where the library is
    built."""

    def __init__(self, path: Path) -> None:
        self._lib = _Library(path)

    def plan_pages(self, segments: array[int], block_ids: array[int], slots: array[int], *,
                   num_blocks: int, num_slots: int, slot_bytes: int, factor: int, skip: int,
                   store: bool, chunk: int, sort_bytes: int) -> list[Piece]:
        """The pieces :meth:`NativeQueue.push_pages` would queue for these pages (same
        arguments), without copying anything."""
        pages = _pages(segments, block_ids, slots, num_blocks=num_blocks, num_slots=num_slots,
                       slot_bytes=slot_bytes, factor=factor, skip=skip, store=store,
                       chunk=chunk, sort_bytes=sort_bytes, fail_midway=False, seconds=0)
        address = pages.buffer_info()[0]
        count = self._lib.plan_pages(address, None, 0)
        if count == _OUT_OF_BOUNDS:
            raise IndexError("a page lies outside the registered memory")
        if count == _OUT_OF_BOUNDS - 1:
            raise MemoryError("kvoffload_plan_pages failed: no memory left")
        out = array("Q", bytes(24 * count))
        if count:
            self._lib.plan_pages(address, out.buffer_info()[0], count)
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
