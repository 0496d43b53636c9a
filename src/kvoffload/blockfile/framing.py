"""The framing of a block stored in a lower tier: a fixed header and the payload.

Every block on the remote server is ``header + payload``, and every block file on disk is
``payload + header`` (``kvoffload.worker.disk_frames``), where the payload is exactly the
block's bytes in a host slot (``HostPool.slot_view(slot, group)``). The header
says what the block is and carries a checksum and a MAC, so a reader can prove it got the
block it asked for, whole, and -- with a MAC key -- written by an engine holding the key::

    offset size field
    0      4    magic b"KVOB"
    4      2    format version (3)
    6      2    rank that wrote it
    8      16   layout fingerprint (namespace + the worker's tensor layout)
    24     2    key length
    26     64   key, zero padded
    90     8    payload length
    98     8    xxh3_64 of bytes 0..97 followed by the payload
    106    6    zero (so that a payload after the header starts 64-byte aligned)
    112    16   MAC: keyed BLAKE2b-128 of bytes 0..111 followed by the payload, or 16 zero
                bytes when the writer has no MAC key
    128         end of the header

A reader checks all of it (``check``); anything off -- wrong magic or version, another
rank, layout or key (a *foreign* block), another length (a *truncated* block), another
checksum or padding that is not zero (a *corrupt* block) -- makes the block a miss, never
data.

Why the padding: the kernel copies a file's bytes to and from the host slot (64-byte
aligned), and a payload at offset 122 put every copy 58 bytes off a cache line; reads out
of the page cache measured 7-8 % slower than at a 64-byte aligned offset (``docs/tiers.md``,
Throughput). Six bytes per block bought that back. A disk file now goes further: the
header is written after the payload, which starts the file at offset 0, page aligned, and
is written front to back; stores measured about 0.06 of raw faster than with the header
first and the payload at 128 (``benchmarks/disk_breakdown.c``).

The checksum has no key: anyone who can write to the tier and knows this format can
recompute it for a payload of their choice. The MAC is what stops that. A reader with a
MAC key (``MacKey``) accepts a block only if its MAC verifies with that key (compared in
constant time); a block written without a key, with another key, or forged, is a miss.
A reader without a key ignores the MAC field and trusts the checksum -- that is, it trusts
everyone who can write to the tier. The key covers the whole header, so a MAC'd value
copied under another block's name, rank or layout fails as well. Nothing derived from the
key is written anywhere: a block MAC'd with another key simply fails to verify.

Version 1 frames (106-byte header, no MAC field) and version 2 frames (122-byte header, no
padding) read as damaged (wrong size or version) and are removed like any damaged block;
so do disk files of earlier releases, whose header came first (their last 128 bytes are
payload, not a header).

The checksum comes from ``kvoffload.blockfile.checksum`` (a C extension that hashes without the
GIL, or the ``xxhash`` package: the same digests). Writers that stream the payload to a file
build the header in two steps -- ``header_fields`` and ``new_digest`` before the payload,
``seal`` after it; readers that hash while they read (the disk tier's ``read_frame``) give
the checksum they computed to ``check_payload``, and ``PayloadCheck`` checks a payload
given piece by piece.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from kvoffload.blockfile import checksum as _checksum
from kvoffload.blockfile.checksum import Checksums, Digest, checksums

BytesLike = _checksum.BytesLike
"""Anything with contiguous bytes the framing reads."""

MAGIC = b"KVOB"
VERSION = 3
FINGERPRINT_BYTES = 16
MAX_KEY_BYTES = 64
MAC_BYTES = 16
"""Bytes of the MAC field (BLAKE2b with a 128-bit digest)."""
MIN_MAC_KEY_BYTES = 16
"""The shortest secret ``MacKey`` accepts."""

_FIELDS = struct.Struct(f"<4sHH{FINGERPRINT_BYTES}sH{MAX_KEY_BYTES}sQ")
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_END = _FIELDS.size + _CHECKSUM.size
_PAD = bytes(6)
_CHECKED = _CHECKSUM_END + len(_PAD)
"""Header bytes the MAC covers before the payload (everything but the MAC field)."""
HEADER_BYTES = _CHECKED + MAC_BYTES
"""Bytes before the payload (128)."""
MAC_OFFSET = _CHECKED
"""Where the MAC field starts (112: the header's last ``MAC_BYTES``)."""
FIELDS_BYTES = _FIELDS.size
"""Bytes of ``header_fields`` (98): the header's start, which the checksum covers."""
_NO_MAC = bytes(MAC_BYTES)
_MAC_PERSON = b"kvoffload-block"
_KEY_PERSON = b"kvoffload-key"
_BLAKE2B_MAX_KEY = 64


class MacKey:
    """The secret that MACs every block of the lower tiers (keyed BLAKE2b).

    Its repr and str never show the secret, and nothing else of it is exposed: framing is
    the only user. Two keys are equal when their secrets are (compared in constant time).
    Secrets longer than BLAKE2b's 64-byte key are hashed down to 64 bytes first.

    Raises:
        ValueError: a secret shorter than ``MIN_MAC_KEY_BYTES`` (the message gives its
            length, never its bytes).
    """

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if not isinstance(secret, (bytes, bytearray)):
            raise TypeError(f"a MAC key is bytes, not {type(secret).__name__}")
        if len(secret) < MIN_MAC_KEY_BYTES:
            raise ValueError(f"a MAC key needs at least {MIN_MAC_KEY_BYTES} bytes, "
                             f"got {len(secret)}")
        if len(secret) > _BLAKE2B_MAX_KEY:
            secret = hashlib.blake2b(secret, digest_size=_BLAKE2B_MAX_KEY,
                                     person=_KEY_PERSON).digest()
        self._secret = bytes(secret)

    def new(self) -> hashlib.blake2b:
        """A fresh keyed hash for one block's MAC."""
        return hashlib.blake2b(key=self._secret, digest_size=MAC_BYTES, person=_MAC_PERSON)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MacKey):
            return NotImplemented
        return hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(MacKey)  # equal keys hash alike; nothing of the secret is revealed

    def __repr__(self) -> str:
        return "MacKey(<secret>)"

    __str__ = __repr__


