"""The block frame's checksum (XXH3-64), and file reads and writes that compute it on the way.

Every block in a lower tier carries the XXH3-64 (seed 0) of its header fields followed by its
payload (``kvoffload.blockfile.framing``). Two implementations give the same digests:

* ``NATIVE``: the C extension ``kvoffload.blockfile._checksum`` (built by ``setup.py`` where a C
  compiler exists). It hashes without holding the GIL (an AVX-512, AVX2 or SSE2 stripe
  loop where the CPU has one), and its ``read_frame`` / ``store_frame`` (the disk tier's
  read and atomic write of one block file) and ``read_hashed`` / ``write_hashed`` move a
  whole payload between a file and memory in one call without the GIL, hashing each piece
  right after it is read or written, while the kernel's copy has left it in the CPU
  cache: one pass over the bytes from memory, and I/O threads never wait for each other.
* ``PYTHON``: the ``xxhash`` package for the digest (which releases the GIL for buffers over
  64 KiB) and ``os.preadv`` / ``os.pwrite`` loops in Python for the I/O.

``checksums()`` is the one in use: ``NATIVE`` where it was built, unless
``KVOFFLOAD_NATIVE_CHECKSUM=0`` is set (read when this module is imported).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable
from types import ModuleType
from typing import Protocol

import xxhash

logger = logging.getLogger(__name__)

BytesLike = bytes | bytearray | memoryview
"""Anything with contiguous bytes."""

DISABLE_ENV = "KVOFFLOAD_NATIVE_CHECKSUM"
"""Set to ``0`` to checksum with the ``xxhash`` package even where the extension is built."""

PIECE_BYTES = 256 << 10
"""Bytes per read in ``read_hashed`` / ``read_frame``: each piece is hashed right after it
lands, while still in cache."""
WRITE_PIECE_BYTES = 512 << 10
"""Bytes per write in ``write_hashed`` / ``write_frame`` / ``store_frame``: each piece is
hashed right after it is written, while the copy into the page cache has left it in the
CPU cache (``benchmarks/disk_breakdown.c`` measures this order against hashing first).
Small enough that a piece and its page-cache copy (twice the piece) stay in a core's L2
cache (2 MiB on the machine measured) until the hash reads it: with 1 MiB pieces the hash
read them at 8-15 GB/s, with 512 KiB ones at 12-20 GB/s. Not smaller: every ``write`` call
into the page cache costs the file system a fixed amount (its inode times, a block
reservation), and 256 KiB pieces measured no faster (``docs/tiers.md``, Throughput)."""


FRAME_READ, NO_FILE, OPEN_ERROR, NOT_REGULAR, WRONG_SIZE, SHORT, READ_ERROR = range(7)
"""Outcomes of ``Checksums.read_frame``: read (``detail`` 0), no such file, another open
error (``detail``: its errno; ``ELOOP`` for a symlink), not a regular file, a file of
another size (``detail``: its size), shorter than its size said while read, a read error
(``detail``: its errno)."""

Frame = tuple[int, int, int]
"""``(outcome, detail, checksum)`` of ``Checksums.read_frame``."""

STORED, CREATE_FAILED, WRITE_FAILED, RENAME_FAILED, SYNC_DIR_FAILED = range(5)
"""Stages of ``Checksums.store_frame``: stored, or the step that failed -- creating the
temporary file, writing (or fsync-ing, or closing) it, renaming it, fsync-ing the
directory after the rename (the block file is then in place, complete, but maybe not
durable)."""

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Digest(Protocol):
    """A running XXH3-64: ``update`` with bytes, ``intdigest`` of everything so far."""

    def update(self, data: BytesLike) -> None: ...

    def intdigest(self) -> int: ...


class Checksums(Protocol):
    """One implementation of the checksum and of the hashed file I/O."""

    name: str

    def new(self) -> Digest:
        """A fresh XXH3-64 (seed 0)."""
        ...

    def read_hashed(self, fd: int, dest: memoryview, offset: int, digest: Digest) -> bool:
        """Fill ``dest`` from ``fd`` at ``offset``, feeding each piece to ``digest`` (one
        made by ``new``) as it lands; False when the file ends first (``digest`` is then
        unspecified). ``OSError`` as the reads raise it."""
        ...

    def write_hashed(self, fd: int, src: BytesLike, offset: int, digest: Digest) -> None:
        """Write all of ``src`` to ``fd`` at ``offset``, feeding each piece to ``digest``
        (one made by ``new``) once it is written. ``OSError`` as the writes raise it."""
        ...

    def read_frame(self, dir_fd: int, name: str, fields: BytesLike, header: bytearray,
                   dest: memoryview) -> Frame:
        """Read one block file: open ``name`` in ``dir_fd`` without following a symlink or
        waiting (``O_NOFOLLOW | O_NONBLOCK``), check that it is a regular file of exactly
        ``len(dest) + len(header)`` bytes, read ``dest`` from offset 0 and ``header`` (the
        trailer) after it; the checksum is the XXH3-64 of ``fields`` (the header fields the
        caller expects, which it must then find at the start of ``header``) followed by
        ``dest``, hashed while read. Returns ``(outcome, detail, checksum)`` (see
        ``FRAME_READ``; the checksum is 0 unless the frame was read); raises nothing for
        I/O errors."""
        ...

    def write_frame(self, fd: int, fields: bytes, payload: BytesLike,
                    header_bytes: int) -> None:
        """Write a frame without a MAC into the new file ``fd``: ``payload`` at offset 0,
        hashed piece by piece on its way out, then right after it the header ``fields +
        checksum (little-endian uint64) + zeros`` up to ``header_bytes``, the checksum
        being the XXH3-64 of ``fields`` followed by ``payload``. ``OSError`` as the writes
        raise it."""
        ...

    def store_frame(self, dir_fd: int, tmp: str, final: str, fields: bytes,
                    payload: BytesLike, *, header_bytes: int, sync: bool) -> tuple[int, int]:
        """The disk tier's atomic store of one block file: create ``tmp`` in ``dir_fd``
        exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``; a leftover of that name is removed
        and creation retried once), ``write_frame`` into it, ``fsync`` it when ``sync``,
        close it, rename it over ``final`` in ``dir_fd``, then ``fsync`` ``dir_fd`` when
        ``sync``. A failure before the rename removes ``tmp``. Returns ``(stage, errno)``:
        ``(STORED, 0)`` or the stage that failed (``CREATE_FAILED``...) and its errno;
        raises nothing for I/O errors (``ValueError`` for a header too small)."""
        ...


class _PythonChecksums:
    """The ``xxhash`` package and I/O loops in Python."""

    name = "python"

    def new(self) -> Digest:
        digest: Digest = xxhash.xxh3_64()
        return digest

    def read_hashed(self, fd: int, dest: memoryview, offset: int, digest: Digest) -> bool:
        view = dest.cast("B")
        for start in range(0, view.nbytes, PIECE_BYTES):
            piece = view[start:start + PIECE_BYTES]
            filled = 0
            while filled < piece.nbytes:
                n = os.preadv(fd, [piece[filled:]], offset + start + filled)
                if n == 0:
                    return False
                filled += n
            digest.update(piece)
        return True

    def write_hashed(self, fd: int, src: BytesLike, offset: int, digest: Digest) -> None:
        view = memoryview(src).cast("B")
        for start in range(0, view.nbytes, WRITE_PIECE_BYTES):
            piece = view[start:start + WRITE_PIECE_BYTES]
            written = 0
            while written < piece.nbytes:
                written += os.pwrite(fd, piece[written:], offset + start + written)
            digest.update(piece)


    def read_frame(self, dir_fd: int, name: str, fields: BytesLike, header: bytearray,
                   dest: memoryview) -> Frame:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return NO_FILE, errno.ENOENT, 0
        except OSError as exc:
            return OPEN_ERROR, exc.errno or 0, 0
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return NOT_REGULAR, 0, 0
            if info.st_size != len(header) + dest.nbytes:
                return WRONG_SIZE, info.st_size, 0
            digest = self.new()
            digest.update(fields)
            if not self.read_hashed(fd, dest, 0, digest):
                return SHORT, 0, 0
            if not self.read_hashed(fd, memoryview(header), dest.nbytes, self.new()):
                return SHORT, 0, 0
            return FRAME_READ, 0, digest.intdigest()
        except OSError as exc:
            return READ_ERROR, exc.errno or 0, 0
        finally:
            os.close(fd)

    def write_frame(self, fd: int, fields: bytes, payload: BytesLike,
                    header_bytes: int) -> None:
        _check_header_bytes(fields, header_bytes)
        digest = self.new()
        digest.update(fields)
        self.write_hashed(fd, payload, 0, digest)
        header = fields + digest.intdigest().to_bytes(8, "little")
        header += bytes(header_bytes - len(header))
        end = memoryview(payload).nbytes
        written = 0
        while written < len(header):
            written += os.pwrite(fd, header[written:], end + written)


    def store_frame(self, dir_fd: int, tmp: str, final: str, fields: bytes,
                    payload: BytesLike, *, header_bytes: int, sync: bool) -> tuple[int, int]:
        _check_header_bytes(fields, header_bytes)
        return atomic_store(dir_fd, tmp, final,
                            lambda fd: self.write_frame(fd, fields, payload, header_bytes),
                            sync=sync)


def atomic_store(dir_fd: int, tmp: str, final: str, write: Callable[[int], None], *,
                 sync: bool) -> tuple[int, int]:
    """``Checksums.store_frame``'s steps in Python, ``write(fd)`` filling the new file:
    the same ``(stage, errno)``, the same clean-up."""
    try:
        try:
            fd = os.open(tmp, _TMP_FLAGS, 0o644, dir_fd=dir_fd)
        except FileExistsError:
            os.unlink(tmp, dir_fd=dir_fd)
            fd = os.open(tmp, _TMP_FLAGS, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        return CREATE_FAILED, exc.errno or errno.EIO
    stage = WRITE_FAILED
    try:
        try:
            write(fd)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        stage = RENAME_FAILED
        os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        stage = SYNC_DIR_FAILED
        if sync:
            os.fsync(dir_fd)
    except OSError as exc:
        if stage != SYNC_DIR_FAILED:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
        return stage, exc.errno or errno.EIO
    return STORED, 0


def _check_header_bytes(fields: bytes, header_bytes: int) -> None:
    if not len(fields) + 8 <= header_bytes <= 4096:
        raise ValueError(f"header_bytes must be in [len(fields) + 8, 4096], got "
                         f"{header_bytes}")


class _NativeDigest:
    """XXH3-64 in the extension; its state is a ``bytearray`` the C code works in."""

    __slots__ = ("_lib", "state")

    def __init__(self, lib: ModuleType) -> None:
        self._lib = lib
        self.state = bytearray(lib.STATE_BYTES)
        lib.xxh3_init(self.state)

    def update(self, data: BytesLike) -> None:
        self._lib.xxh3_update(self.state, data)

    def intdigest(self) -> int:
        return int(self._lib.xxh3_digest(self.state))


class _NativeChecksums:
    """The C extension: hashing and hashed I/O without the GIL."""

    name = "native"

    def __init__(self, lib: ModuleType) -> None:
        self._lib = lib

    def new(self) -> Digest:
        return _NativeDigest(self._lib)

    def read_hashed(self, fd: int, dest: memoryview, offset: int, digest: Digest) -> bool:
        read = self._lib.pread_hashed(fd, dest, offset, _state(digest), PIECE_BYTES)
        return bool(read == dest.nbytes)

    def write_hashed(self, fd: int, src: BytesLike, offset: int, digest: Digest) -> None:
        self._lib.pwrite_hashed(fd, src, offset, _state(digest), WRITE_PIECE_BYTES)

    def read_frame(self, dir_fd: int, name: str, fields: BytesLike, header: bytearray,
                   dest: memoryview) -> Frame:
        outcome, detail, checksum = self._lib.read_frame(dir_fd, name, fields, header,
                                                         dest, PIECE_BYTES)
        return int(outcome), int(detail), int(checksum)

    def write_frame(self, fd: int, fields: bytes, payload: BytesLike,
                    header_bytes: int) -> None:
        _check_header_bytes(fields, header_bytes)
        self._lib.write_frame(fd, fields, payload, header_bytes, WRITE_PIECE_BYTES)

    def store_frame(self, dir_fd: int, tmp: str, final: str, fields: bytes,
                    payload: BytesLike, *, header_bytes: int, sync: bool) -> tuple[int, int]:
        stage, error = self._lib.store_frame(dir_fd, tmp, final, fields, payload, header_bytes,
                                             WRITE_PIECE_BYTES, sync)
        return int(stage), int(error)

    def kernels(self) -> tuple[str, ...]:
        """The stripe loops this CPU runs (``scalar``, then ``sse2``, ``avx2`` and
        ``avx512`` on x86-64 CPUs that have them)."""
        return tuple(self._lib.kernels())

    def kernel(self) -> str:
        """The stripe loop in use (the widest this CPU runs)."""
        return str(self._lib.kernel())

    def use_kernel(self, name: str) -> None:
        """Switch the stripe loop for the whole process (tests compare them);
        ``ValueError`` for one this CPU does not run."""
        self._lib.use_kernel(name)


def _state(digest: Digest) -> bytearray:
    if not isinstance(digest, _NativeDigest):
        raise TypeError(f"the native checksum I/O needs a digest from its own new(), "
                        f"not {type(digest).__name__}")
    return digest.state


def _load_native() -> _NativeChecksums | None:
    try:
        from kvoffload.blockfile import _checksum  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _NativeChecksums(_checksum)


PYTHON: Checksums = _PythonChecksums()
NATIVE: _NativeChecksums | None = _load_native()
"""The extension, or None where it was not built (no C compiler at install)."""


def _choose() -> Checksums:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("%s=0: block checksums with the xxhash package", DISABLE_ENV)
        return PYTHON
    if NATIVE is None:
        logger.info("kvoffload's native checksum was not built (no C compiler at install?); "
                    "block checksums with the xxhash package")
        return PYTHON
    return NATIVE


_ACTIVE = _choose()


def checksums() -> Checksums:
    """The implementation in use (see the module docstring)."""
    return _ACTIVE
