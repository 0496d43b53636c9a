"""Chained block hashing and offload keys.

A *block hash* identifies a whole prefix: it is the hash of (parent hash, the block's token
ids, extra keys). Extra keys are whatever changes the KV contents besides the tokens: the
LoRA adapter name, multimodal inputs overlapping the block, and a per-tenant cache salt that
enters the first block only (the chain carries it forward).

Hashes are reproducible across processes and restarts: the chain starts from a root derived
from a seed string, never from process-local randomness, so disk and shared tiers can serve
blocks stored by another process.

An *offload key* is (block hash at the end of an offloaded block, group index), packed into
one ``bytes`` object so that millions of keys stay compact in dicts and sets.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from operator import itemgetter
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", bytes)
OffloadKey = NewType("OffloadKey", bytes)

_GROUP_BYTES = 2
_MAX_GROUPS = 1 << (8 * _GROUP_BYTES)
_HIGH_GROUP_BYTE = itemgetter(-2)  # the group index's bytes (big-endian): see key_groups
_LOW_GROUP_BYTE = itemgetter(-1)


class HashAlgorithm(str, Enum):
    """Hash function for block hashes."""

    XXH3_128 = "xxh3_128"
    """Fast, 128-bit, not collision resistant against an adversary (single tenant)."""
    SHA256 = "sha256"
    """Cryptographic; use when tenants share a cache and may craft prompts."""


def _digest(algo: HashAlgorithm, data: bytes) -> bytes:
    if algo is HashAlgorithm.XXH3_128:
        return xxhash.xxh3_128_digest(data)
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class MultiModalSpan:
    """A multimodal input occupying tokens ``[offset, offset + length)`` with content hash."""

    offset: int
    length: int
    content_hash: str


@dataclass(frozen=True)
class HashContext:
    """What besides token ids determines a request's KV contents.

    Attributes:
        lora_name: the LoRA adapter, or None.
        cache_salt: per-tenant salt; requests with different salts never share blocks.
        multimodal: spans of multimodal inputs in the prompt.
    """

    lora_name: str | None = None
    cache_salt: str | None = None
    multimodal: tuple[MultiModalSpan, ...] = ()

    def extra_keys(self, start: int, end: int) -> bytes:
        """Canonical encoding of the extra keys of the block of tokens ``[start, end)``."""
        parts: list[bytes] = []
        if self.lora_name is not None:
            parts.append(b"L" + _lp(self.lora_name.encode()))
        for span in self.multimodal:
            if span.offset < end and start < span.offset + span.length:
                parts.append(b"M" + struct.pack("<q", span.offset - start)
                             + _lp(span.content_hash.encode()))
        if start == 0 and self.cache_salt is not None:
            parts.append(b"S" + _lp(self.cache_salt.encode()))
        return b"".join(parts)


def _lp(data: bytes) -> bytes:
    """Length-prefixed bytes, so concatenations cannot collide."""
    return struct.pack("<I", len(data)) + data


def root_hash(seed: str = "kvoffload", algo: HashAlgorithm = HashAlgorithm.XXH3_128) -> BlockHash:
    """The parent hash of every request's first block, derived from ``seed``."""
    return BlockHash(_digest(algo, b"kvoffload-root:" + seed.encode()))


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"",
               algo: HashAlgorithm = HashAlgorithm.XXH3_128) -> BlockHash:
    """Chained hash of one block: (parent, token ids, extra keys)."""
    tokens = array("q", token_ids).tobytes()
    return BlockHash(_digest(algo, _lp(parent) + _lp(tokens) + _lp(extra)))


class BlockHasher:
    """Computes a request's chained block hashes at ``block_size`` granularity.

    Only full blocks are hashed. ``extend`` is incremental: call it as tokens are appended
    (prompt, then decode) and it hashes only the newly completed blocks.
    """

    def __init__(self, block_size: int, seed: str = "kvoffload",
                 algo: HashAlgorithm = HashAlgorithm.XXH3_128) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.algo = algo
        self.root = root_hash(seed, algo)

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int],
               context: HashContext = HashContext()) -> list[BlockHash]:
        """Append the hashes of every full block of ``token_ids`` not yet in ``hashes``.

        ``hashes`` must be this hasher's hashes of a prefix of ``token_ids``; it is
        extended in place and returned. Each block's hash is ``hash_block(parent, tokens,
        extra)``; without LoRA or multimodal inputs the new tokens are packed once and the
        constant length prefixes reused (a replay hashes millions of blocks).
        """
        bs = self.block_size
        first, last = len(hashes), len(token_ids) // bs
        if last <= first:
            return hashes
        parent = hashes[-1] if hashes else self.root
        if context.lora_name is not None or context.multimodal:
            for block in range(first, last):
                start, end = block * bs, (block + 1) * bs
                parent = hash_block(parent, token_ids[start:end],
                                    context.extra_keys(start, end), self.algo)
                hashes.append(parent)
            return hashes
        raw = array("q", token_ids[first * bs:last * bs]).tobytes()
        width = 8 * bs
        parent_prefix = struct.pack("<I", len(self.root))
        token_prefix = struct.pack("<I", width)
        no_extra = _lp(b"")
        for i in range(last - first):
            extra = no_extra
            if first + i == 0 and context.cache_salt is not None:
                extra = _lp(context.extra_keys(0, bs))
            chunk = raw[i * width:(i + 1) * width]
            parent = BlockHash(_digest(self.algo, parent_prefix + parent + token_prefix
                                       + chunk + extra))
            hashes.append(parent)
        return hashes

    def hashes(self, token_ids: Sequence[int],
               context: HashContext = HashContext()) -> list[BlockHash]:
        """The hashes of every full block of ``token_ids``."""
        return self.extend([], token_ids, context)


def make_offload_key(block_hash: BlockHash, group: int) -> OffloadKey:
    """Pack (block hash, group index) into one key."""
    if not 0 <= group < _MAX_GROUPS:
        raise ValueError(f"group index {group} out of range [0, {_MAX_GROUPS})")
    return OffloadKey(block_hash + group.to_bytes(_GROUP_BYTES, "big"))


def key_groups(keys: Sequence[OffloadKey]) -> list[int]:
    """``key_group`` of each key, in order. While every group index is below 256 (the
    high byte of the 2-byte index is 0), the low bytes are read without a Python step
    per key."""
    if any(map(_HIGH_GROUP_BYTE, keys)):
        return [key_group(key) for key in keys]
    return list(map(_LOW_GROUP_BYTE, keys))


def key_block_hash(key: OffloadKey) -> BlockHash:
    """The block hash part of an offload key."""
    return BlockHash(key[:-_GROUP_BYTES])


def key_group(key: OffloadKey) -> int:
    """The group index part of an offload key."""
    return int.from_bytes(key[-_GROUP_BYTES:], "big")
