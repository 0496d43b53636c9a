"""The reference engine's block hasher: ``keys.BlockHasher``'s hashes, computed faster.

A replay of a long trace hashes millions of blocks, and ``BlockHasher`` converts every
block's tokens to a fresh ``array('q')`` and length-prefixes every part on each call. This
hasher converts a request's new tokens once per ``extend`` and reuses the constant length
prefixes, so a block costs one slice, one concatenation and one digest.

Contract: for the same ``block_size``, seed, algorithm, token ids and ``HashContext``,
``EngineHasher.extend`` appends exactly the hashes ``BlockHasher.extend`` would (a test
pins this). Contexts with a LoRA name or multimodal spans take ``BlockHasher``'s path.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable, Sequence

import xxhash

from kvoffload.keys import BlockHash, BlockHasher, HashAlgorithm, HashContext


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


class EngineHasher:
    """Chained block hashes at ``block_size`` tokens, identical to ``BlockHasher``'s."""

    def __init__(self, block_size: int, seed: str = "kvoffload",
                 algo: HashAlgorithm = HashAlgorithm.XXH3_128) -> None:
        self._reference = BlockHasher(block_size, seed, algo)
        self.block_size = block_size
        self.algo = algo
        self.root = self._reference.root
        self._digest: Callable[[bytes], bytes] = (
            xxhash.xxh3_128_digest if algo is HashAlgorithm.XXH3_128
            else (lambda data: hashlib.sha256(data).digest()))
        self._token_prefix = struct.pack("<I", 8 * block_size)
        self._empty_extra = _lp(b"")
        self._parent_prefix = struct.pack("<I", len(self.root))

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int],
               context: HashContext | None = None) -> list[BlockHash]:
        """Append the hashes of every full block of ``token_ids`` not yet in ``hashes``.

        ``hashes`` must be this hasher's hashes of a prefix of ``token_ids``; it is
        extended in place and returned.
        """
        if context is None:
            context = HashContext()
        if context.lora_name is not None or context.multimodal:
            return self._reference.extend(hashes, token_ids, context)
        bs = self.block_size
        first = len(hashes)
        last = len(token_ids) // bs
        if last <= first:
            return hashes
        # One int64 conversion for every new block: 8 bytes per token, as BlockHasher packs.
        raw = array("q", token_ids[first * bs:last * bs]).tobytes()
        width = 8 * bs
        parent = hashes[-1] if hashes else self.root
        digest = self._digest
        token_prefix = self._token_prefix
        empty = self._empty_extra
        parent_prefix = self._parent_prefix
        for i in range(last - first):
            block = first + i
            extra = empty
            if block == 0 and context.cache_salt is not None:
                extra = _lp(context.extra_keys(0, bs))
            chunk = raw[i * width:(i + 1) * width]
            parent = BlockHash(digest(parent_prefix + parent + token_prefix + chunk + extra))
            hashes.append(parent)
        return hashes
