"""HostTier scenarios (the tier contract of tiers/base.py) and the slot allocator."""

from __future__ import annotations

import pytest

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError, InvariantError
from kvoffload.keys import BlockHash, OffloadKey, make_offload_key
from kvoffload.offload import build_offload
from kvoffload.tiers.base import LookupResult, PrepareStoreResult, TierEvent
from kvoffload.tiers.eviction import ARCPolicy
from kvoffload.tiers.host import HostTier
from kvoffload.tiers.slots import SlotAllocator
from support.offload_kit import host_tier

FULL_BYTES = 128  # 2 layers x 64-byte pages
MAMBA_BYTES = 256  # one state snapshot; also the slot size


def make_config(slots: int, policy: str = "lru") -> OffloadConfig:
    groups = (
        GroupSpec(GroupKind.FULL_ATTENTION, block_size=16, num_layers=2, page_bytes=64),
        GroupSpec(GroupKind.MAMBA, block_size=16, num_layers=1, page_bytes=MAMBA_BYTES),
    )
    return OffloadConfig(groups=groups, hash_block_size=16,
                         host_capacity_bytes=MAMBA_BYTES * slots, eviction_policy=policy)


def make_tier(slots: int, policy: str = "lru", *, events: bool = True) -> HostTier:
    tier = host_tier(make_config(slots, policy), enable_events=events)
    assert tier.capacity == slots
    return tier


