"""The disk tier's directory lock and the no-follow directory opens its store relies on.

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
import os
import socket

from kvoffload.errors import ConfigError

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

    def _holder(self) -> str:
        try:
            text = os.pread(self._fd, 256, 0).decode(errors="replace").strip()
        except OSError:
            text = ""
        return text or "holder unknown"

    def _write_holder(self) -> None:
        if not os.path.samestat(os.fstat(self._fd), os.stat(self.path, follow_symlinks=False)):
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
