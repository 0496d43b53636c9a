"""A store into a full one-group tier (victims' slots and states handed straight to the
new keys) ends exactly as the general path does: same results, slots, states, events."""

from __future__ import annotations

import random

import pytest

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.keys import BlockHash, OffloadKey, make_offload_key
from kvoffload.tiers.host import HostTier
from support.offload_kit import host_tier

PAGE = 64


def tier(slots: int, policy: str, *, groups: int) -> HostTier:
    """``slots`` slots under slot accounting; with ``groups=2`` a second (unused) group of
    the same page size makes the tier take its general store path for group-0 keys."""
    specs = tuple(GroupSpec(GroupKind.FULL_ATTENTION, block_size=16, num_layers=1,
                            page_bytes=PAGE) for _ in range(groups))
    config = OffloadConfig(groups=specs, hash_block_size=16,
                           host_capacity_bytes=PAGE * slots, eviction_policy=policy)
    built = host_tier(config)
    assert built.capacity == slots
    return built


def key(i: int) -> OffloadKey:
    return make_offload_key(BlockHash(i.to_bytes(16, "big")), 0)


def test_a_full_tier_gives_the_last_victims_slot_to_the_first_new_key() -> None:
    one = tier(3, "lru", groups=1)
    first = one.prepare_store([key(1), key(2), key(3)])
    assert first is not None and first.slots == (0, 1, 2)
    one.complete_store(first.keys_to_store)
    second = one.prepare_store([key(4), key(5)])
    assert second is not None
    assert second.evicted == (key(1), key(2)) and second.evicted_slots == (0, 1)
    assert second.slots == (1, 0)  # as freeing 0, 1 then allocating two (LIFO) gives
    assert [one.ref_count(key(i)) for i in (3, 4, 5)] == [0, -1, -1]
    assert one.usage().used_slots == 3 and one.usage().writing_slots == 2
    one.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(4))
def test_full_tier_stores_end_as_the_general_path(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    fast, general = tier(6, policy, groups=1), tier(6, policy, groups=2)
    pinned: list[list[OffloadKey]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            batch = [key(rng.randrange(20)) for _ in range(rng.randint(1, 4))]
            protected = frozenset(key(rng.randrange(20)) for _ in range(rng.randint(0, 2)))
            got = fast.prepare_store(batch, protected=protected)
            want = general.prepare_store(batch, protected=protected)
            assert got == want
            if got is not None and rng.random() < 0.8:
                ok = rng.random() < 0.9
                fast.complete_store(got.keys_to_store, ok)
                general.complete_store(got.keys_to_store, ok)
        elif op < 0.7:
            refs = {k: fast.ref_count(k) for k in map(key, range(20))}
            ready = [k for k, ref in refs.items() if ref is not None and ref >= 0]
            if ready:
                load = rng.sample(ready, min(len(ready), 2))
                assert fast.prepare_load(load).slots == general.prepare_load(load).slots
                pinned.append(load)
        elif op < 0.85 and pinned:
            load = pinned.pop(rng.randrange(len(pinned)))
            fast.complete_load(load)
            general.complete_load(load)
        else:
            touched = [key(rng.randrange(20)) for _ in range(rng.randint(1, 5))]
            fast.touch(touched)
            general.touch(touched)
        fast_state, general_state = fast.debug_state(), general.debug_state()
        assert fast_state.pop("keys_per_group") == [len(fast)]
        assert general_state.pop("keys_per_group") == [len(general), 0]
        assert fast_state.keys() == general_state.keys()
        for name in fast_state:
            if name not in ("bytes_by_group",):
                assert fast_state[name] == general_state[name], name
        fast.check_integrity()
        general.check_integrity()