def k(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(BlockHash(i.to_bytes(16, "big")), group)


def keys(*ids: int) -> list[OffloadKey]:
    return [k(i) for i in ids]


def store(tier: HostTier, *ids: int) -> PrepareStoreResult:
    """Store ``k(i)`` for each id and complete it successfully."""
    result = tier.prepare_store(keys(*ids))
    assert result is not None
    tier.complete_store(result.keys_to_store)
    return result


def order(tier: HostTier) -> list[int]:
    """Present keys as ids, next eviction candidate first."""
    return [int.from_bytes(key[:16], "big") for key in tier]


# -- readability ----------------------------------------------------------------------


def test_a_key_is_readable_only_after_complete_store() -> None:
    tier = make_tier(4)
    assert tier.lookup(k(1)) is LookupResult.MISS
    result = tier.prepare_store(keys(1))
    assert result == PrepareStoreResult(keys_to_store=(k(1),), slots=(0,), evicted=())
    # Being written: the scheduler must wait, never read.
    assert tier.lookup(k(1)) is LookupResult.PENDING
    assert tier.ref_count(k(1)) == -1
    with pytest.raises(InvariantError, match="being written"):
        tier.prepare_load(keys(1))
    tier.complete_store(keys(1))
    assert tier.lookup(k(1)) is LookupResult.HIT
    assert tier.prepare_load(keys(1)).slots == (0,)
    tier.complete_load(keys(1))
    assert (tier.stats.lookup_misses, tier.stats.lookup_pending, tier.stats.lookup_hits) == (
        1, 1, 1)
    tier.check_integrity()


def test_prepare_load_of_an_absent_key_raises_and_pins_nothing() -> None:
    tier = make_tier(4)
    store(tier, 1)
    with pytest.raises(InvariantError, match="absent"):
        tier.prepare_load([k(1), k(2)])
    assert tier.ref_count(k(1)) == 0
    assert tier.usage().pinned_slots == 0


# -- prepare_store --------------------------------------------------------------------


def test_prepare_store_dedups_keys_present_or_being_written_and_repeats() -> None:
    tier = make_tier(8)
    store(tier, 1)  # ready
    assert tier.prepare_store(keys(2)) is not None  # being written
    result = tier.prepare_store(keys(3, 1, 2, 4, 3))
    assert result is not None
    assert result.keys_to_store == (k(3), k(4))  # input order, each once
    assert result.slots == (2, 3)  # never-used slots, counted up
    assert result.evicted == ()
    assert tier.stats.keys_deduped == 3
    # Everything present: nothing to write, but still a success (not None).
    assert tier.prepare_store(keys(1, 2, 3)) == PrepareStoreResult((), (), ())
    tier.check_integrity()


def test_lru_eviction_takes_the_least_recent_idle_key_and_reuses_its_slot() -> None:
    tier = make_tier(3)
    store(tier, 1, 2, 3)
    tier.take_events()
    result = tier.prepare_store(keys(4))
    assert result is not None
    assert result.evicted == (k(1),)
    assert result.slots == (0,)  # k(1)'s slot, handed straight back out
    assert tier.lookup(k(1)) is LookupResult.MISS
    assert tier.take_events() == [TierEvent(keys=(k(1),), tier="host", removed=True)]
    assert order(tier) == [2, 3, 4]
    assert tier.stats.keys_evicted == 1


def test_prepare_store_never_evicts_its_own_input_keys() -> None:
    tier = make_tier(3)
    store(tier, 1, 2, 3)  # 1 is least recent
    # The caller believes k(1) stays present: it is protected although it is the LRU.
    result = tier.prepare_store(keys(1, 9))
    assert result is not None
    assert result.keys_to_store == (k(9),)
    assert result.evicted == (k(2),)
    assert tier.lookup(k(1)) is LookupResult.HIT


@pytest.mark.parametrize("policy", ["lru", "arc", "value"])
def test_protected_keys_are_never_evicted(policy: str) -> None:
    """A cascade protects the keys requests wait for, besides the store's own keys."""
    tier = make_tier(3, policy)
    store(tier, 1, 2, 3)  # 1 is least recent
    result = tier.prepare_store(keys(2, 9), protected=frozenset(keys(1)))
    assert result is not None and result.evicted == (k(3),)  # neither 1 nor 2
    assert tier.lookup(k(1)) is LookupResult.HIT
    # Everything idle is protected or an input key: no room.
    assert tier.prepare_store(keys(10), protected=frozenset(keys(1, 2, 3))) is None


def test_pinned_and_writing_blocks_are_never_evicted() -> None:
    tier = make_tier(3)
    store(tier, 1, 2)
    tier.prepare_load(keys(1))  # pinned by a load
    assert tier.prepare_store(keys(3)) is not None  # being written
    result = tier.prepare_store(keys(4))
    assert result is not None and result.evicted == (k(2),)  # the only idle key
    # Now 1 is pinned, 3 writing, 4 writing: nothing is evictable.
    assert tier.prepare_store(keys(5)) is None
    tier.complete_load(keys(1))
    result = tier.prepare_store(keys(5))
    assert result is not None and result.evicted == (k(1),)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_failed_prepare_store_changes_nothing(policy: str) -> None:
    tier = make_tier(4, policy)
    store(tier, 1, 2, 3)
    tier.touch(keys(2))
    tier.prepare_load(keys(3))
    assert tier.prepare_store(keys(4)) is not None  # writing, fills the last slot
    before = tier.debug_state()
    usage = tier.usage()
    # Needs 3 victims; idle and unprotected: only k(1) (k(2) is an input key).
    assert tier.prepare_store(keys(2, 5, 6, 7)) is None
    # More new keys than the tier has slots.
    assert tier.prepare_store(keys(*range(10, 15))) is None
    assert tier.debug_state() == before
    assert tier.usage() == usage
    assert tier.stats.stores_rejected == 2
    tier.check_integrity()


def test_prepare_store_of_a_key_from_an_unknown_group_raises_without_change() -> None:
    tier = make_tier(4)
    before = tier.debug_state()
    with pytest.raises(InvariantError, match="group 7"):
        tier.prepare_store([k(1), k(2, group=7)])
    assert tier.debug_state() == before


# -- loads ----------------------------------------------------------------------------


def test_ref_counts_are_exact_and_unbalanced_complete_load_raises() -> None:
    tier = make_tier(4)
    store(tier, 1, 2)
    assert tier.prepare_load(keys(1, 2)).slots == (0, 1)
    assert tier.prepare_load(keys(1)).slots == (0,)  # a second load job of the same prefix
    assert tier.ref_count(k(1)) == 2 and tier.ref_count(k(2)) == 1
    assert tier.usage().pinned_slots == 2
    tier.complete_load(keys(1, 2))
    before = tier.debug_state()
    with pytest.raises(InvariantError, match="no matching prepare_load"):
        tier.complete_load(keys(1, 2))  # k(2) is no longer pinned
    with pytest.raises(InvariantError):
        tier.complete_load(keys(1, 1))  # k(1) holds only one pin
    with pytest.raises(InvariantError):
        tier.complete_load(keys(3))  # never stored
    assert tier.debug_state() == before  # all-or-nothing
    tier.complete_load(keys(1))
    assert tier.usage().pinned_slots == 0
    assert tier.ref_count(k(1)) == 0
    tier.check_integrity()


# -- touch ----------------------------------------------------------------------------


def test_touch_makes_the_first_key_most_recent() -> None:
    tier = make_tier(5)
    store(tier, 1, 2, 3, 4, 5)
    tier.touch(keys(1, 2, 3, 42))  # absent 42 ignored
    assert order(tier) == [4, 5, 3, 2, 1]
    result = tier.prepare_store(keys(6, 7, 8))
    assert result is not None and result.evicted == (k(4), k(5), k(3))


def test_arc_tier_promotes_on_touch_only_after_the_store_completed() -> None:
    tier = make_tier(4, "arc")
    arc = tier.policy
    assert isinstance(arc, ARCPolicy)
    result = tier.prepare_store(keys(1, 2))
    assert result is not None
    tier.touch(keys(1, 2))  # the planner touches right after preparing: not a reuse
    assert list(arc.t1) == [k(2), k(1)] and not arc.t2
    tier.complete_store(keys(1, 2))
    tier.touch(keys(1))  # a later lookup hit: a real second access
    assert list(arc.t1) == [k(2)] and list(arc.t2) == [k(1)]
    store(tier, 3, 4)
    result = tier.prepare_store(keys(5))
    assert result is not None and result.evicted == (k(2),)  # seen once goes first
    assert list(arc.b1) == [k(2)]


# -- complete_store -------------------------------------------------------------------


def test_failed_complete_store_removes_the_keys_and_frees_their_slots() -> None:
    tier = make_tier(3)
    store(tier, 1)
    tier.take_events()
    result = tier.prepare_store(keys(2, 3))
    assert result is not None and result.slots == (1, 2)
    assert tier.usage().used_slots == 3
    tier.complete_store(keys(2, 3, 1), success=False)  # k(1) is ready: left alone
    assert tier.lookup(k(2)) is LookupResult.MISS
    assert tier.lookup(k(3)) is LookupResult.MISS
    assert tier.lookup(k(1)) is LookupResult.HIT
    assert tier.usage().used_slots == 1 and tier.usage().writing_slots == 0
    assert tier.take_events() == []  # never readable, so no event either way
    assert tier.stats.keys_store_failed == 2
    again = tier.prepare_store(keys(5, 6))
    assert again is not None and again.evicted == () and sorted(again.slots) == [1, 2]
    tier.check_integrity()


def test_repeating_complete_store_is_harmless() -> None:
    tier = make_tier(3)
    store(tier, 1, 2)
    tier.prepare_load(keys(1))
    tier.take_events()
    before = tier.debug_state()
    tier.complete_store(keys(1, 2))
    tier.complete_store(keys(1, 2), success=False)  # ready keys are not torn down
    tier.complete_store(keys(9))  # absent key ignored
    assert tier.debug_state() == before
    assert tier.ref_count(k(1)) == 1


# -- events, usage, reset -------------------------------------------------------------


def test_events_report_stored_and_removed_keys_in_order() -> None:
    tier = make_tier(2)
    result = tier.prepare_store(keys(1, 2))
    assert result is not None
    assert tier.take_events() == []  # nothing readable yet
    tier.complete_store(keys(2))
    tier.complete_store(keys(1))
    store(tier, 3)
    assert tier.take_events() == [
        TierEvent(keys=(k(2),), tier="host", removed=False),
        TierEvent(keys=(k(1),), tier="host", removed=False),
        # Recency counts from prepare_store, not completion: k(1) is the LRU.
        TierEvent(keys=(k(1),), tier="host", removed=True),
        TierEvent(keys=(k(3),), tier="host", removed=False),
    ]
    assert tier.take_events() == []


def test_events_can_be_disabled() -> None:
    tier = make_tier(1, events=False)
    store(tier, 1)
    store(tier, 2)
    tier.reset()
    assert tier.take_events() == []
    assert tier.stats.keys_evicted == 1


def test_usage_counts_real_block_bytes_per_group() -> None:
    tier = make_tier(6)
    assert tier.prepare_store([k(1), k(2), k(3, group=1)]) is not None
    tier.complete_store([k(1), k(3, group=1)])
    tier.prepare_load([k(3, group=1)])
    usage = tier.usage()
    assert (usage.capacity_slots, usage.used_slots, usage.pinned_slots,
            usage.writing_slots) == (6, 3, 1, 1)
    assert usage.bytes_by_group == {0: 2 * FULL_BYTES, 1: MAMBA_BYTES}


def test_reset_drops_everything_and_reports_readable_keys_removed() -> None:
    tier = make_tier(4)
    store(tier, 1, 2)
    tier.prepare_load(keys(1))
    assert tier.prepare_store(keys(3)) is not None
    tier.take_events()
    tier.reset()
    assert len(tier) == 0
    assert all(tier.lookup(key) is LookupResult.MISS for key in keys(1, 2, 3))
    usage = tier.usage()
    assert (usage.used_slots, usage.pinned_slots, usage.writing_slots) == (0, 0, 0)
    assert usage.bytes_by_group == {0: 0, 1: 0}
    # Only keys that had a stored event get a removed one (k(3) was never readable).
    assert tier.take_events() == [TierEvent(keys=(k(1), k(2)), tier="host", removed=True)]
    assert store(tier, 7).slots == (0,)  # slots restart from 0
    assert tier.stats.keys_stored == 3  # stats survive a reset
    tier.check_integrity()


def test_unknown_policy_name_in_the_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="eviction_policy"):
        build_offload(make_config(4, "belady"))


