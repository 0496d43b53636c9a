"""The disk store's file-system primitives: its directory lock, no-follow directory opens,
exclusive temporary files, atomic small files and vectored I/O.

One engine owns a disk directory at a time: two engines on one directory would each spend
the whole byte budget and evict (delete) each other's blocks. ``DirectoryLock`` makes that
an error at start-up. Each rank's store takes ``flock(LOCK_EX | LOCK_NB)`` on
``<root>/.kvoffload-rank<r>.lock`` for its lifetime and writes ``pid <pid> on host <host>``
into it; a second engine's rank ``r`` then fails with a ``ConfigError`` naming the
directory and that holder. The lock is per rank so the ranks of one engine (one process
each, or one process in tests) do not contend; it is taken in the root, not in the
namespace, so engines of different models on one directory are refused too (they would
share its budget). ``flock`` is released by the kernel when its holder closes the file or
dies, so a lock file left behind by a crashed engine is simply taken over.

Linux, local file systems: ``flock`` on NFS is emulated with byte-range locks on some
kernels, and ``O_NOFOLLOW`` / ``O_DIRECTORY`` / ``dir_fd`` opens are POSIX but tested on
Linux only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket

from kvoffload.errors import ConfigError
from kvoffload.tiers.naming import TMP_SUFFIX

logger = logging.getLogger(__name__)

TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""Creates a new file only (never opens an existing one, never through a symlink)."""
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""Opens a directory entry only if it is a real directory (never through a symlink)."""

NOT_A_DIRECTORY = (errno.ELOOP, errno.ENOTDIR)
"""``errno`` of a ``DIR_FLAGS`` open of a symlink or of something that is not a directory."""


class Refused(OSError):  # noqa: N818 - reads as the outcome it reports
    """A directory entry the store will not use (a symlink, a FIFO, not a directory)."""


def open_subdir(parent_fd: int, name: str, *, create: bool, where: str) -> int | None:
    """Open directory ``name`` inside ``parent_fd`` without following a symlink.

    Returns its fd, or None when it does not exist and ``create`` is off. Raises
    ``Refused`` (naming ``where``) when the entry is a symlink or not a directory, and
    ``OSError`` for anything else (creating it on a read-only disk, say).
    """
    try:
        return _open_dir(parent_fd, name, where)
    except FileNotFoundError:
        if not create:
            return None
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=parent_fd)
    return _open_dir(parent_fd, name, where)


def _open_dir(parent_fd: int, name: str, where: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in NOT_A_DIRECTORY:
            raise Refused(exc.errno, "a symbolic link or not a directory", where) from None
        raise


class DirectoryLock:
    """An exclusive, non-blocking ``flock`` on one rank's lock file (module docstring)."""

    def __init__(self, root: str, rank: int) -> None:
        """Take the lock; raise ``ConfigError`` if another process holds it or the
        directory cannot be written (the disk tier needs a writable directory).

        Args:
            root: the disk tier's directory (must exist).
            rank: this worker's rank.
        """
        self.path = os.path.join(root, f".kvoffload-rank{rank}.lock")
        try:
            # A read-only descriptor holds the lock, so an idle store keeps no file open
            # for writing (the holder line is written through a short-lived second one).
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW
                               | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _unusable(root, self.path, exc) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self._fd)
            raise ConfigError(
                "disk_path", f"the disk tier directory {root} is in use by another engine "
                f"({holder}; lock file {self.path})",
                "Give each engine its own disk_path, or stop the other engine first") from None
        try:
            self._write_holder()
        except OSError as exc:
            os.close(self._fd)
            raise _unusable(root, self.path, exc) from None

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: removing it would race a newcomer."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def still_held(self) -> bool:
        """Whether the lock file on disk is still the one locked (not removed, replaced)."""
        try:
            return os.path.samestat(os.fstat(self._fd),
                                    os.stat(self.path, follow_symlinks=False))
        except OSError:
            return False

    def _holder(self) -> str:
        try:
            text = os.pread(self._fd, 256, 0).decode(errors="replace").strip()
        except OSError:
            text = ""
        return text or "holder unknown"

    def _write_holder(self) -> None:
        if not self.still_held():
            raise OSError(errno.EAGAIN, "lock file replaced while taken", self.path)
        fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
        finally:
            os.close(fd)


def _unusable(root: str, path: str, exc: OSError) -> ConfigError:
    if exc.errno == errno.ELOOP:
        problem = f"the lock file {path} is a symbolic link"
    else:
        problem = f"cannot write the lock file {path} ({exc.strerror or exc})"
    return ConfigError("disk_path", f"the disk tier directory {root} is unusable: {problem}",
                       "The disk tier needs a writable local directory of its own "
                       "(a read-only disk is refused at start-up)")


def create_exclusive(tmp: str, dir_fd: int) -> int:
    """Create ``tmp`` in ``dir_fd`` exclusively (never through a symlink); a leftover of
    this thread's name (a crash, or something planted) is removed and creation retried."""
    try:
        return os.open(tmp, TMP_FLAGS, 0o644, dir_fd=dir_fd)
    except FileExistsError:
        os.unlink(tmp, dir_fd=dir_fd)
        return os.open(tmp, TMP_FLAGS, 0o644, dir_fd=dir_fd)


def write_file(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``name`` in ``dir_fd`` atomically and durably (temporary file + rename)."""
    tmp = f"{name}.{os.getpid()}{TMP_SUFFIX}"
    fd = create_exclusive(tmp, dir_fd)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except OSError:
        unlink_quietly(tmp, dir_fd)
        raise


def write_all(fd: int, views: list[memoryview]) -> None:
    """``writev`` until every byte of ``views`` is written."""
    views = [v for v in views if v.nbytes]
    while views:
        _advance(views, os.writev(fd, views))


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``views`` (done by one ``writev``)."""
    while n and views:
        if n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        logger.debug("could not remove %s", name, exc_info=True)