def header_fields(fingerprint: bytes, rank: int, key: bytes, payload_bytes: int) -> bytes:
    """Bytes 0..97 of the header of a ``payload_bytes`` payload stored as ``key`` by
    ``rank``: everything but the checksum and the MAC."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
    return _FIELDS.pack(MAGIC, VERSION, rank, fingerprint, len(key), key, payload_bytes)


def new_digest(fields: BytesLike, using: Checksums | None = None) -> Digest:
    """The running checksum of a frame, fed its ``header_fields``; feed it the payload
    next (``using``: the checksum implementation, default ``checksums()``)."""
    digest = (using or checksums()).new()
    digest.update(fields)
    return digest


def seal(fields: bytes, checksum: int, payload: BytesLike, *,
         mac_key: MacKey | None = None) -> bytes:
    """The header: ``fields``, the ``checksum`` of fields and payload, and the MAC of both
    with ``mac_key`` (computed here over ``payload``; without a key the field is zero)."""
    checked = fields + _CHECKSUM.pack(checksum) + _PAD
    if mac_key is None:
        return checked + _NO_MAC
    mac = mac_key.new()
    mac.update(checked)
    mac.update(payload)
    return checked + mac.digest()


def encode_header(fingerprint: bytes, rank: int, key: bytes, payload: BytesLike, *,
                  mac_key: MacKey | None = None) -> bytes:
    """The header of ``payload`` stored as ``key`` by ``rank`` (computes the checksum, and
    the MAC with ``mac_key``; without one the MAC field is zero)."""
    fields = header_fields(fingerprint, rank, key, memoryview(payload).nbytes)
    digest = new_digest(fields)
    digest.update(payload)
    return seal(fields, digest.intdigest(), payload, mac_key=mac_key)


class PayloadCheck:
    """Checks a payload against a header piece by piece (``update`` as bytes arrive,
    ``problem`` at the end), so a reader can hash each piece while it is still in cache.
    With ``mac_key`` the MAC must verify too; without, the MAC field is not looked at.

    A reader whose I/O feeds the checksum itself (``Checksums.read_hashed``) passes
    ``digest`` to it, then the same bytes to ``update_mac``.
    """

    def __init__(self, header: BytesLike, *, mac_key: MacKey | None = None,
                 using: Checksums | None = None) -> None:
        head = memoryview(header)
        self.digest = new_digest(head[: _FIELDS.size], using)
        (self._expected,) = _CHECKSUM.unpack(head[_FIELDS.size:_CHECKSUM_END])
        self._mac = None
        if mac_key is not None:
            self._mac = mac_key.new()
            self._mac.update(head[:_CHECKED])
            self._expected_mac = bytes(head[_CHECKED:HEADER_BYTES])

    def update(self, piece: BytesLike) -> None:
        """Feed ``piece`` to the checksum and the MAC."""
        self.digest.update(piece)
        self.update_mac(piece)

    def update_mac(self, piece: BytesLike) -> None:
        """Feed ``piece`` to the MAC alone (the checksum had it from ``digest``'s user)."""
        if self._mac is not None:
            self._mac.update(piece)

    def problem(self) -> str | None:
        if self.digest.intdigest() != self._expected:
            return "checksum mismatch (corrupt block)"
        if self._mac is not None:
            return _mac_problem(self._mac.digest(), self._expected_mac)
        return None


def check_payload(header: BytesLike, checksum: int, payload: BytesLike, *,
                  mac_key: MacKey | None = None) -> str | None:
    """Why ``payload``, whose ``checksum`` (the XXH3-64 of the header's first
    ``FIELDS_BYTES`` followed by the payload) the reader computed while reading it, is not
    the one ``header`` announces, or None (with ``mac_key``: only if the MAC verifies)."""
    head = memoryview(header)
    (expected,) = _CHECKSUM.unpack(head[_FIELDS.size:_CHECKSUM_END])
    if checksum != expected:
        return "checksum mismatch (corrupt block)"
    if mac_key is None:
        return None
    mac = mac_key.new()
    mac.update(head[:_CHECKED])
    mac.update(payload)
    return _mac_problem(mac.digest(), bytes(head[_CHECKED:HEADER_BYTES]))


def _mac_problem(mac: bytes, expected: bytes) -> str | None:
    if hmac.compare_digest(mac, expected):
        return None
    if expected == _NO_MAC:
        return "no MAC (written without the tier MAC key, or forged)"
    return "MAC mismatch (written with another tier MAC key, or forged)"


def check_header(header: BytesLike, payload_bytes: int, fingerprint: bytes, rank: int,
                 key: bytes) -> str | None:
    """Why ``header`` does not announce block ``key`` of ``rank`` with ``payload_bytes`` of
    payload, or None if it does (checksum and MAC are checked by ``PayloadCheck``)."""
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
    if head[_CHECKSUM_END:_CHECKED] != _PAD:
        return "padding that is not zero (corrupt block)"
    return None


def check(header: BytesLike, payload: BytesLike, fingerprint: bytes, rank: int,
          key: bytes, *, mac_key: MacKey | None = None) -> str | None:
    """Why ``header + payload`` is not the block ``key`` of ``rank``, or None if it is
    (with ``mac_key``: only if its MAC verifies with that key).

    ``payload`` must already have the expected length (the caller sized it from the
    group); the header's length field must agree with it.
    """
    problem = check_header(header, memoryview(payload).nbytes, fingerprint, rank, key)
    if problem is not None:
        return problem
    verify = PayloadCheck(header, mac_key=mac_key)
    verify.update(payload)
    return verify.problem()