def test_check_integrity_detects_corrupted_bookkeeping() -> None:
    tier = make_tier(4)
    store(tier, 1, 2)
    tier.check_integrity()
    state = tier.policy.get(k(1))
    assert state is not None
    state.ref = 3  # a pin nobody took: counters disagree
    with pytest.raises(InvariantError, match="pinned"):
        tier.check_integrity()
    state.ref = 0
    state.slot = 1  # two keys in one slot
    with pytest.raises(InvariantError, match="share one slot"):
        tier.check_integrity()
    state.slot = 0
    tier.space.slots.free([0])  # the slot of a live key handed back
    with pytest.raises(InvariantError, match="leaked or foreign"):
        tier.check_integrity()


# -- slot allocator -------------------------------------------------------------------


def test_slots_come_fresh_first_then_recycled_last_freed_first() -> None:
    alloc = SlotAllocator(5)
    assert alloc.allocate(3) == [0, 1, 2]
    alloc.free([1])
    alloc.free([0])
    assert (alloc.num_free, alloc.num_used) == (4, 1)
    assert alloc.allocate(4) == [3, 4, 0, 1]  # never-used first, then LIFO
    assert alloc.num_free == 0
    alloc.check_integrity(used_slots=[0, 1, 2, 3, 4])
    alloc.reset()
    assert alloc.allocate(1) == [0]


