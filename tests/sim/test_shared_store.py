"""The modelled shared tier of a simulated fleet (``kvoffload.sim.shared_store``): engines see
each other's blocks once written, never a write in flight; LRU within the budget; one
engine's reset leaves the others' blocks."""

from __future__ import annotations

import pytest

from kvoffload.blockfile.framing import HEADER_BYTES
from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.keys import BlockHasher, OffloadKey, make_offload_key
from kvoffload.sim.shared_store import SharedStore
from kvoffload.tiers.base import LookupResult
from refengine.engine_kit import BS, tiny_preset

LAYOUT = tiny_preset().layout(BS)
CONFIG = OffloadConfig(groups=LAYOUT.specs, hash_block_size=BS, host_capacity_bytes=1 << 20,
                       eviction_policy="lru")
ENTRY = HEADER_BYTES + CONFIG.resolved[0].block_bytes
"""Bytes one key of the one group takes in the store (one rank)."""

KEYS = [make_offload_key(h, 0) for h in BlockHasher(BS).extend([], list(range(40)))]


def stored(store: SharedStore, key: OffloadKey) -> None:
    view = store.view()
    assert view.begin_write(key)
    view.end_write(key, ok=True)


def test_a_block_is_seen_by_the_other_engines_once_written() -> None:
    store = SharedStore(CONFIG, 8 * ENTRY)
    a, b = store.view(), store.view()
    key = KEYS[0]
    assert a.status(key) is b.status(key) is LookupResult.MISS
    assert a.begin_write(key)
    assert a.status(key) is LookupResult.PENDING  # its own write: ask again later
    assert b.status(key) is LookupResult.MISS  # a server has no value before the write lands
    assert not b.begin_write(key)  # one copy is enough
    a.end_write(key, ok=True)
    assert b.status(key) is LookupResult.HIT
    assert b.begin_read(key)
    b.end_read(key, ok=True)
    assert store.held() == (ENTRY, 1)
    assert a.held() == b.held() == (0, 0)  # the fleet reports the store once
    store.check_integrity()


def test_least_recently_used_blocks_leave_first_but_never_one_being_read() -> None:
    store = SharedStore(CONFIG, 3 * ENTRY)
    for key in KEYS[:3]:
        stored(store, key)
    a, b = store.view(), store.view()
    assert a.begin_read(KEYS[0])  # pinned: not evicted under its reader
    b.touch([KEYS[1]])  # recency is shared
    assert b.begin_write(KEYS[3])
    b.end_write(KEYS[3], ok=True)
    assert [a.status(k) for k in KEYS[:4]] == [LookupResult.HIT, LookupResult.HIT,
                                               LookupResult.MISS, LookupResult.HIT]
    assert b.stats.evicted == 1
    a.end_read(KEYS[0], ok=True)
    store.check_integrity()


def test_one_engines_reset_keeps_the_fleets_blocks() -> None:
    store = SharedStore(CONFIG, 8 * ENTRY)
    stored(store, KEYS[0])
    a, b = store.view(), store.view()
    assert a.begin_write(KEYS[1]) and a.begin_read(KEYS[0])
    assert a.reset() is False  # nothing to purge
    assert b.status(KEYS[0]) is LookupResult.HIT
    assert b.status(KEYS[1]) is LookupResult.MISS and b.begin_write(KEYS[1])
    with pytest.raises(InvariantError):
        a.end_write(KEYS[1], ok=True)  # a's write was dropped by its reset
    b.end_write(KEYS[1], ok=True)
    store.check_integrity()
