"""The framing of a block stored in a lower tier: a fixed header, then the payload.

Every block on disk or on the remote server is ``header + payload``, where the payload is
exactly the block's bytes in a host slot (``HostPool.slot_view(slot, group)``). The header
says what the block is and carries a checksum, so a reader can prove it got the block it
asked for, whole::

    offset size field
    0      4    magic b"KVOB"
    4      2    format version (1)
    6      2    rank that wrote it
    8      16   layout fingerprint (namespace + the worker's tensor layout)
    24     2    key length
    26     64   key, zero padded
    90     8    payload length
    98     8    xxh3_64 of bytes 0..97 followed by the payload

A reader checks all of it (``check``); anything off -- wrong magic or version, another
rank, layout or key (a *foreign* block), another length (a *truncated* block), another
checksum (a *corrupt* block) -- makes the block a miss, never data.
"""

from __future__ import annotations

import struct

import xxhash

BytesLike = bytes | bytearray | memoryview
"""Anything with contiguous bytes the framing reads."""

MAGIC = b"KVOB"
VERSION = 1
FINGERPRINT_BYTES = 16
MAX_KEY_BYTES = 64

_FIELDS = struct.Struct(f"<4sHH{FINGERPRINT_BYTES}sH{MAX_KEY_BYTES}sQ")
_CHECKSUM = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _CHECKSUM.size
"""Bytes before the payload (106)."""


def encode_header(fingerprint: bytes, rank: int, key: bytes, payload: BytesLike) -> bytes:
    """The header of ``payload`` stored as ``key`` by ``rank`` (computes the checksum)."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
    size = memoryview(payload).nbytes
    fields = _FIELDS.pack(MAGIC, VERSION, rank, fingerprint, len(key), key, size)
    digest = xxhash.xxh3_64(fields)
    digest.update(payload)
    return fields + _CHECKSUM.pack(digest.intdigest())


class PayloadCheck:
    """Checks a payload against a header piece by piece (``update`` as bytes arrive,
    ``problem`` at the end), so a reader can hash each piece while it is still in cache."""

    def __init__(self, header: BytesLike) -> None:
        head = memoryview(header)
        self._digest = xxhash.xxh3_64(head[: _FIELDS.size])
        (self._expected,) = _CHECKSUM.unpack(head[_FIELDS.size:])

    def update(self, piece: BytesLike) -> None:
        self._digest.update(piece)

    def problem(self) -> str | None:
        if self._digest.intdigest() != self._expected:
            return "checksum mismatch (corrupt block)"
        return None


def check_header(header: BytesLike, payload_bytes: int, fingerprint: bytes, rank: int,
                 key: bytes) -> str | None:
    """Why ``header`` does not announce block ``key`` of ``rank`` with ``payload_bytes`` of
    payload, or None if it does (the checksum is checked by ``PayloadCheck``)."""
    head = memoryview(header)
    if head.nbytes != HEADER_BYTES:
        return f"header of {head.nbytes} bytes, expected {HEADER_BYTES}"
    magic, version, got_rank, got_fp, key_len, got_key, size = _FIELDS.unpack(
        head[: _FIELDS.size])
    if magic != MAGIC:
        return "not a kvoffload block (bad magic)"
    if version != VERSION:
        return f"format version {version}, expected {VERSION}"
    if got_fp != fingerprint:
        return "foreign block (another model, layout or key scheme)"
    if got_rank != rank:
        return f"block of rank {got_rank}, expected rank {rank}"
    if key_len > MAX_KEY_BYTES or got_key[:key_len] != key:
        return "block stored under another key"
    if size != payload_bytes:
        return f"payload of {size} bytes, expected {payload_bytes}"
    return None


def check(header: BytesLike, payload: BytesLike, fingerprint: bytes, rank: int,
          key: bytes) -> str | None:
    """Why ``header + payload`` is not the block ``key`` of ``rank``, or None if it is.

    ``payload`` must already have the expected length (the caller sized it from the
    group); the header's length field must agree with it.
    """
    problem = check_header(header, memoryview(payload).nbytes, fingerprint, rank, key)
    if problem is not None:
        return problem
    verify = PayloadCheck(header)
    verify.update(payload)
    return verify.problem()
