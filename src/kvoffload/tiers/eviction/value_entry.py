"""The value policy's per-key record (``ValueEntry``) and its heaps' helpers.

``kvoffload.tiers.eviction.value.ValuePolicy`` keeps one ``ValueEntry`` per key: the key's
``BlockState`` (ref count, slot, group, which the tier reads and writes) and the policy's
own fields in one object, so that a key costs one object and one dict entry, and the
tier's per-key loops read states through the policy's dict itself
(``EvictionPolicy.state_of``). Invariants the policy keeps (``ValuePolicy.check_integrity``):
``low`` is ``cold or prio == DEMOTED``, and ``hinted`` implies ``prio == DEMOTED``.
"""

from __future__ import annotations

import heapq

from kvoffload.keys import OffloadKey
from kvoffload.tiers.eviction.base import BlockState

DEMOTED = float("-inf")
"""Priority of a demoted key: below every live key."""

Heap = list[tuple[float, int, OffloadKey]]
"""``(priority, sequence, key)`` entries, lowest first."""


class ValueEntry(BlockState):
    """A key's ``BlockState`` with the policy's own fields: the one object the policy keeps
    per key (the tier reads and writes ``ref`` through it as through any state). A state
    made elsewhere (a plain ``BlockState``) is copied into one on ``insert``; one made by
    ``new_state`` (or detached by an eviction) is taken as it is, its policy fields set
    anew."""

    __slots__ = ("cold", "density", "hinted", "inserted", "low", "prio", "seq", "stamp")

    cold: bool  # inserted cold and not used since
    hinted: bool  # demoted by a hint (a touch undoes it), not for a lost anchor
    low: bool  # cold or demoted: its live heap entry is in the low heap
    density: float  # -1.0: not valued yet
    prio: float
    seq: int  # the live heap entry's sequence number
    stamp: int  # the clock at the last insertion or touch
    inserted: int  # the clock at insertion


def live_top(heap: Heap, entries: dict[OffloadKey, ValueEntry],
             ) -> tuple[float, int, OffloadKey] | None:
    """The heap's lowest live entry, one whose sequence is its key's current one in
    ``entries`` (stale entries above it are popped)."""
    while heap:
        item = heap[0]
        entry = entries.get(item[2])
        if entry is not None and entry.seq == item[1]:
            return item
        heapq.heappop(heap)
    return None
