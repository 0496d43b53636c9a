"""The disk tier's block files, each stored and each read in one call.

``DiskStore`` (``kvoffload.worker.disk_store``) owns the directories; this module moves one
block between a host slot and its file in a fan-out directory it is given as an fd.

``store_block(using, dir_fd, final, fields, payload, mac_key=..., sync=...)`` stores
``payload + header`` (the frame of ``kvoffload.blockfile.framing``, its header last: a disk
file's payload starts at offset 0, page aligned) as ``final`` in ``dir_fd``, atomically:
the bytes go straight from ``payload`` (no copy) into a temporary file made with
``O_CREAT | O_EXCL | O_NOFOLLOW`` (named per process and thread, so concurrent writers of
one block never share it), which is ``fsync``-ed when ``sync``, closed, renamed over
``final`` (never through a symlink), then the directory is ``fsync``-ed when ``sync``. A
crash leaves the old file, the new one or a temporary file -- never a torn block under a
block's name. It returns once the block is in place (and, with ``sync``, durable), or
raises ``OSError`` carrying the failing step's errno (``FileNotFoundError`` when the
directory went, which the caller may handle by making it again and retrying), its
``filename`` the temporary file's name; the temporary file is then gone, except after a
failed directory ``fsync``, when the complete block file is already in place. Without a
MAC key the whole store is one call of ``Checksums.store_frame``: with the native
extension it never holds the GIL, hashing each piece of the payload as it is written and
writing the header last. With a key the MAC needs the checksum first: the payload is
hashed, the header sealed, then both written with the same steps in Python.

``read_block(using, dir_fd, name, dest, fingerprint=..., rank=..., key=..., mac_key=...)``
reads block file ``name`` into ``dest`` (one ``Checksums.read_frame``: no symlink
followed, no wait on a FIFO, a regular file of exactly ``len(dest) + HEADER_BYTES`` bytes,
hashed while read) and verifies everything the header promises: its fields must be
byte for byte the ones this block's ``header_fields`` gives (magic, version, fingerprint,
rank, key, size), then the checksum and, with a key, the MAC. It returns ``(outcome,
detail, problem)``: ``(FRAME_READ, 0, None)`` only when all of it holds -- then ``dest``
holds the stored payload; otherwise an outcome of ``kvoffload.blockfile.checksum``
(``NO_FILE``, ``OPEN_ERROR``, ...) or ``DAMAGED`` (read whole, but it does not verify), and
for a damaged, short or wrong-sized file the reason in words. ``dest`` is unspecified
unless the outcome is ``FRAME_READ``: a caller must never hand it on otherwise.
"""

from __future__ import annotations

import os
import threading

from kvoffload.blockfile.checksum import (
    FRAME_READ,
    SHORT,
    STORED,
    SYNC_DIR_FAILED,
    WRONG_SIZE,
    Checksums,
    atomic_store,
)
from kvoffload.blockfile.framing import (
    FIELDS_BYTES,
    HEADER_BYTES,
    MacKey,
    check_header,
    check_payload,
    header_fields,
    new_digest,
    seal,
)
from kvoffload.tiers.naming import TMP_SUFFIX
from kvoffload.worker.disk_fs import write_all

DAMAGED = -1
"""``read_block``: the file was read whole but its header or checksum does not verify."""

_STEPS = ("stored", "cannot create the temporary file", "cannot write the temporary file",
          "cannot rename the temporary file", "cannot fsync the directory after the rename")


def tmp_name(final: str) -> str:
    """The temporary file ``store_block`` writes ``final`` through (this process, thread)."""
    return f"{final}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"


def store_block(using: Checksums, dir_fd: int, final: str, fields: bytes,
                payload: memoryview, *, mac_key: MacKey | None, sync: bool) -> None:
    """Store ``fields``' frame of ``payload`` as ``final`` in ``dir_fd`` (module docstring).

    Args:
        using: the checksum implementation.
        dir_fd: the (fan-out) directory.
        final: the block file's name.
        fields: the frame's ``header_fields``.
        payload: the block's bytes (a byte view).
        mac_key: MAC the frame with it (None: the checksum only).
        sync: make the file and its directory entry durable before returning.

    Raises:
        OSError: a step failed (its errno; ``filename``: the temporary file).
    """
    tmp = tmp_name(final)
    if mac_key is None:
        stage, error = using.store_frame(dir_fd, tmp, final, fields, payload,
                                         header_bytes=HEADER_BYTES, sync=sync)
    else:
        digest = new_digest(fields, using)
        digest.update(payload)
        header = memoryview(seal(fields, digest.intdigest(), payload, mac_key=mac_key))
        stage, error = atomic_store(dir_fd, tmp, final,
                                    lambda fd: write_all(fd, [payload, header]), sync=sync)
    if stage != STORED:
        where = "" if stage != SYNC_DIR_FAILED else " (the block file is in place)"
        raise OSError(error, f"{_STEPS[stage]}{where}: {os.strerror(error)}", tmp)


def read_block(using: Checksums, dir_fd: int, name: str, dest: memoryview, *,
               fingerprint: bytes, rank: int, key: bytes,
               mac_key: MacKey | None) -> tuple[int, int, str | None]:
    """Read and verify block file ``name`` of ``dir_fd`` into ``dest`` (module docstring).

    Returns:
        ``(outcome, detail, problem)``: ``FRAME_READ`` when ``dest`` holds the verified
        payload; else the outcome (``kvoffload.blockfile.checksum``'s, or ``DAMAGED``), its
        detail (an errno, or a wrong size) and, for a file to drop, why in words.
    """
    fields = header_fields(fingerprint, rank, key, dest.nbytes)
    header = bytearray(HEADER_BYTES)
    outcome, detail, checksum = using.read_frame(dir_fd, name, fields, header, dest)
    if outcome == FRAME_READ:
        problem = check_header(header, dest.nbytes, fingerprint, rank, key)
        if problem is None and header[:FIELDS_BYTES] != fields:  # what was hashed
            problem = "header fields that are not this block's (corrupt block)"
        problem = problem or check_payload(header, checksum, dest, mac_key=mac_key)
        return (FRAME_READ, 0, None) if problem is None else (DAMAGED, 0, problem)
    if outcome == WRONG_SIZE:
        return outcome, detail, (f"{detail} bytes, expected {dest.nbytes + HEADER_BYTES} "
                                 "(truncated?)")
    if outcome == SHORT:
        return outcome, detail, "shorter than its size said (truncated while read)"
    return outcome, detail, None