def test_slot_misuse_raises_without_change() -> None:
    alloc = SlotAllocator(3)
    alloc.allocate(2)
    before = alloc.debug_state()
    with pytest.raises(InvariantError, match="only 1 slots free"):
        alloc.allocate(2)
    with pytest.raises(InvariantError, match="not in use"):
        alloc.free([0, 2])  # 2 was never handed out
    with pytest.raises(InvariantError, match="listed twice"):
        alloc.free([1, 1])
    with pytest.raises(InvariantError, match="out of range"):
        alloc.free([3])
    assert alloc.debug_state() == before
    alloc.free([0])
    with pytest.raises(InvariantError, match="double free"):
        alloc.free([0])


def test_slot_integrity_check_compares_with_the_tiers_slots() -> None:
    alloc = SlotAllocator(4)
    alloc.allocate(3)
    alloc.free([1])
    alloc.check_integrity(used_slots=[0, 2])
    with pytest.raises(InvariantError, match="leaked or foreign"):
        alloc.check_integrity(used_slots=[0])  # slot 2 leaked
    with pytest.raises(InvariantError, match="leaked or foreign"):
        alloc.check_integrity(used_slots=[0, 1])  # slot 1 is free
    with pytest.raises(InvariantError, match="share one slot"):
        alloc.check_integrity(used_slots=[0, 0, 2])
