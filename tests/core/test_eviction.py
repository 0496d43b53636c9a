"""Eviction policies on their own: registry, LRU and ARC order, atomicity, linear scans."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from kvoffload import policies
from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError, InvariantError
from kvoffload.keys import BlockHash, OffloadKey, make_offload_key
from kvoffload.planner.selective import HitPointStorePolicy
from kvoffload.planner.store_policy import StorePolicy
from kvoffload.policies import cache_policy, cache_policy_names, register_cache_policy
from kvoffload.tiers.eviction import (
    WRITING,
    ARCPolicy,
    BlockState,
    EvictionPolicy,
    LRUPolicy,
)
from support.offload_kit import host_tier, planner_for


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The eviction half of the cache policy registered as ``name``."""
    return cache_policy(name).eviction(capacity)


def k(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(BlockHash(i.to_bytes(16, "big")), group)


def fill(policy: EvictionPolicy, ids: Iterable[int], ref: int = 0) -> None:
    """Insert keys ``k(i)`` with slot ``i`` and the given ref count (0: ready and idle)."""
    for i in ids:
        policy.insert(k(i), BlockState(slot=i, ref=ref))


def state(policy: EvictionPolicy, i: int) -> BlockState:
    found = policy.get(k(i))
    assert found is not None
    return found


def victims(policy: EvictionPolicy, n: int, protected: Iterable[int] = ()) -> list[int] | None:
    out = policy.evict(n, {k(i) for i in protected})
    if out is None:
        return None
    return [state.slot for _, state in out]


class CountingSet(set[OffloadKey]):
    """A protected set that counts membership tests, to measure how far a scan walks."""

    checks = 0

    def __contains__(self, item: object) -> bool:
        self.checks += 1
        return super().__contains__(item)


# -- registry -------------------------------------------------------------------------


def test_builtin_policies_are_registered_and_built_by_name() -> None:
    assert {"lru", "arc", "hybrid", "value"} <= set(cache_policy_names())
    assert isinstance(make_policy("lru", 3), LRUPolicy)
    arc = make_policy("arc", 5)
    assert isinstance(arc, ARCPolicy)
    assert arc.capacity == 5


def test_unknown_policy_is_a_config_error_listing_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        make_policy("mru", 4)
    assert info.value.field == "eviction_policy"
    assert "'mru'" in str(info.value)
    assert "'lru'" in str(info.value) and "'arc'" in str(info.value)


def test_register_policy_adds_names_and_refuses_silent_replacement(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cache_policy_names()  # the built-in entries first
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))

    class FIFOPolicy(LRUPolicy):
        name = "fifo-test"

        def touch(self, keys: Sequence[OffloadKey]) -> None:
            pass  # first in, first out: use does not matter

    register_cache_policy("fifo-test", FIFOPolicy)
    register_cache_policy("fifo-test", FIFOPolicy)  # same factory again: no-op
    assert isinstance(make_policy("fifo-test", 2), FIFOPolicy)
    with pytest.raises(ValueError, match="already registered"):
        register_cache_policy("lru", FIFOPolicy)
    register_cache_policy("lru", FIFOPolicy, replace=True)
    assert isinstance(make_policy("lru", 2), FIFOPolicy)


def test_one_entry_gives_the_tier_its_eviction_and_the_planner_its_store_policy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's policy registered with an eviction only stores every block (the null
    store policy), said by its entry; with a store policy, the planner uses that one."""
    cache_policy_names()
    monkeypatch.setattr(policies, "_REGISTRY", dict(policies._REGISTRY))

    class UsersStorePolicy(StorePolicy):
        """A store policy of the user's own."""

    register_cache_policy("mine", LRUPolicy)
    register_cache_policy("counted", LRUPolicy, lambda context: UsersStorePolicy())
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, 4),
              GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8))
    for name, store in (("mine", StorePolicy), ("counted", UsersStorePolicy),
                        ("hybrid", HitPointStorePolicy)):
        config = OffloadConfig(groups, 4, 64, eviction_policy=name)
        tier = host_tier(config)
        assert type(tier._policy) is LRUPolicy
        assert type(planner_for(config, tier).store_policy) is store


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LRUPolicy(0)
    with pytest.raises(ValueError):
        ARCPolicy(-1)


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_insert_twice_and_remove_absent_are_invariant_errors(cls: type[EvictionPolicy]) -> None:
    policy = cls(4)
    fill(policy, [1])
    with pytest.raises(InvariantError):
        policy.insert(k(1), BlockState(slot=9))
    with pytest.raises(InvariantError):
        policy.remove(k(2))
    assert policy.remove(k(1)).slot == 1
    assert len(policy) == 0 and policy.get(k(1)) is None


