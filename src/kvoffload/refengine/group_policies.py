"""Per-kind block rules of the reference engine's pool (one small class per ``GroupKind``).

The numbers every layer shares (how many blocks a window retains, the lookup order) come
from ``kvoffload.group_kinds``; these classes apply them to the pool's block tables.

Each policy answers, for one KV-cache group, the questions whose answers differ by kind:

* ``find_hit``: the longest prefix-cache hit this group can serve up to a length;
* ``dead_before``: which leading block positions a running request no longer needs;
* ``needs_block``: whether a newly covered position gets a real block or the null block;
* ``cache_positions``: which positions hold data that may be registered in the prefix cache;
* ``plan_appends``: the allocation rule, what ``HybridBlockPool.allocate`` appends to the
  group's table (the null block, a block of the hit, or a new block per position).

Position ``p`` of a group with block size ``bs`` covers tokens ``[p*bs, (p+1)*bs)``; for a
Mamba group it holds the recurrent state *after* its last covered token, i.e. the state at
token ``(p+1)*bs`` when the block is full (a boundary state), or at the request's current
length when the request stops inside it (a running state, never cached).

The rules mirror vLLM's own prefix cache (``vllm/v1/core/single_type_kv_cache_manager.py``):

* full attention: a hit at t needs every block before t;
* sliding window W: a hit at t needs the ``ceil((W-1)/bs)`` blocks covering the last W-1
  tokens, contiguous and ending at t (the next token attends to W-1 previous ones); when no
  such run exists the leading run from position 0 is a valid hit (every token of a prefix
  shorter than the window is in it);
* Mamba: a hit at t needs exactly one cached state, the one at t.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

from kvoffload.config import GroupKind, GroupSpec
from kvoffload.errors import ConfigError
from kvoffload.group_kinds import KIND_RULES
from kvoffload.jobs import NULL_BLOCK_ID
from kvoffload.keys import BlockHash

CachedLookup = Callable[[int, BlockHash], "int | None"]
"""``(group index, block hash) -> cached block id or None``."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupPolicy(ABC):
    """The kind-specific rules of one group (see the module docstring)."""

    kind: ClassVar[GroupKind]

    def __init__(self, index: int, spec: GroupSpec, hash_block_size: int) -> None:
        if spec.block_size % hash_block_size:
            raise ConfigError(f"groups[{index}].block_size",
                              f"{spec.block_size} is not a multiple of hash_block_size "
                              f"{hash_block_size}",
                              "Use a hash block size that divides every group's block size.")
        self.index = index
        self.spec = spec
        self.block_size = spec.block_size
        self.hashes_per_block = spec.block_size // hash_block_size

    @property
    def alignment(self) -> int:
        """A hit must be a multiple of this many tokens for this group."""
        return self.block_size

    def num_hashed_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """Full blocks of this group covered by ``block_hashes``."""
        return len(block_hashes) // self.hashes_per_block

    def block_hash(self, block_hashes: Sequence[BlockHash], pos: int) -> BlockHash:
        """The chained hash at the end of block ``pos`` (identifies the whole prefix)."""
        return block_hashes[(pos + 1) * self.hashes_per_block - 1]

    @abstractmethod
    def find_hit(self, cached: CachedLookup, block_hashes: Sequence[BlockHash],
                 max_tokens: int, alignment: int) -> list[int]:
        """Block ids (null where no data is needed) of the longest hit <= ``max_tokens``.

        The hit length is ``len(result) * block_size`` and is a multiple of ``alignment``
        (a multiple of ``self.alignment``).
        """

    @abstractmethod
    def dead_before(self, num_computed_tokens: int) -> int:
        """Positions below this are not needed once ``num_computed_tokens`` are computed."""

    def needs_block(self, pos: int, num_computed_tokens: int, num_tokens: int) -> bool:
        """Whether live position ``pos`` (>= ``dead_before``) gets a real block when a step
        takes the request from ``num_computed_tokens`` to ``num_tokens`` tokens."""
        return True

    def cache_positions(self, num_computed_tokens: int, checked: int) -> range:
        """Positions that hold cacheable data once ``num_computed_tokens`` are computed,
        skipping the ``checked`` positions already examined."""
        return range(checked, num_computed_tokens // self.block_size)

    def next_checked(self, num_computed_tokens: int, checked: int) -> int:
        """The new ``checked`` after ``cache_positions`` was processed."""
        return max(checked, num_computed_tokens // self.block_size)

    def plan_appends(self, start: int, num_computed: int, num_tokens: int,
                     hit_ids: Sequence[int]) -> list[int | None]:
        """Entries to append to a table of ``start`` positions so that it covers
        ``num_tokens`` tokens: the null id, a hit block id, or None for a new block.

        Attention: every live position needs a block: nulls, then hit blocks, then new
        blocks. Raises ``ValueError`` if the hit has no block at a live position.
        """
        end = cdiv(num_tokens, self.block_size)
        if start >= end:
            return []
        live = max(start, min(self.dead_before(num_computed), end))
        adopted = max(live, min(len(hit_ids), end))
        plan: list[int | None] = [NULL_BLOCK_ID] * (live - start)
        plan.extend(hit_ids[live:adopted])
        if NULL_BLOCK_ID in plan[live - start:]:
            pos = live + plan[live - start:].index(NULL_BLOCK_ID)
            raise ValueError(f"group {self.index}: hit has no block at live "
                             f"position {pos}")
        plan.extend([None] * (end - adopted))
        return plan


class FullAttentionPolicy(GroupPolicy):
    """Every block before the hit; nothing is freed while the request runs."""

    kind = GroupKind.FULL_ATTENTION

    def find_hit(self, cached: CachedLookup, block_hashes: Sequence[BlockHash],
                 max_tokens: int, alignment: int) -> list[int]:
        limit = min(max_tokens // self.block_size, self.num_hashed_blocks(block_hashes))
        hit: list[int] = []
        for pos in range(limit):
            block = cached(self.index, self.block_hash(block_hashes, pos))
            if block is None:
                break
            hit.append(block)
        while (len(hit) * self.block_size) % alignment:
            hit.pop()
        return hit

    def dead_before(self, num_computed_tokens: int) -> int:
        return 0


class SlidingWindowPolicy(GroupPolicy):
    """The blocks covering the last W-1 tokens before the hit."""

    kind = GroupKind.SLIDING_WINDOW

    def __init__(self, index: int, spec: GroupSpec, hash_block_size: int) -> None:
        super().__init__(index, spec, hash_block_size)
        assert spec.sliding_window is not None
        self.window = spec.sliding_window
        run_blocks = KIND_RULES[spec.kind].engine_retention_blocks(spec)
        assert run_blocks is not None
        self.run_blocks = run_blocks
        """Contiguous cached blocks a hit needs at its end (``ceil((W - 1) / block)``)."""

    def find_hit(self, cached: CachedLookup, block_hashes: Sequence[BlockHash],
                 max_tokens: int, alignment: int) -> list[int]:
        bs = self.block_size
        limit = min(max_tokens // bs, self.num_hashed_blocks(block_hashes))
        if self.run_blocks == 0:  # W == 1: the next token attends only to itself
            n = limit
            while (n * bs) % alignment:
                n -= 1
            return [NULL_BLOCK_ID] * n
        hit = [NULL_BLOCK_ID] * limit
        run = 0
        for pos in range(limit - 1, -1, -1):
            block = cached(self.index, self.block_hash(block_hashes, pos))
            if block is None:
                run = 0
                continue
            if run == 0 and ((pos + 1) * bs) % alignment:
                continue  # a run must end on an aligned hit length
            hit[pos] = block
            run += 1
            if run >= self.run_blocks:
                return hit[:pos + run]
        # No full run: only the leading run (from position 0) is a hit.
        del hit[run:]
        while (len(hit) * bs) % alignment:
            hit.pop()
        return hit

    def dead_before(self, num_computed_tokens: int) -> int:
        skipped_tokens = max(0, num_computed_tokens - self.window + 1)
        return skipped_tokens // self.block_size


class MambaPolicy(GroupPolicy):
    """Exactly one state, at the hit; a request keeps only the state it reads next.

    A request's table holds real blocks only at the position of the state at
    ``num_computed_tokens`` (the input of the next step) and at the position of the state
    the running step writes (its output); every other position is null. A state is cached
    when a step ends exactly on an aligned boundary; once the request moves on, the block
    is released but stays in the prefix cache (free, evictable) until evicted.
    """

    kind = GroupKind.MAMBA

    def __init__(self, index: int, spec: GroupSpec, hash_block_size: int) -> None:
        super().__init__(index, spec, hash_block_size)
        self._alignment = spec.state_alignment or spec.block_size

    @property
    def alignment(self) -> int:
        return self._alignment

    def find_hit(self, cached: CachedLookup, block_hashes: Sequence[BlockHash],
                 max_tokens: int, alignment: int) -> list[int]:
        bs = self.block_size
        limit = min(max_tokens // bs, self.num_hashed_blocks(block_hashes))
        for pos in range(limit - 1, -1, -1):
            if ((pos + 1) * bs) % alignment:
                continue
            block = cached(self.index, self.block_hash(block_hashes, pos))
            if block is not None:
                return [NULL_BLOCK_ID] * pos + [block]
        return []

    def state_position(self, num_computed_tokens: int) -> int:
        """Position of the state at ``num_computed_tokens`` (-1 when there is none)."""
        return cdiv(num_computed_tokens, self.block_size) - 1

    def dead_before(self, num_computed_tokens: int) -> int:
        return max(0, self.state_position(num_computed_tokens))

    def needs_block(self, pos: int, num_computed_tokens: int, num_tokens: int) -> bool:
        return pos in (self.state_position(num_computed_tokens),
                       self.state_position(num_tokens))

    def cache_positions(self, num_computed_tokens: int, checked: int) -> range:
        if num_computed_tokens == 0 or num_computed_tokens % self._alignment:
            return range(0)
        pos = num_computed_tokens // self.block_size - 1
        return range(pos, pos + 1)

    def plan_appends(self, start: int, num_computed: int, num_tokens: int,
                     hit_ids: Sequence[int]) -> list[int | None]:
        """Mamba: only the positions of the states read and written (``needs_block``)
        get a block, the hit's where it has one; every other position is null."""
        end = cdiv(num_tokens, self.block_size)
        if start >= end:
            return []
        dead = self.dead_before(num_computed)
        plan: list[int | None] = []
        for pos in range(start, end):
            if pos < dead or not self.needs_block(pos, num_computed, num_tokens):
                plan.append(NULL_BLOCK_ID)
            elif pos < len(hit_ids):
                if hit_ids[pos] == NULL_BLOCK_ID:
                    raise ValueError(f"group {self.index}: hit has no block at live "
                                     f"position {pos}")
                plan.append(hit_ids[pos])
            else:
                plan.append(None)
        return plan


POLICIES: dict[GroupKind, type[GroupPolicy]] = {
    GroupKind.FULL_ATTENTION: FullAttentionPolicy,
    GroupKind.SLIDING_WINDOW: SlidingWindowPolicy,
    GroupKind.MAMBA: MambaPolicy,
}
"""The policy class of each group kind."""


def group_policy(index: int, spec: GroupSpec, hash_block_size: int) -> GroupPolicy:
    """The block rules of group ``index``."""
    return POLICIES[spec.kind](index, spec, hash_block_size)


def lookup_order(policies: Sequence[GroupPolicy]) -> list[GroupPolicy]:
    """Order of the fixpoint (``KindRules.lookup_rank``, over engine blocks): full
    attention, then the windowed groups widest first, a window rounded up to whole blocks
    and a Mamba state counted as one block (ties keep group order). The order changes only
    how many lookups the fixpoint makes, never the hit it ends at."""
    return sorted(policies,
                  key=lambda p: KIND_RULES[p.kind].lookup_rank(p.spec, p.block_size))
