"""Stateful property test of HostTier against a reference model.

Random sequences of prepare_store / complete_store (success or failure, and harmless
repeats) / prepare_load / complete_load (and misuses of both) / touch / reset run on a tier
with a random policy and capacity. A plain-Python model tracks what must be true:

* a key is readable only after its store completed, PENDING while written, else MISS;
* ref counts are exact, and misuse raises ``InvariantError`` without change;
* pinned and writing keys are never evicted, nor a store's own input keys;
* ``prepare_store`` returns ``None`` exactly when not enough keys are evictable, and then
  changes nothing; LRU victims are exactly the model's least recent idle keys;
* slots are unique and in range, usage and events agree with the model;
* ``check_integrity`` passes after every step; at the end, releasing every job leaves
  nothing pinned or being written.

Examples per run: env ``KVOFFLOAD_HYPOTHESIS_EXAMPLES`` (default 50).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.keys import BlockHash, OffloadKey, key_group, make_offload_key
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.eviction import ARCPolicy
from kvoffload.tiers.host import HostTier
from support.offload_kit import host_tier

BLOCK_BYTES = (128, 256)  # per group: full attention 2 x 64, Mamba 256 (= slot size)
KEYS = [make_offload_key(BlockHash(i.to_bytes(16, "big")), i % 2) for i in range(10)]
EXAMPLES = int(os.environ.get("KVOFFLOAD_HYPOTHESIS_EXAMPLES", "50"))


def make_config(slots: int, policy: str) -> OffloadConfig:
    groups = (
        GroupSpec(GroupKind.FULL_ATTENTION, block_size=16, num_layers=2, page_bytes=64),
        GroupSpec(GroupKind.MAMBA, block_size=16, page_bytes=256),
    )
    return OffloadConfig(groups=groups, hash_block_size=16,
                         host_capacity_bytes=256 * slots, eviction_policy=policy)


class TierMachine(RuleBasedStateMachine):
    tier: HostTier
    policy: str
    capacity: int
    events_on: bool
    ready: dict[OffloadKey, int]  # readable key -> pins
    writing: set[OffloadKey]
    slot: dict[OffloadKey, int]
    lru: list[OffloadKey]  # present keys, least recent first (exact for LRU)
    store_jobs: list[tuple[OffloadKey, ...]]
    done_stores: list[tuple[OffloadKey, ...]]
    load_jobs: list[tuple[OffloadKey, ...]]
    seen_ready: set[OffloadKey]  # readable keys according to the event stream

    @initialize(policy=st.sampled_from(["lru", "arc"]), capacity=st.integers(1, 6),
                events_on=st.booleans())
    def setup(self, policy: str, capacity: int, events_on: bool) -> None:
        self.tier = host_tier(make_config(capacity, policy), enable_events=events_on)
        self.policy, self.capacity, self.events_on = policy, capacity, events_on
        self.ready, self.writing, self.slot, self.lru = {}, set(), {}, []
        self.store_jobs, self.done_stores, self.load_jobs = [], [], []
        self.seen_ready = set()

    def present(self) -> set[OffloadKey]:
        return set(self.ready) | self.writing

    # -- stores -----------------------------------------------------------------------

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def prepare_store(self, keys: list[OffloadKey]) -> None:
        present = self.present()
        new = list(dict.fromkeys(key for key in keys if key not in present))
        need = len(new) - (self.capacity - len(present))
        candidates = [key for key in self.lru if self.ready.get(key) == 0 and key not in keys]
        before = self.tier.debug_state()
        result = self.tier.prepare_store(keys)
        if need > len(candidates):
            assert result is None
            assert self.tier.debug_state() == before
            return
        assert result is not None
        assert list(result.keys_to_store) == new
        assert len(result.evicted) == max(need, 0)
        assert set(result.evicted) <= set(candidates)  # idle, unpinned, not an input key
        if self.policy == "lru":
            assert list(result.evicted) == candidates[:len(result.evicted)]
        for key in result.evicted:
            del self.ready[key], self.slot[key]
            self.lru.remove(key)
        assert len(set(result.slots)) == len(result.slots)
        assert not set(result.slots) & set(self.slot.values())
        assert all(0 <= s < self.capacity for s in result.slots)
        for key, slot in zip(result.keys_to_store, result.slots, strict=True):
            self.writing.add(key)
            self.slot[key] = slot
            self.lru.append(key)
        if result.keys_to_store:
            self.store_jobs.append(result.keys_to_store)

    @precondition(lambda self: self.store_jobs)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        job = self.store_jobs.pop(data.draw(st.integers(0, len(self.store_jobs) - 1)))
        self.tier.complete_store(job, success=success)
        for key in job:
            self.writing.remove(key)
            if success:
                self.ready[key] = 0
            else:
                del self.slot[key]
                self.lru.remove(key)
        self.done_stores.append(job)

    @precondition(lambda self: self.done_stores)
    @rule(data=st.data(), success=st.booleans())
    def repeat_complete_store(self, data: st.DataObject, success: bool) -> None:
        # Only while none of the job's keys is being written again by a newer job.
        eligible = [job for job in self.done_stores if not set(job) & self.writing]
        if not eligible:
            return
        job = data.draw(st.sampled_from(eligible))
        before = self.tier.debug_state()
        self.tier.complete_store(job, success=success)
        assert self.tier.debug_state() == before

    # -- loads ------------------------------------------------------------------------

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=4))
        assert self.tier.prepare_load(keys).slots == tuple(self.slot[key] for key in keys)
        for key in keys:
            self.ready[key] += 1
        self.load_jobs.append(tuple(keys))

    @precondition(lambda self: self.load_jobs)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        job = self.load_jobs.pop(data.draw(st.integers(0, len(self.load_jobs) - 1)))
        self.tier.complete_load(job)
        for key in job:
            self.ready[key] -= 1

    @rule(data=st.data())
    def prepare_load_of_unreadable_key_raises(self, data: st.DataObject) -> None:
        unreadable = [key for key in KEYS if key not in self.ready]
        if not unreadable:
            return
        bad = data.draw(st.sampled_from(unreadable))
        good = data.draw(st.lists(st.sampled_from(sorted(self.ready)), max_size=2)
                         if self.ready else st.just([]))
        before = self.tier.debug_state()
        with pytest.raises(InvariantError):
            self.tier.prepare_load([*good, bad])
        assert self.tier.debug_state() == before

    @rule(key=st.sampled_from(KEYS), extra=st.integers(1, 2))
    def unbalanced_complete_load_raises(self, key: OffloadKey, extra: int) -> None:
        before = self.tier.debug_state()
        with pytest.raises(InvariantError):
            self.tier.complete_load([key] * (self.ready.get(key, 0) + extra))
        assert self.tier.debug_state() == before

    # -- recency, reset ---------------------------------------------------------------

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def touch(self, keys: list[OffloadKey]) -> None:
        self.tier.touch(keys)
        for key in reversed(keys):
            if key in self.slot:
                self.lru.remove(key)
                self.lru.append(key)

    @rule()
    def reset(self) -> None:
        self.tier.reset()
        self.ready, self.writing, self.slot, self.lru = {}, set(), {}, []
        # The caller guarantees no completion arrives for jobs from before the reset.
        self.store_jobs, self.done_stores, self.load_jobs = [], [], []

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        self.tier.check_integrity()
        assert self.tier.is_full() == self.tier.usage().is_full

    @invariant()
    def every_key_answers_as_the_model_says(self) -> None:
        for key in KEYS:
            if key in self.ready:
                expected = LookupResult.HIT
                assert self.tier.ref_count(key) == self.ready[key]
            elif key in self.writing:
                expected = LookupResult.PENDING
                assert self.tier.ref_count(key) == -1
            else:
                expected = LookupResult.MISS
                assert self.tier.ref_count(key) is None
            assert self.tier.lookup(key) is expected
            assert self.tier.slot_of(key) == self.slot.get(key)

    @invariant()
    def usage_matches_the_model(self) -> None:
        usage = self.tier.usage()
        assert usage.capacity_slots == self.capacity
        assert usage.used_slots == len(self.slot) <= self.capacity
        assert usage.pinned_slots == sum(1 for pins in self.ready.values() if pins > 0)
        assert usage.writing_slots == len(self.writing)
        per_group = Counter(key_group(key) for key in self.slot)
        assert usage.bytes_by_group == {g: per_group[g] * b for g, b in enumerate(BLOCK_BYTES)}

    @invariant()
    def order_matches_the_model(self) -> None:
        if self.policy == "lru":
            assert list(self.tier) == self.lru
        else:
            assert set(self.tier) == set(self.slot)
            arc = self.tier.policy
            assert isinstance(arc, ARCPolicy)
            assert self.writing <= set(arc.t1)  # never promoted before the write completes

    @invariant()
    def events_replay_to_the_readable_set(self) -> None:
        events = self.tier.take_events()
        if not self.events_on:
            assert events == []
            return
        for event in events:
            assert event.tier == "host" and event.keys
            if event.removed:
                assert set(event.keys) <= self.seen_ready
                self.seen_ready -= set(event.keys)
            else:
                assert not set(event.keys) & self.seen_ready
                self.seen_ready |= set(event.keys)
        assert self.seen_ready == set(self.ready)

    def teardown(self) -> None:
        if not hasattr(self, "tier"):
            return
        for job in self.load_jobs:
            self.tier.complete_load(job)
        for job in self.store_jobs:
            self.tier.complete_store(job)
        usage = self.tier.usage()
        assert usage.pinned_slots == 0 and usage.writing_slots == 0
        assert all(self.tier.ref_count(key) == 0 for key in self.tier)
        self.tier.check_integrity()


TierMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40,
                                         deadline=None)
TestTierStateMachine = TierMachine.TestCase
