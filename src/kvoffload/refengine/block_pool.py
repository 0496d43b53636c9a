"""The reference engine's hybrid block pool: a small, honest model of vLLM's ``BlockPool``
plus its ``HybridKVCacheCoordinator`` (``vllm/v1/core/kv_cache_coordinator.py``).

One pool of ``num_blocks`` block ids is shared by every KV-cache group (vLLM's hybrid
allocator pads pages to one size; here pages are ids, their bytes are accounted elsewhere).
Block id 0 is the null block: reserved, never allocated, never freed, never cached; in a
request's block table it means "no data here".

Life of a block. A free block sits in the free queue, oldest first. ``allocate`` takes
blocks from the front; if a taken block was still in the prefix cache it is evicted from it
then (LRU eviction of cached-but-free blocks). ``cache_blocks`` registers computed blocks
under (group, block hash). A block whose last user lets go returns to the *tail* of the free
queue but stays in the prefix cache, so a later request can hit it; blocks of a request are
released last-position first, so that a request's tail is evicted before its prefix. A hit
on a free cached block takes it out of the free queue again ("touch").

Per-request tables. Each request has one block table per group. Position ``p`` of a group
with block size ``bs`` covers tokens ``[p*bs, (p+1)*bs)``. Sliding-window positions that
left the window and Mamba positions whose state is no longer needed hold the null block;
for those groups the freed positions form a prefix of the table (``num_freed_blocks``). A
Mamba table holds at most the state the next step reads and the one it writes (see
``group_policies.MambaPolicy``).

Call order for one request, per engine step::

    hit = pool.get_computed_blocks(hashes, num_tokens)           # first step only
    pool.allocate(rid, num_tokens_after_step, num_computed_tokens, hit=hit)
    ... the step computes tokens [num_computed_tokens, num_tokens_after_step) ...
    pool.cache_blocks(rid, hashes, num_tokens_after_step)
    ...
    pool.free(rid)

What is cached under which key is ``prefix_cache.PrefixCacheIndex``; the per-kind rules
(hits, freed positions, what an allocation appends) are ``group_policies``'.

Everything is deterministic: no randomness, insertion-ordered containers only.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvoffload.config import GroupSpec
from kvoffload.errors import ConfigError, InvariantError
from kvoffload.group_kinds import KIND_RULES
from kvoffload.jobs import NULL_BLOCK_ID
from kvoffload.keys import BlockHash
from kvoffload.refengine.group_policies import GroupPolicy, group_policy, lookup_order
from kvoffload.refengine.prefix_cache import CacheHit, PrefixCacheIndex

__all__ = ["MAX_AVOID_SCAN", "Allocation", "CacheHit", "HybridBlockPool", "PoolStats"]

MAX_AVOID_SCAN = 256
"""Free blocks the allocator passes over per allocation at most (``HybridBlockPool.avoid``)."""


@dataclass(frozen=True)
class Allocation:
    """What ``allocate`` did to a request's tables.

    Attributes:
        new_block_ids: per group, the ids appended to the table (nulls included, and on
            the first allocation the adopted hit blocks too), in position order; this is
            ``ScheduledRequest.new_block_ids``.
        freed_block_ids: per group, the ids ``remove_skipped_blocks`` released first.
    """

    new_block_ids: tuple[tuple[int, ...], ...]
    freed_block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's counters."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_requests: int
    num_evictions: int


class _Tables:
    """One request's block tables and per-group progress markers."""

    def __init__(self, num_groups: int) -> None:
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        self.dead: list[int] = [0] * num_groups
        """Leading positions known to be null (freed or never needed)."""
        self.checked: list[int] = [0] * num_groups
        """Positions already examined by ``cache_blocks``."""