# -- LRU ------------------------------------------------------------------------------


def test_lru_evicts_in_insertion_order_when_untouched() -> None:
    lru = LRUPolicy(8)
    fill(lru, [1, 2, 3, 4])
    assert victims(lru, 2) == [1, 2]
    assert [s.slot for _, s in lru.items()] == [3, 4]


def test_lru_touch_processes_in_reverse_so_first_key_ends_most_recent() -> None:
    lru = LRUPolicy(8)
    fill(lru, [1, 2, 3, 4, 5])
    # A request's prefix [1, 2, 3] is touched: 1 (shared by most requests) ends hottest.
    lru.touch([k(1), k(2), k(3), k(99)])  # 99 is absent: ignored
    assert [s.slot for _, s in lru.items()] == [4, 5, 3, 2, 1]
    assert victims(lru, 3) == [4, 5, 3]


def test_lru_never_evicts_protected_pinned_or_writing_keys() -> None:
    lru = LRUPolicy(8)
    fill(lru, [1])
    fill(lru, [2], ref=WRITING)
    fill(lru, [3], ref=2)
    fill(lru, [4, 5])
    assert victims(lru, 1, protected=[4]) == [1]
    assert victims(lru, 1, protected=[5]) == [4]
    assert victims(lru, 1, protected=[5]) is None
    assert [s.slot for _, s in lru.items()] == [2, 3, 5]


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_failed_evict_changes_nothing(cls: type[EvictionPolicy]) -> None:
    policy = cls(8)
    fill(policy, [1, 2, 3])
    fill(policy, [4], ref=1)
    fill(policy, [5], ref=WRITING)
    policy.touch([k(2), k(4)])
    assert victims(policy, 2) is not None  # evicts 1 and 3 (ARC: both from t1)
    fill(policy, [6, 7])
    before = policy.debug_state()
    # Idle keys: 2, 6, 7; with 6 protected only two remain.
    assert victims(policy, 3, protected=[6]) is None
    assert victims(policy, 9) is None
    assert policy.debug_state() == before
    assert victims(policy, 0) == []
    with pytest.raises(InvariantError):
        policy.evict(-1, set())


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy])
def test_evict_scan_is_linear_with_many_blocked_keys_at_the_cold_end(
        cls: type[EvictionPolicy]) -> None:
    blocked, idle = 2000, 2000
    policy = cls(blocked + idle)
    fill(policy, range(blocked))
    fill(policy, range(blocked, blocked + idle))
    protected = CountingSet(k(i) for i in range(blocked))
    out = policy.evict(idle // 2, protected)
    assert out is not None
    assert [s.slot for _, s in out] == list(range(blocked, blocked + idle // 2))
    # One pass over the blocked prefix, not one per victim (which would be ~2M checks).
    assert protected.checks <= blocked + idle


# -- ARC ------------------------------------------------------------------------------


def arc_lists(arc: ARCPolicy) -> dict[str, list[int]]:
    def ids(keys: Iterable[OffloadKey]) -> list[int]:
        return [int.from_bytes(key[:16], "big") for key in keys]
    return {"t1": ids(arc.t1), "t2": ids(arc.t2), "b1": ids(arc.b1), "b2": ids(arc.b2)}


def test_arc_insert_goes_to_t1_and_a_ready_touch_promotes_to_t2() -> None:
    arc = ARCPolicy(4)
    fill(arc, [1, 2, 3])
    assert arc_lists(arc)["t1"] == [1, 2, 3]
    arc.touch([k(2), k(3)])  # reverse: 3 then 2, so 2 ends most recent in t2
    assert arc_lists(arc) == {"t1": [1], "t2": [3, 2], "b1": [], "b2": []}
    arc.touch([k(3)])  # already in t2: moves to its MRU end
    assert arc_lists(arc)["t2"] == [2, 3]


def test_arc_touch_of_a_block_being_written_keeps_it_in_t1() -> None:
    arc = ARCPolicy(4)
    fill(arc, [1])
    fill(arc, [2], ref=WRITING)  # prepared for a store; the store's own touch follows
    fill(arc, [3])
    arc.touch([k(2)])
    assert arc_lists(arc)["t1"] == [1, 3, 2]  # MRU of t1, not promoted
    assert arc_lists(arc)["t2"] == []
    state(arc, 2).ref = 0  # the write completed
    arc.touch([k(2)])
    assert arc_lists(arc) == {"t1": [1, 3], "t2": [2], "b1": [], "b2": []}


def test_arc_ghost_hits_adapt_the_target_and_steer_eviction() -> None:
    arc = ARCPolicy(4)
    fill(arc, [1, 2, 3, 4])
    arc.touch([k(3), k(4)])  # t2 = [4, 3]
    assert victims(arc, 2) == [1, 2]  # |t1| = 2 >= target 0: take from t1
    assert arc_lists(arc) == {"t1": [], "t2": [4, 3], "b1": [1, 2], "b2": []}

    # 1 was evicted from t1 too early: a B1 hit raises the target by max(1, |b2|/|b1|) = 1.
    arc.touch([k(1)])
    assert arc.target_t1_size == 1.0
    assert arc_lists(arc)["b1"] == [2, 1]

    fill(arc, [5, 6])
    assert victims(arc, 1) == [5]  # |t1| = 2 >= 1
    assert victims(arc, 1) == [6]  # |t1| = 1 >= 1
    assert arc_lists(arc)["b1"] == [2, 1, 5, 6]

    arc.touch([k(2)])  # another B1 hit: target 2
    assert arc.target_t1_size == 2.0
    fill(arc, [7])
    assert victims(arc, 1) == [4]  # |t1| = 1 < 2: the LRU of t2 goes, to b2
    assert arc_lists(arc) == {"t1": [7], "t2": [3], "b1": [1, 5, 6, 2], "b2": [4]}

    # A B2 hit lowers the target by max(1, |b1|/|b2|) = 4, floored at 0.
    arc.touch([k(4)])
    assert arc.target_t1_size == 0.0
    arc.check_integrity()


def test_arc_target_is_capped_at_capacity() -> None:
    arc = ARCPolicy(2)
    fill(arc, [1, 2])
    assert victims(arc, 2) == [1, 2]
    for _ in range(5):
        arc.touch([k(1)])
    assert arc.target_t1_size == 2.0
    arc.check_integrity()


def test_arc_ghost_lists_are_trimmed_to_capacity_and_reinsert_drops_the_ghost() -> None:
    arc = ARCPolicy(2)
    for i in range(1, 6):
        fill(arc, [i])
        if len(arc) == 2:
            assert victims(arc, 1) is not None
    assert arc_lists(arc)["b1"] == [3, 4]  # only the two most recent ghosts remain
    fill(arc, [3])  # a ghost comes back: it is a key again, no longer a ghost
    assert arc_lists(arc)["b1"] == [4]
    assert 3 in arc_lists(arc)["t1"]
    arc.check_integrity()


def test_arc_evict_falls_back_to_the_other_list_when_the_preferred_one_is_blocked() -> None:
    arc = ARCPolicy(8)
    fill(arc, [1, 2, 3, 4])
    arc.touch([k(3), k(4)])  # t1 = [1, 2], t2 = [4, 3]
    state(arc, 1).ref = 1  # pinned by a load
    state(arc, 2).ref = 1
    assert victims(arc, 1) == [4]  # target 0 prefers t1, which is all pinned
    assert arc_lists(arc)["b2"] == [4]

    arc2 = ARCPolicy(8)
    fill(arc2, [1, 2, 3])
    arc2.touch([k(3)])  # t1 = [1, 2], t2 = [3]
    arc2.target_t1_size = 8.0  # prefers t2; once t2 runs dry, t1 still has idle keys
    assert victims(arc2, 3) == [3, 1, 2]


def test_arc_evict_never_takes_protected_pinned_or_writing_keys() -> None:
    arc = ARCPolicy(8)
    fill(arc, [1])
    fill(arc, [2], ref=WRITING)
    fill(arc, [3], ref=1)
    fill(arc, [4])
    arc.touch([k(4)])
    assert victims(arc, 2, protected=[1]) is None
    assert victims(arc, 1, protected=[1]) == [4]
    assert victims(arc, 1) == [1]
    assert victims(arc, 1) is None
    assert arc_lists(arc) == {"t1": [2, 3], "t2": [], "b1": [1], "b2": [4]}


def test_arc_clear_drops_keys_ghosts_and_target() -> None:
    arc = ARCPolicy(3)
    fill(arc, [1, 2])
    victims(arc, 1)
    arc.touch([k(1)])
    arc.clear()
    assert arc.debug_state() == ARCPolicy(3).debug_state()


def test_arc_check_integrity_detects_a_key_in_two_lists() -> None:
    arc = ARCPolicy(4)
    fill(arc, [1])
    arc.check_integrity()
    arc.b1[k(1)] = None  # corrupt: present and ghost at once
    with pytest.raises(InvariantError, match="present and a ghost"):
        arc.check_integrity()
