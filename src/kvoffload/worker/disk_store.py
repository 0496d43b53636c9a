"""``DiskStore``: one rank's block files in the disk tier's directory.

Each block is one file, ``payload + header`` (the frame of ``kvoffload.blockfile.framing``
with its header last, so the payload starts the file, page aligned), at
``kvoffload.tiers.naming.block_path``. The store owns the directories (lock, rank and
fan-out directories, epoch, purge); each block file is stored and read in one call of
``kvoffload.worker.disk_frames``. Writes are atomic: the bytes go to a temporary file in
the same directory (written straight from the host slot, no copy), optionally
``fsync``-ed, then renamed over the final name (and the directory entry ``fsync``-ed), so
a crash leaves the old file, the new one, or a temporary file -- never a torn block under a
block's name. Temporary files a crash left behind are removed when a store opens.

Reads open the file, check its size, read the payload straight into the host slot and
the header after it, and verify everything the header promises. The checksum is computed on the way
(``kvoffload.blockfile.checksum``): each piece of the payload is hashed right after it is read
or written, while still in the CPU cache -- with the native extension
the whole store or read of a block is one call that never holds the GIL. A damaged file
(wrong size, magic, rank, layout, key or checksum -- or, with a MAC key, a MAC that does
not verify) is deleted and read as a miss. Running out of space (``ENOSPC``) or any other
write error fails that block cleanly: the temporary file is removed, nothing else changes.

What the directory is trusted with. Only the directory the configuration names
(``disk_path``) is trusted; everything below it may be hostile:

* The store holds its rank's lock (``kvoffload.worker.disk_lock.DirectoryLock``) for its
  lifetime: a second engine on the directory fails at start-up with a ``ConfigError``
  naming the holder; a read-only directory is refused the same way.
* ``<namespace>``, ``rank<r>`` and the fan-out directories are opened with
  ``O_DIRECTORY | O_NOFOLLOW`` and every file is opened relative to its directory's fd:
  a symlinked directory is never entered, whatever races with the check.
* Block files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be regular files
  (``fstat``): a symlink, a FIFO, a device or a directory in a block's place is *refused*
  -- a miss, counted in ``stats.refused`` and logged once at WARNING with its path, left in
  place -- never data and never a wait. Temporary files are created with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` and renamed within the fan-out directory, so a write
  never goes through a symlink (a rename replaces a planted link, never its target).

Purge and the epoch. ``purge`` first writes a new random *epoch* into ``rank<r>/EPOCH``
(atomically); from then on the store's header fingerprint is derived from the layout
fingerprint and that epoch, so every block written before reads as foreign -- to this
store and to a restarted one, which reads the marker when it opens. It then removes
everything else under ``rank<r>``. When every entry went, the marker is removed again (no
old block remains to fence). When something could not be removed, ``purge`` logs an error
and raises ``StoreError``; the blocks left are fenced by the epoch if the marker was
written. If not even the marker could be written (a read-only disk), nothing fences them:
the error says so, and a restarted engine refuses the directory while it stays read-only
(its lock file cannot be written).

``close`` releases the lock and the directory fds; it must run after the I/O threads
stopped (``TierIO.shutdown`` skips it for a store whose thread is stuck). A ``purge`` must
not run concurrently with other calls of the same store (``TierIO`` orders it).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Sequence

from kvoffload.blockfile.checksum import (
    FRAME_READ,
    NO_FILE,
    NOT_REGULAR,
    OPEN_ERROR,
    READ_ERROR,
    Checksums,
    checksums,
)
from kvoffload.blockfile.framing import FINGERPRINT_BYTES, BytesLike, MacKey, header_fields
from kvoffload.errors import ConfigError
from kvoffload.tiers.naming import BLOCK_SUFFIX, TMP_SUFFIX, rank_dir
from kvoffload.worker.block_store import BlockStore, StoreError
from kvoffload.worker.disk_frames import read_block, store_block
from kvoffload.worker.disk_fs import (
    DirectoryLock,
    Refused,
    open_subdir,
    unlink_quietly,
    write_file,
)

logger = logging.getLogger(__name__)

_WARN_EVERY_S = 30.0
EPOCH_FILE = "EPOCH"
"""``rank<r>/EPOCH``: the epoch a purge that may leave blocks behind writes first."""
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_REFUSED_NAMED = 1024
"""Refused paths remembered (each is warned about once); beyond, warnings go to DEBUG."""


class DiskStore(BlockStore):
    """Block files of one rank under ``<root>/<namespace>/rank<rank>`` (thread-safe)."""

    name = "disk"

    def __init__(self, root: str, ns: str, rank: int, fingerprint: bytes, *,
                 fsync: bool = True, mac_key: MacKey | None = None,
                 using: Checksums | None = None) -> None:
        """Lock the directory, open (create) the rank's directory, read its epoch and
        remove temporary files left by a crash.

        Args:
            root: the disk tier's directory (trusted; created if missing).
            ns: the namespace fingerprint.
            rank: this worker's rank.
            fingerprint: the layout fingerprint written into and checked in every header
                (combined with the directory's epoch, if a purge left one).
            fsync: make every block durable before reporting it stored.
            mac_key: MAC every file with it and accept only files whose MAC verifies
                (None: unkeyed checksums only; ``kvoffload.blockfile.framing``).
            using: the checksum implementation (default ``checksums()``: the native one
                where it was built; ``kvoffload.blockfile.checksum``).

        Raises:
            ConfigError: another engine holds the directory, it cannot be written (a
                read-only disk), or a directory below it is a symlink.
        """
        super().__init__()
        self.root = root
        self.namespace = ns
        self.rank = rank
        self.fingerprint = fingerprint
        self.fsync = fsync
        self._mac_key = mac_key
        self._checksums = using or checksums()
        self.directory = rank_dir(root, ns, rank)
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise ConfigError("disk_path", f"cannot create the disk tier directory {root} "
                              f"({exc.strerror or exc})",
                              "Point disk_path at a writable local directory") from None
        self._lock = DirectoryLock(root, rank)
        self._fans: dict[str, int] = {}
        self._fans_lock = threading.Lock()
        self._retired: list[int] = []
        self._reopen_lock = threading.Lock()
        self._refused: set[str] = set()
        self._last_warning = 0.0
        try:
            self._rank_fd = self._open_rank_dir()
            self._fp = _epoch_fingerprint(fingerprint, self._read_epoch())
            self._remove_temporaries()
        except BaseException:
            self._lock.release()
            raise

    # -- BlockStore ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        return [self._put(key, payload) for key, payload in items]

    def get_into(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        return [self._get(key, dest) for key, dest in items]

    def delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            name = key.hex()
            fan = self._fan_fd(name[:2], create=False)
            if fan is not None:
                unlink_quietly(name + BLOCK_SUFFIX, fan)

    def purge(self) -> None:
        """Remove every block of this rank; raise ``StoreError`` (after logging it) when
        some could not be removed. See the module docstring for the epoch that fences
        what is left."""
        epoch = secrets.token_hex(16).encode()
        try:
            write_file(self._rank_fd, EPOCH_FILE, epoch)
        except OSError as exc:
            fence_error: OSError | None = exc
        else:
            fence_error = None
            self._fp = _epoch_fingerprint(self.fingerprint, epoch)
        self._close_fans()
        failures = self._remove_all()
        if not failures:
            if fence_error is None:
                self._unfence()
            return
        first = failures[0]
        fate = ("they are fenced: this and any restarted engine read them as foreign"
                if fence_error is None else
                f"NOTHING fences them (the epoch marker could not be written either: "
                f"{fence_error.strerror or fence_error}); a restarted engine refuses this "
                "directory while it cannot be written, but would serve them once it can")
        msg = (f"disk tier: purge of {self.directory} failed: {len(failures)} entries could "
               f"not be removed (first: {first.filename}: {first.strerror or first}); {fate}")
        logger.error(msg)
        raise StoreError(msg)

    def close(self) -> None:
        """Close the directory fds and release the lock (idempotent)."""
        self._close_fans()
        for fd in [self._rank_fd, *self._retired]:
            if fd >= 0:
                os.close(fd)
        self._rank_fd, self._retired = -1, []
        self._lock.release()

    # -- internals ----------------------------------------------------------------------

    def _put(self, key: bytes, payload: BytesLike) -> bool:
        final = key.hex() + BLOCK_SUFFIX
        data = memoryview(payload).cast("B")
        try:
            for attempt in (0, 1):
                fan = self._writable_fan(final[:2])  # may re-read the epoch: first
                fields = header_fields(self._fp, self.rank, key, data.nbytes)
                try:
                    store_block(self._checksums, fan, final, fields, data,
                                mac_key=self._mac_key, sync=self.fsync)
                    break
                except FileNotFoundError:
                    if attempt:
                        raise
                    with self._fans_lock:  # the fan-out directory went: look it up again
                        if self._fans.get(final[:2]) == fan:
                            self._retired.append(self._fans.pop(final[:2]))
        except (OSError, ValueError) as exc:  # ValueError: a key too long to frame
            self._count(write_errors=1)
            self._warn("disk tier: could not write block %s (%s); the block is not stored",
                       key.hex()[:16], exc)
            return False
        self._count(writes=1, written_bytes=data.nbytes)
        return True

    def _writable_fan(self, sub: str) -> int:
        """The fd of fan-out directory ``sub``, made if missing (a rank directory removed
        under the store is made again); ``Refused`` for a symlink in its place."""
        try:
            fan = self._fan_fd(sub, create=True)
        except FileNotFoundError:  # the rank directory went (removed by hand)
            self._reopen_rank_dir()
            fan = self._fan_fd(sub, create=True)
        if fan is None:
            raise Refused(0, "refused fan-out directory", os.path.join(self.directory, sub))
        return fan

    def _reopen_rank_dir(self) -> None:
        """Open (make) ``rank<r>`` again. Fds other threads may still use are retired, not
        closed (a reused fd number would send their opens elsewhere); ``close`` closes them."""
        with self._reopen_lock:
            if os.fstat(self._rank_fd).st_nlink > 0 and self._lock.still_held():
                return  # another thread did it already
            os.makedirs(self.root, exist_ok=True)  # the root too may have been removed
            if not self._lock.still_held():  # it was: the lock file went with it
                try:
                    lock = DirectoryLock(self.root, self.rank)
                except ConfigError as exc:  # another engine took the directory meanwhile
                    raise OSError(errno.EBUSY, str(exc), self.root) from None
                self._lock.release()
                self._lock = lock
            fd = self._open_chain()
            with self._fans_lock:
                self._retired.extend([self._rank_fd, *self._fans.values()])
                self._rank_fd, self._fans = fd, {}
            try:  # an epoch marker went with the old directory
                self._fp = _epoch_fingerprint(self.fingerprint, self._read_epoch())
            except ConfigError as exc:
                raise OSError(errno.EIO, str(exc), self.directory) from None

    def _get(self, key: bytes, dest: memoryview) -> bool:
        name = key.hex()
        fan = self._fan_fd(name[:2], create=False)
        if fan is None:
            self._count(misses=1)
            return False
        outcome, detail, problem = read_block(
            self._checksums, fan, name + BLOCK_SUFFIX, dest, fingerprint=self._fp,
            rank=self.rank, key=key, mac_key=self._mac_key)
        if outcome == FRAME_READ:
            self._count(reads=1, read_bytes=dest.nbytes)
            return True
        if outcome == NO_FILE:
            self._count(misses=1)
            return False
        path = os.path.join(self.directory, name[:2], name + BLOCK_SUFFIX)
        if outcome == OPEN_ERROR and detail == errno.ELOOP:  # O_NOFOLLOW met a symlink
            self._refuse(path, "a symbolic link")
        elif outcome == NOT_REGULAR:
            self._refuse(path, "not a regular file")
        elif outcome in (OPEN_ERROR, READ_ERROR):
            self._warn("disk tier: cannot %s %s (%s)", "open" if outcome == OPEN_ERROR
                       else "read", path, os.strerror(detail))
        else:  # damaged, truncated, another size: never served, dropped
            unlink_quietly(name + BLOCK_SUFFIX, fan)
            self._count(rejected=1)
            self._warn("disk tier: dropped block file %s: %s", path, problem)
        return False

    def _fan_fd(self, sub: str, *, create: bool) -> int | None:
        """The (cached) fd of fan-out directory ``sub``; None if it is missing (and
        ``create`` is off) or refused (not a real directory; warned about once)."""
        with self._fans_lock:
            fd = self._fans.get(sub)
        if fd is not None:
            return fd
        where = os.path.join(self.directory, sub)
        try:
            fd = open_subdir(self._rank_fd, sub, create=create, where=where)
        except Refused:
            self._refuse(where, "a symbolic link or not a directory (fan-out directory)")
            return None
        if fd is None:
            return None
        with self._fans_lock:
            cached = self._fans.setdefault(sub, fd)
        if cached != fd:
            os.close(fd)
        return cached

    def _close_fans(self) -> None:
        with self._fans_lock:
            fans, self._fans = self._fans, {}
        for fd in fans.values():
            os.close(fd)

    def _open_rank_dir(self) -> int:
        """``_open_chain``, its failures as a ``ConfigError`` (at start-up)."""
        try:
            return self._open_chain()
        except OSError as exc:
            problem = "is a symbolic link or not a directory" if isinstance(exc, Refused) \
                else f"cannot be created ({exc.strerror or exc})"
            raise ConfigError("disk_path", f"{exc.filename} {problem}",
                              "Remove it; the disk tier owns everything below disk_path"
                              ) from None

    def _open_chain(self) -> int:
        """The fd of ``rank<r>``, made if missing, every directory below the root opened
        without following a symlink (``Refused`` if one is a symlink)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        where = self.root
        try:
            for part in (self.namespace, f"rank{self.rank}"):
                where = os.path.join(where, part)
                sub = open_subdir(fd, part, create=True, where=where)
                assert sub is not None
                os.close(fd)
                fd = sub
        except OSError as exc:
            os.close(fd)
            exc.filename = where
            raise
        return fd

    def _read_epoch(self) -> bytes | None:
        """The epoch a failed purge left (``rank<r>/EPOCH``), or None."""
        path = os.path.join(self.directory, EPOCH_FILE)
        try:
            fd = os.open(EPOCH_FILE, _READ_FLAGS, dir_fd=self._rank_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigError("disk_path", f"cannot read the epoch marker {path} "
                              f"({exc.strerror or exc})", "Remove the rank directory "
                              f"{self.directory} (its blocks cannot be trusted)") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError("disk_path", f"the epoch marker {path} is not a regular "
                                  "file", f"Remove the rank directory {self.directory}")
            return os.pread(fd, 256, 0)
        finally:
            os.close(fd)

    def _unfence(self) -> None:
        """After a complete purge: drop the epoch (nothing older is left to fence)."""
        try:
            os.unlink(EPOCH_FILE, dir_fd=self._rank_fd)
        except OSError:
            logger.debug("could not remove the epoch marker", exc_info=True)
            return
        self._fp = self.fingerprint

    def _remove_all(self) -> list[OSError]:
        """Remove everything under ``rank<r>`` but the epoch marker; the errors."""
        errors: list[OSError] = []
        with os.scandir(self._rank_fd) as entries:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for name, is_dir in names:
            if name == EPOCH_FILE:
                continue
            try:
                if is_dir:
                    errors.extend(_remove_tree(name, self._rank_fd))
                else:
                    os.unlink(name, dir_fd=self._rank_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                errors.append(exc)
        for err in errors:
            if err.filename is not None and not os.path.isabs(os.fsdecode(err.filename)):
                err.filename = os.path.join(self.directory, os.fsdecode(err.filename))
        return errors

    def _remove_temporaries(self) -> None:
        with os.scandir(self._rank_fd) as entries:
            listing = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        subs = [name for name, is_dir in listing if is_dir]
        stale = [name for name, is_dir in listing if not is_dir and name.endswith(TMP_SUFFIX)]
        for name in stale:  # an epoch marker's
            unlink_quietly(name, self._rank_fd)
        removed = len(stale)
        for sub in subs:
            fan = self._fan_fd(sub, create=False)
            if fan is None:
                continue
            with os.scandir(fan) as entries:
                names = [e.name for e in entries if e.name.endswith(TMP_SUFFIX)]
            for name in names:
                unlink_quietly(name, fan)
                removed += 1
        if removed:
            logger.info("disk tier: removed %d temporary files left by an earlier run", removed)

    def _refuse(self, path: str, reason: str) -> None:
        """Count a refused entry; warn once per path."""
        self._count(refused=1)
        with self._fans_lock:
            first = path not in self._refused and len(self._refused) < _MAX_REFUSED_NAMED
            if first:
                self._refused.add(path)
        (logger.warning if first else logger.debug)(
            "disk tier: refusing %s: %s; read as a miss, never written through, left in "
            "place", path, reason)

    def _warn(self, msg: str, *args: object) -> None:
        """Log a warning at most every 30 s (a full disk fails every block)."""
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            logger.warning(msg, *args)
        else:
            logger.debug(msg, *args)


def _epoch_fingerprint(fingerprint: bytes, epoch: bytes | None) -> bytes:
    """The header fingerprint of blocks written in ``epoch`` (the plain one without)."""
    if epoch is None:
        return fingerprint
    return hashlib.sha256(fingerprint + b"|epoch|" + epoch).digest()[:FINGERPRINT_BYTES]


def _remove_tree(name: str, parent_fd: int) -> list[OSError]:
    """Remove directory ``name`` of ``parent_fd`` and everything under it, never following
    a symlink (a link is removed, not its target); return what could not be removed.
    (``shutil.rmtree`` takes ``dir_fd`` only from Python 3.11.)"""
    errors: list[OSError] = []

    def remove(entry: str, dir_fd: int, is_dir: bool, where: str = "") -> None:
        try:
            if is_dir and not stat.S_ISLNK(os.lstat(entry, dir_fd=dir_fd).st_mode):
                os.rmdir(entry, dir_fd=dir_fd)
            else:
                os.unlink(entry, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            exc.filename = os.path.join(where, entry)  # relative to the rank directory
            errors.append(exc)

    walk = os.fwalk(name, topdown=False, dir_fd=parent_fd, follow_symlinks=False,
                    onerror=errors.append)
    for path, dirnames, filenames, dir_fd in walk:
        for entry in filenames:
            remove(entry, dir_fd, False, path)
        for entry in dirnames:
            remove(entry, dir_fd, True, path)
    remove(name, parent_fd, is_dir=True)
    return errors