class HybridBlockPool:
    """A hybrid prefix-caching block pool (see the module docstring).

    Args:
        groups: the KV-cache groups, in the engine's group order.
        num_blocks: block ids in the pool, the null block included (so ``num_blocks - 1``
            are allocatable).
        hash_block_size: tokens per chained hash in the ``block_hashes`` callers pass;
            defaults to the GCD of the groups' block sizes.
    """

    def __init__(self, groups: Sequence[GroupSpec], num_blocks: int,
                 hash_block_size: int | None = None) -> None:
        if not groups:
            raise ConfigError("groups", "is empty", "Give at least one group.")
        if num_blocks < 2:
            raise ConfigError("num_blocks", f"must be >= 2, got {num_blocks}",
                              "Block 0 is the reserved null block; give at least one more.")
        hbs = hash_block_size or math.gcd(*(g.block_size for g in groups))
        if hbs <= 0:
            raise ConfigError("hash_block_size", f"must be positive, got {hbs}",
                              "Use the engine's prefix-hash block size in tokens.")
        self.groups = tuple(groups)
        self.num_blocks = num_blocks
        self.hash_block_size = hbs
        self._policies = tuple(group_policy(i, g, hbs) for i, g in enumerate(self.groups))
        self._order = lookup_order(self._policies)
        self.hit_alignment = math.lcm(*(p.alignment for p in self._policies))
        """Tokens every hit is a multiple of (LCM of the groups' alignments)."""
        self._ref = [0] * num_blocks
        self._index = PrefixCacheIndex(num_blocks)
        """What is cached under which key (``prefix_cache``)."""
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._requests: dict[str, _Tables] = {}
        self.avoid: Callable[[int], bool] | None = None
        """Free blocks to hand out last (say, still used by a stuck transfer): the
        allocator passes over up to ``MAX_AVOID_SCAN`` of them at the free queue's front
        and takes them only when nothing else is free there."""

    # ------------------------------------------------------------------ lookups

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take (free ones, cached or not)."""
        return len(self._free)

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash],
                            num_tokens: int) -> CacheHit:
        """The engine's own prefix hit for a request of ``num_tokens`` tokens.

        Capped at ``num_tokens - 1``: the last token is always recomputed (its logits are
        needed). Pure: does not touch or pin anything.
        """
        return self.find_longest_cache_hit(block_hashes, max(0, num_tokens - 1))

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_tokens: int) -> CacheHit:
        """The longest hit of at most ``max_tokens`` tokens that every group can serve.

        Fixpoint across groups: full-attention groups are looked up once (their hits are
        downward closed), then sliding-window groups (largest window first) and Mamba
        groups are re-checked at the current length until a whole round leaves it
        unchanged; each group can only shrink it. The result is truncated to the final
        length. Pure: does not touch or pin anything.
        """
        align = self.hit_alignment
        length = min(max_tokens, len(block_hashes) * self.hash_block_size)
        length = max(0, length) // align * align
        hits: list[list[int]] = [[] for _ in self._policies]
        lookup = self._index.lookup
        others: list[GroupPolicy] = []
        for policy in self._order:
            if KIND_RULES[policy.kind].whole_prefix:
                hits[policy.index] = policy.find_hit(lookup, block_hashes, length, align)
                length = min(length, len(hits[policy.index]) * policy.block_size)
            else:
                others.append(policy)
        changed = bool(others)
        while changed:
            changed = False
            for policy in others:
                hit = policy.find_hit(lookup, block_hashes, length, align)
                hits[policy.index] = hit
                if len(hit) * policy.block_size < length:
                    length = len(hit) * policy.block_size
                    changed = True
        block_ids = tuple(tuple(h[:length // p.block_size])
                          for p, h in zip(self._policies, hits, strict=True))
        stamp = self._index.stamps
        stamps = tuple(tuple(stamp[b] if b != NULL_BLOCK_ID else 0 for b in ids)
                       for ids in block_ids)
        return CacheHit(num_tokens=length, block_ids=block_ids, stamps=stamps)

    # --------------------------------------------------------------- allocation

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int,
                 hit: CacheHit | None = None) -> Allocation | None:
        """Make the request's tables cover ``num_tokens`` tokens, or return None.

        ``num_computed_tokens`` tokens already have (or will have, through a load) their
        data; ``num_tokens - num_computed_tokens`` are computed next. On a request's first
        allocation ``hit`` adopts the engine's prefix hit (``hit.num_tokens <=
        num_computed_tokens``; tokens between are external and get fresh blocks to load
        into). Positions a group no longer needs at ``num_computed_tokens`` get the null
        block, hit or not.

        Calls ``remove_skipped_blocks(request_id, num_computed_tokens)`` first; its frees
        stand even when the allocation then fails. Otherwise a failed allocation (None:
        not enough free blocks) changes nothing. On success, hit blocks are pinned (ref
        +1, out of the free queue) and new blocks taken from the free queue's front,
        evicting their cached contents.
        """
        if not 0 <= num_computed_tokens <= num_tokens:
            raise ValueError(f"need 0 <= num_computed_tokens ({num_computed_tokens}) <= "
                             f"num_tokens ({num_tokens})")
        req = self._requests.get(request_id)
        if req is not None and hit is not None and hit.num_tokens > 0:
            raise ValueError(f"request {request_id!r}: a hit is adopted only on the first "
                             "allocation")
        if hit is not None:
            self._check_hit(hit, num_computed_tokens)
        freed: tuple[tuple[int, ...], ...] = tuple(() for _ in self._policies)
        if req is not None:
            freed = self.remove_skipped_blocks(request_id, num_computed_tokens)
        tables = req.tables if req is not None else [[] for _ in self._policies]
        plans = [policy.plan_appends(len(tables[policy.index]), num_computed_tokens, num_tokens,
                                     hit.block_ids[policy.index] if hit is not None else ())
                 for policy in self._policies]
        ref = self._ref
        touch = [b for plan in plans for b in plan if b]  # hit blocks (None and 0 are falsy)
        need = sum(plan.count(None) for plan in plans)
        need += sum(1 for b in touch if ref[b] == 0)
        if need > len(self._free):
            return None
        if req is None:
            req = self._requests[request_id] = _Tables(len(self._policies))
        for block in touch:  # pin hit blocks before new ones could evict them
            if ref[block] == 0:
                del self._free[block]
            ref[block] += 1
        new_ids: list[tuple[int, ...]] = []
        for policy, plan in zip(self._policies, plans, strict=True):
            if None in plan:
                fresh = iter(self._allocate_blocks(plan.count(None)))
                ids = tuple(next(fresh) if b is None else b for b in plan)
            else:
                ids = tuple(plan)  # type: ignore[arg-type]  # no None left
            req.tables[policy.index].extend(ids)
            g = policy.index
            req.dead[g] = max(req.dead[g], min(policy.dead_before(num_computed_tokens),
                                               len(req.tables[g])))
            new_ids.append(ids)
        return Allocation(new_block_ids=tuple(new_ids), freed_block_ids=freed)

    def _check_hit(self, hit: CacheHit, num_computed_tokens: int) -> None:
        if hit.num_tokens > num_computed_tokens:
            raise ValueError(f"hit of {hit.num_tokens} tokens exceeds num_computed_tokens "
                             f"{num_computed_tokens}")
        if len(hit.block_ids) != len(self._policies):
            raise ValueError(f"hit has {len(hit.block_ids)} groups, pool has "
                             f"{len(self._policies)}")
        for policy, ids in zip(self._policies, hit.block_ids, strict=True):
            if len(ids) != hit.num_tokens // policy.block_size:
                raise ValueError(f"group {policy.index}: hit of {hit.num_tokens} tokens "
                                 f"needs {hit.num_tokens // policy.block_size} ids, got "
                                 f"{len(ids)}")
            stamps = hit.stamps[policy.index] if hit.stamps else (0,) * len(ids)
            index = self._index
            for b, stamp in zip(ids, stamps, strict=True):
                if b == NULL_BLOCK_ID:
                    continue
                key = index.keys[b] if 0 < b < self.num_blocks else None
                if key is None or key[0] != policy.index or stamp not in (0, index.stamps[b]):
                    raise ValueError(f"group {policy.index}: hit block {b} is no longer "
                                     "cached as found (stale hit: look up again)")

    def _allocate_blocks(self, count: int) -> list[int]:
        """Take ``count`` blocks from the free queue's front, evicting their cached contents."""
        free, ref, index = self._free, self._ref, self._index
        keys, cached = index.keys, index.blocks
        out = []
        avoid = self.avoid
        passed: list[int] = []
        for _ in range(count):
            if not free:  # only passed-over blocks are left
                block = passed.pop(0)
            else:
                block, _ = free.popitem(last=False)
            while avoid is not None and len(passed) < MAX_AVOID_SCAN and free and avoid(block):
                passed.append(block)
                block, _ = free.popitem(last=False)
            key = keys[block]
            if key is not None:
                del cached[key]
                keys[block] = None
                index.evictions += 1
            ref[block] = 1
            out.append(block)
        for block in reversed(passed):  # back to the front, in their order
            free[block] = None
            free.move_to_end(block, last=False)
        return out

    def _release(self, blocks: Iterable[int]) -> None:
        """Unpin blocks; the ones nobody holds join the free queue's tail, in order."""
        for block in blocks:
            if block == NULL_BLOCK_ID:
                continue
            if self._ref[block] <= 0:
                raise InvariantError(f"block {block} released with ref count "
                                     f"{self._ref[block]}")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def remove_skipped_blocks(self, request_id: str,
                              num_computed_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Release the blocks the request no longer needs at ``num_computed_tokens``.

        Sliding window: blocks entirely before the last W-1 tokens. Mamba: every state
        before the one at ``num_computed_tokens``. Full attention: nothing. Each released
        position becomes null in the table; blocks are released last position first, so
        the later ones are evicted first. Released blocks stay in the prefix cache.

        Returns the released ids per group.
        """
        req = self._require(request_id)
        freed: list[tuple[int, ...]] = []
        for policy in self._policies:
            g = policy.index
            table = req.tables[g]
            upto = min(policy.dead_before(num_computed_tokens), len(table))
            released = []
            for pos in range(upto - 1, req.dead[g] - 1, -1):
                if table[pos] != NULL_BLOCK_ID:
                    released.append(table[pos])
                    table[pos] = NULL_BLOCK_ID
            self._release(released)
            req.dead[g] = max(req.dead[g], upto)
            freed.append(tuple(released))
        return tuple(freed)

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash],
                     num_computed_tokens: int) -> int:
        """Register the request's computed blocks in the prefix cache; returns how many.

        Call after a step, with the request's hashes (at ``hash_block_size``) and its
        computed token count. Attention groups register every full, non-null block;
        Mamba registers the state block when the request stands exactly on an aligned
        boundary. A block whose (group, hash) is already cached under another block
        stays uncached (one block per key).
        """
        req = self._require(request_id)
        added = 0
        index = self._index
        cached, keys, stamps = index.blocks, index.keys, index.stamps
        stamp = index.next_stamp
        for policy in self._policies:
            g = policy.index
            table = req.tables[g]
            hpb = policy.hashes_per_block
            positions = policy.cache_positions(num_computed_tokens, req.checked[g])
            if positions:
                lo, hi = positions.start, positions.stop
                if hi > len(table):
                    raise ValueError(f"request {request_id!r} group {g}: position {hi - 1} "
                                     f"is not allocated (table has {len(table)})")
                if hi * hpb > len(block_hashes):
                    raise ValueError(f"request {request_id!r}: {len(block_hashes)} hashes "
                                     f"do not cover group {g} position {hi - 1}")
                # Block at position p is cached under the hash at its last token.
                ends = block_hashes[(lo + 1) * hpb - 1:hi * hpb:hpb]
                for block, block_hash in zip(table[lo:hi], ends, strict=True):
                    if block == NULL_BLOCK_ID or keys[block] is not None:
                        continue
                    key = (g, block_hash)
                    if key in cached:
                        continue
                    cached[key] = block
                    keys[block] = key
                    stamps[block] = stamp
                    stamp += 1
                    added += 1
            req.checked[g] = policy.next_checked(num_computed_tokens, req.checked[g])
        index.next_stamp = stamp
        return added

    def free(self, request_id: str) -> None:
        """Release every block of a finished or preempted request (tail first per group).

        Cached blocks stay in the prefix cache until evicted.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        for table in req.tables:
            self._release(reversed(table))

    def rename(self, request_id: str, new_id: str) -> None:
        """Hand every block of ``request_id`` to the new owner ``new_id`` (which must not
        exist). The engine parks the blocks of a load it gave up on this way: they stay
        allocated, so nobody reuses them, until the late transfer is over."""
        if new_id in self._requests:
            raise ValueError(f"request {new_id!r} already holds blocks")
        self._requests[new_id] = self._require(request_id)
        del self._requests[request_id]

    # ------------------------------------------------------------ introspection

    def _require(self, request_id: str) -> _Tables:
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        return req

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's block table, per group."""
        return tuple(tuple(t) for t in self._require(request_id).tables)

    def num_freed_blocks(self, request_id: str) -> tuple[int, ...]:
        """Per group, leading positions the request no longer needs (all null).

        Feeds ``ScheduledRequest.num_freed_blocks``. Always 0 for full attention. A Mamba
        table may also hold nulls after this prefix (positions never given a state).
        """
        return tuple(self._require(request_id).dead)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._index.keys[block_id] is not None

    def cache_key(self, block_id: int) -> tuple[int, BlockHash] | None:
        """(group index, block hash) the block is cached under, or None."""
        return self._index.keys[block_id]

    def free_queue(self) -> tuple[int, ...]:
        """Free block ids, next to be allocated first."""
        return tuple(self._free)

    def stats(self) -> PoolStats:
        return PoolStats(num_blocks=self.num_blocks, num_free_blocks=len(self._free),
                         num_cached_blocks=len(self._index),
                         num_requests=len(self._requests), num_evictions=self._index.evictions)

    # ---------------------------------------------------------------- operator

    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Drop blocks from the prefix cache (e.g. after a failed load made their data
        invalid); returns how many were cached. Blocks in use stay with their requests."""
        return self._index.drop(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._index.clear()
        return True

    def check_integrity(self) -> None:
        """Raise ``InvariantError`` unless every bookkeeping rule holds.

        Ref counts equal table references; a block is free exactly when unreferenced; the
        null block is never free, cached or referenced; the cache map and the per-block
        keys agree; dead prefixes are null; no request holds a block twice.
        """
        refs = [0] * self.num_blocks
        for rid, req in self._requests.items():
            seen: set[int] = set()
            for policy, table in zip(self._policies, req.tables, strict=True):
                g = policy.index
                if any(b != NULL_BLOCK_ID for b in table[:req.dead[g]]):
                    raise InvariantError(f"request {rid!r} group {g}: live block in the "
                                         f"freed prefix of {req.dead[g]}")
                for b in table:
                    if b == NULL_BLOCK_ID:
                        continue
                    if b in seen:
                        raise InvariantError(f"request {rid!r} holds block {b} twice")
                    seen.add(b)
                    refs[b] += 1
        if (self._ref[NULL_BLOCK_ID] or NULL_BLOCK_ID in self._free
                or self._index.keys[NULL_BLOCK_ID]):
            raise InvariantError("the null block was allocated, freed or cached")
        if refs[NULL_BLOCK_ID]:
            raise InvariantError("the null block is counted as referenced")
        for b in range(1, self.num_blocks):
            if self._ref[b] != refs[b]:
                raise InvariantError(f"block {b}: ref count {self._ref[b]}, referenced "
                                     f"{refs[b]} times")
            if (self._ref[b] == 0) != (b in self._free):
                raise InvariantError(f"block {b}: ref count {self._ref[b]} but "
                                     f"{'in' if b in self._free else 'not in'} the free queue")
        self._index.check_integrity()
