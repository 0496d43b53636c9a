"""The reference engine's prefix cache index: which block holds which (group, hash).

``PrefixCacheIndex`` maps a cache key ``(group index, block hash)`` to the one block
cached under it, and each block back to its key (at most one key per block, one block per
key). Each registration gets a stamp from a counter, so a hit looked up earlier
(``CacheHit``, with the stamps of its blocks) can tell whether its blocks were evicted or
re-cached since. The index only records; when blocks are cached, evicted and reused is
``block_pool.HybridBlockPool``'s business. The pool's hot loops read and write ``keys``,
``blocks`` and ``stamps`` directly (hoisted into locals): these attributes are the
index's contract, kept consistent by whoever writes them (``check_integrity``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvoffload.errors import InvariantError
from kvoffload.keys import BlockHash

CacheKey = tuple[int, BlockHash]
"""``(group index, block hash)``: what a block is cached under."""


@dataclass(frozen=True)
class CacheHit:
    """A prefix-cache hit valid for every group at once.

    Attributes:
        num_tokens: hit length; a multiple of every group's alignment.
        block_ids: per group, ``num_tokens // block_size`` block ids, null where the group
            needs no data (outside the window, Mamba positions before the hit).
    """

    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    stamps: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)
    """Per block, the pool's cache stamp at lookup (0 for nulls): ``allocate`` refuses the
    hit if a block was evicted or re-cached since. Empty: only checked for being cached."""


class PrefixCacheIndex:
    """Cache keys of ``num_blocks`` block ids (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.keys: list[CacheKey | None] = [None] * num_blocks
        """Per block, the key it is cached under, or None."""
        self.blocks: dict[CacheKey, int] = {}
        """Per key, the block cached under it."""
        self.stamps = [0] * num_blocks
        """When each block was last cached (a counter), to detect stale hits."""
        self.next_stamp = 1
        self.evictions = 0
        """Blocks evicted because the pool handed them out again."""

    def __len__(self) -> int:
        return len(self.blocks)

    def lookup(self, group: int, block_hash: BlockHash) -> int | None:
        """The block cached under ``(group, block_hash)``, or None."""
        return self.blocks.get((group, block_hash))

    def drop(self, block_ids: Iterable[int]) -> int:
        """Uncache blocks (ids outside the pool are ignored); returns how many were
        cached."""
        dropped = 0
        keys, blocks = self.keys, self.blocks
        for block in block_ids:
            key = keys[block] if 0 < block < self.num_blocks else None
            if key is not None:
                del blocks[key]
                keys[block] = None
                dropped += 1
        return dropped

    def clear(self) -> None:
        """Uncache every block."""
        for block in self.blocks.values():
            self.keys[block] = None
        self.blocks.clear()

    def check_integrity(self) -> None:
        """Raise ``InvariantError`` unless the key map and the per-block keys agree."""
        for b, key in enumerate(self.keys):
            if b and key is not None and self.blocks.get(key) != b:
                raise InvariantError(f"block {b}: key not mapped back to it")
        for key, b in self.blocks.items():
            if self.keys[b] != key:
                raise InvariantError(f"cache entry for block {b} disagrees with its key")
