"""``DiskStore``: one rank's block files in the disk tier's directory.

Each block is one file, ``header + payload`` (``kvoffload.tiers.framing``), at
``kvoffload.tiers.naming.block_path``. Writes are atomic: the bytes go to a temporary file
in the same directory (gather-written straight from the host slot, no copy), optionally
``fsync``-ed, then renamed over the final name (and the directory entry ``fsync``-ed), so
a crash leaves the old file, the new one, or a temporary file -- never a torn block under a
block's name. Temporary files a crash left behind are removed when a store opens.

Reads open the file, check its size, scatter-read header and payload (the payload straight
into the host slot), and verify everything the header promises. A damaged file (wrong
size, magic, rank, layout, key or checksum) is deleted and read as a miss. Running out of
space (``ENOSPC``) or any other write error fails that block cleanly: the temporary file is
removed, nothing else changes.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence

from kvoffload.tiers.framing import (
    HEADER_BYTES,
    BytesLike,
    PayloadCheck,
    check_header,
    encode_header,
)
from kvoffload.tiers.naming import TMP_SUFFIX, block_path, rank_dir
from kvoffload.worker.block_store import BlockStore

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 30.0
_PIECE = 256 << 10
"""Bytes read per ``preadv`` on load: each piece is hashed while still in cache."""


class DiskStore(BlockStore):
    """Block files of one rank under ``<root>/<namespace>/rank<rank>`` (thread-safe)."""

    name = "disk"

    def __init__(self, root: str, ns: str, rank: int, fingerprint: bytes, *,
                 fsync: bool = True) -> None:
        """Open (create) the rank's directory and remove temporary files left by a crash.

        Args:
            root: the disk tier's directory.
            ns: the namespace fingerprint.
            rank: this worker's rank.
            fingerprint: the layout fingerprint written into and checked in every header.
            fsync: make every block durable before reporting it stored.
        """
        super().__init__()
        self.root = root
        self.namespace = ns
        self.rank = rank
        self.fingerprint = fingerprint
        self.fsync = fsync
        self.directory = rank_dir(root, ns, rank)
        os.makedirs(self.directory, exist_ok=True)
        self._made: set[str] = set()
        self._made_lock = threading.Lock()
        self._last_warning = 0.0
        self._remove_temporaries()

    # -- BlockStore ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        return [self._put(key, payload) for key, payload in items]

    def get_into(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        return [self._get(key, dest) for key, dest in items]

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            _unlink(block_path(self.root, self.namespace, self.rank, key))

    def purge(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        os.makedirs(self.directory, exist_ok=True)
        with self._made_lock:
            self._made.clear()

    # -- internals ----------------------------------------------------------------------

    def _put(self, key: bytes, payload: BytesLike) -> bool:
        path = block_path(self.root, self.namespace, self.rank, key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        data = memoryview(payload).cast("B")
        try:
            self._ensure_dir(os.path.dirname(path))
            header = encode_header(self.fingerprint, self.rank, key, data)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, [memoryview(header), data])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(os.path.dirname(path))
        except OSError as exc:
            _unlink(tmp)
            self._count(write_errors=1)
            self._warn("disk tier: could not write block %s (%s); the block is not stored",
                       key.hex()[:16], exc)
            return False
        self._count(writes=1, written_bytes=data.nbytes)
        return True

    def _get(self, key: bytes, dest: memoryview) -> bool:
        path = block_path(self.root, self.namespace, self.rank, key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._count(misses=1)
            return False
        except OSError as exc:
            self._warn("disk tier: cannot open %s (%s)", path, exc)
            return False
        problem: str | None
        try:
            size = os.fstat(fd).st_size
            if size != HEADER_BYTES + dest.nbytes:
                problem = f"{size} bytes, expected {HEADER_BYTES + dest.nbytes} (truncated?)"
            else:
                problem = self._read_verified(fd, key, dest)
        except OSError as exc:
            self._warn("disk tier: cannot read %s (%s)", path, exc)
            return False
        finally:
            os.close(fd)
        if problem is not None:
            _unlink(path)
            self._count(rejected=1)
            self._warn("disk tier: dropped block file %s: %s", path, problem)
            return False
        self._count(reads=1, read_bytes=dest.nbytes)
        return True

    def _read_verified(self, fd: int, key: bytes, dest: memoryview) -> str | None:
        """Read the header, then the payload into ``dest`` in pieces of ``_PIECE`` bytes,
        hashing each piece right after it lands (still in cache); why the block is not
        ``key``'s, or None."""
        header = bytearray(HEADER_BYTES)
        if not _read_all(fd, [memoryview(header)]):
            return "shorter than its size said (truncated while read)"
        problem = check_header(header, dest.nbytes, self.fingerprint, self.rank, key)
        if problem is not None:
            return problem
        verify = PayloadCheck(header)
        for start in range(0, dest.nbytes, _PIECE):
            piece = dest[start:start + _PIECE]
            if not _read_all(fd, [piece], HEADER_BYTES + start):
                return "shorter than its size said (truncated while read)"
            verify.update(piece)
        return verify.problem()

    def _ensure_dir(self, directory: str) -> None:
        with self._made_lock:
            if directory in self._made:
                return
        os.makedirs(directory, exist_ok=True)
        with self._made_lock:
            self._made.add(directory)

    def _remove_temporaries(self) -> None:
        removed = 0
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(TMP_SUFFIX):
                    _unlink(entry.path)
                    removed += 1
        if removed:
            logger.info("disk tier: removed %d temporary files left by an earlier run", removed)

    def _warn(self, msg: str, *args: object) -> None:
        """Log a warning at most every 30 s (a full disk fails every block)."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            logger.warning(msg, *args)
        else:
            logger.debug(msg, *args)


def _write_all(fd: int, views: list[memoryview]) -> None:
    """``writev`` until every byte of ``views`` is written."""
    views = [v for v in views if v.nbytes]
    while views:
        _advance(views, os.writev(fd, views))


def _read_all(fd: int, views: list[memoryview], offset: int = 0) -> bool:
    """``preadv`` from ``offset`` until every view is full; False if the file ends first."""
    views = [v for v in views if v.nbytes]
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            return False
        offset += n
        _advance(views, n)
    return True


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (done by one ``writev``/``preadv``)."""
    while n and views:
        if n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        logger.debug("could not remove %s", path, exc_info=True)
