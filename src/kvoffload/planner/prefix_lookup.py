"""A request's prefix in the tier: its offload keys, how far a hit reaches, and what to keep
warm.

``PrefixLookup`` serves the planner's lookup step. It asks the tier about each (group,
block) at most once per lookup, combines the groups by the fixpoint of
``kvoffload.planner.lookup.combined_hit_end`` (rule 5 of ``docs/architecture.md``: a hit is
valid for every group at once), tells the store policy what it can learn, and asks a tier
that answers PENDING for slower copies to bring up what would hit.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import cast

from kvoffload.config import OffloadConfig
from kvoffload.keys import BlockHash, OffloadKey, make_offload_key
from kvoffload.planner.lookup import BlockReadable, GroupView, combined_hit_end, lookup_order
from kvoffload.planner.positions import useful_blocks
from kvoffload.planner.state import RequestState
from kvoffload.planner.store_policy import StorePolicy
from kvoffload.tiers.base import LookupResult, Tier, TierHints


@dataclass(frozen=True, slots=True)
class HitReach:
    """How far a request's hit reaches now, and whether waiting could make it reach
    further (``PrefixLookup.find``).

    Attributes:
        end: the hit's end (tokens) with what the tier can read now.
        waiting_helps: some keys a longer hit needs are PENDING: asking again later could
            give more than ``end``.
        answer_wait_s: when ``waiting_helps``, ``Tier.answer_wait_s`` of the PENDING keys
            (how long the tier may still take to answer about them; > 0.0 while a lower
            tier is still asking a server, or a promote waits for host room); else 0.0.
    """

    end: int
    waiting_helps: bool = False
    answer_wait_s: float = 0.0


class PrefixLookup:
    """Lookups, key lists and touches of one planner's requests."""

    def __init__(self, config: OffloadConfig, tier: Tier, policy: StorePolicy) -> None:
        self.tier = tier
        self._policy = policy
        self._groups = config.resolved
        self._order = lookup_order(self._groups)
        self._alignment = config.hit_alignment
        self._last_token_recomputed = config.has_windowed_group
        self._key_suffix = [make_offload_key(BlockHash(b""), g.index) for g in self._groups]

    def refresh_keys(self, st: RequestState) -> None:
        """Append a key for every offloaded block completed since the last call (one whose
        key hash exists: ``ResolvedGroup.key_hash_index``)."""
        hashes = st.request.block_hashes
        num_hashes = len(hashes)
        if num_hashes == st.hashes_keyed:
            return  # no hash since the last call: every key exists already
        st.hashes_keyed = num_hashes
        for g, gs, suffix in zip(self._groups, st.groups, self._key_suffix, strict=True):
            keys = gs.keys
            if len(keys) < g.num_keys(num_hashes):
                # hash + suffix is make_offload_key(hash, g.index), minus a call per key.
                keys.extend(cast("list[OffloadKey]",
                                 [hashes[i] + suffix for i in range(
                                     g.key_hash_index(len(keys)), num_hashes,
                                     g.hashes_per_block)]))

    def find(self, st: RequestState, num_computed: int) -> HitReach:
        """How far the request's hit reaches beyond ``num_computed`` tokens (``HitReach``),
        within the request's ``max_load_tokens``.

        Counts nothing; tells the store policy (``observe_lookup``) where the
        full-attention prefix and the hit reach once the stores in flight land, and
        prefetches the keys of that hit when some are PENDING.
        """
        request = st.request
        max_end = st.controls.load_end(
            num_computed, request.num_tokens - (1 if self._last_token_recomputed else 0))
        tier_lookup = self.tier.lookup
        hit, miss, pending = LookupResult.HIT, LookupResult.MISS, LookupResult.PENDING
        # Each (group, block) is asked of the tier at most once per lookup, whatever the
        # fixpoint re-checks; one closure per group keeps the per-block cost to one call.
        seen: list[dict[int, LookupResult]] = [{} for _ in self._groups]
        saw_pending = False
        pending_keys: list[OffloadKey] = []

        def readable(keys: list[OffloadKey], cache: dict[int, LookupResult],
                     accept_pending: bool) -> BlockReadable:
            def status(i: int) -> LookupResult:
                nonlocal saw_pending
                found = cache.get(i)
                if found is None:
                    found = cache[i] = tier_lookup(keys[i])
                    if found is pending:
                        saw_pending = True
                        pending_keys.append(keys[i])
                return found

            if accept_pending:
                return lambda i: (cache.get(i) or status(i)) is not miss
            return lambda i: (cache.get(i) or status(i)) is hit

        def views(accept_pending: bool) -> list[GroupView]:
            return [GroupView(g, len(st.groups[g.index].keys),
                              readable(st.groups[g.index].keys, seen[g.index], accept_pending))
                    for g in self._order]

        end = combined_hit_end(views(False), num_computed, max_end, self._alignment)
        once_landed = views(True)
        full_end = 0
        learns = self._policy.learns_points
        if learns:
            # Learn from where the prefix reaches once the stores in flight land: a lookup
            # that is deferred and asked again must tell the policy what the answer does.
            # (Before ``hopeful``: probing the full-attention prefix may find stores pending.)
            full_only = [v for v in once_landed if v.group.window_blocks is None]
            full_end = combined_hit_end(full_only, num_computed, max_end, self._alignment)
        hopeful = (combined_hit_end(once_landed, num_computed, max_end, self._alignment)
                   if saw_pending else end)
        if learns:
            self._policy.observe_lookup(st, full_end, hopeful)
        if not saw_pending or hopeful <= end:
            return HitReach(end)
        self.tier.hint(TierHints(prefetch=tuple(self.hit_keys(st, num_computed, hopeful))))
        wait_s = self.tier.answer_wait_s(pending_keys)
        if wait_s > 0.0:
            # A server is still being asked (or host room for a promote is awaited; the
            # probe below then finds answers known already). The fixpoint looks at one
            # window or Mamba candidate at a time (the next one only once the last is
            # known absent), so ask about every block a hit in (end, hopeful] could use
            # now: one round trip instead of one per candidate.
            for g in self._order:
                if g.window_blocks is None:
                    continue
                keys, cache = st.groups[g.index].keys, seen[g.index]
                obs = g.offloaded_block_size
                for k in useful_blocks(g, self._alignment,
                                       max(num_computed // obs, end // obs - g.window_blocks),
                                       min(hopeful // obs, len(keys))):
                    if k not in cache:
                        cache[k] = tier_lookup(keys[k])
        return HitReach(end, waiting_helps=True, answer_wait_s=wait_s)

    def hit_keys(self, st: RequestState, start: int, end: int) -> list[OffloadKey]:
        """Keys a load of tokens ``[start, end)`` reads: every block of a full-attention
        group, the last window of a window group, the state at ``end`` of a Mamba group."""
        keys: list[OffloadKey] = []
        for g, gs in zip(self._groups, st.groups, strict=True):
            last = end // g.offloaded_block_size
            first = start // g.offloaded_block_size
            if g.window_blocks is not None:
                first = max(first, last - g.window_blocks)
            keys.extend(gs.keys[first:last])
        return keys

    def touch(self, st: RequestState, skip: AbstractSet[OffloadKey] = frozenset()) -> None:
        """Keep warm what a future hit on this request's prefix needs.

        Full attention: every key. Window and Mamba groups: the keys from the last W
        blocks of the first hit on -- of those, only blocks that some aligned hit can use:
        the others are never stored (``positions.useful_blocks``), so touching them would
        only cost time (for a 16-block alignment, 15 of every 16 Mamba keys). Keys in
        ``skip`` are left as they are.
        """
        keys: list[OffloadKey] = []
        for g, gs in zip(self._groups, st.groups, strict=True):
            if g.window_blocks is None:
                keys.extend(gs.keys)
                continue
            blocks = useful_blocks(g, self._alignment,
                                   max(0, gs.num_hit_blocks - g.window_blocks), len(gs.keys))
            keys.extend(gs.keys[blocks.start:blocks.stop:blocks.step]
                        if isinstance(blocks, range) else [gs.keys[k] for k in blocks])
        if skip:
            keys = [key for key in keys if key not in skip]
        self.tier.touch(keys)
