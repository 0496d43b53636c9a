"""Eviction by value per byte, blended with recency (``"value"``).

Each key carries a *value density*: the prefill compute a hit through it saves divided by
the bytes that hit needs (``ValueHint``, given by the planner, which knows positions and
the model). A key's priority blends recency and value, as in Marconi:
``clock + weight * n * d / d_ref``, where ``clock`` counts insertions and touches (one per
key), ``n`` is the number of keys held (``n`` ticks of the clock are one *generation* of
the cache), ``d`` is the key's density and ``d_ref`` a running mean of the densities
seen. Insertion and every touch reset the priority, so a key that is not used again falls
behind (recency), and a key that saves much compute per byte survives about ``weight``
more generations per mean density (value). A value hint changes the value part only,
never the key's place in time. ``weight = 0`` orders keys exactly as LRU does. The lowest
priority is evicted first, so a touch that lists a prefix first-block-first keeps its
early blocks longest, as under LRU.

Hit-point consistency: a window block or Mamba state names the full-attention key it
depends on (its *anchor*, ``ValueHint.anchor``). When an anchor is evicted (or removed)
its dependents can no longer serve any hit, so they are demoted: evicted before any other
key. Demotion hints (``demote``) do the same for keys the planner knows no likely hit uses;
a touch undoes such a hint (the key was used after all), never a demotion for a lost
anchor.

Cold insertion (``cool``): keys the planner makes *cold* (bimodal insertion, see
``kvoffload.planner.insertion``) are evicted before normal ones while normal keys are at
most ``normal_share`` of the keys held, and after them otherwise: however many keys go in
normally, the newest cold ones keep some room. Demoted keys go before both. A touch
makes a cold key normal; a key touched since its insertion is not made cold.

Victims are found through two heaps of ``(priority, sequence, key)`` entries, one for
normal keys and one for cold and demoted keys; an entry is live while its sequence is the
key's current one (touches push new entries and leave the old ones to be skipped). A
change computes the key's priority and sequence at once (they decide the order) but only
marks the key *dirty*: its heap entry is pushed when victims are next looked for, so a
key changed several times between evictions (inserted, cooled, valued; touched by every
lookup of its prefix) is pushed once, and a tier that never evicts never pushes. The
heaps are rebuilt when stale entries would outnumber live ones, or when most keys are
dirty, so their size stays linear in the keys held. A key's record is its ``BlockState``
itself (``value_entry.ValueEntry``): one object per key.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import cast

from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey
from kvoffload.tiers.eviction.anchors import AnchorLinks
from kvoffload.tiers.eviction.base import (
    NORMAL_SHARE,
    BlockState,
    DictStatePolicy,
    ValueHint,
    ValueRun,
    Victims,
    cold_goes_first,
)
from kvoffload.tiers.eviction.value_entry import DEMOTED, Heap, ValueEntry, live_top

DEFAULT_WEIGHT = 0.25
"""Value against recency (``ValuePolicy.weight``), chosen on the sweeps in docs/policy.md."""


def _fresh_entry(state: BlockState, clock: int) -> ValueEntry:
    """The entry of a key inserted at ``clock``: ``state`` itself when it is a
    ``ValueEntry`` (made by ``new_state`` or detached by an eviction), else a copy of it;
    normal, not valued yet."""
    entry = (state if type(state) is ValueEntry
             else ValueEntry(state.slot, state.ref, state.group))
    entry.cold = entry.hinted = entry.low = False
    entry.density = -1.0
    entry.stamp = entry.inserted = clock
    return entry


class ValuePolicy(DictStatePolicy):
    """Recency plus weighted value per byte, with anchor-consistent demotion (module doc).

    Args:
        capacity: the most keys the tier holds.
        weight: how much value counts against recency: a key of twice the mean density
            survives about ``weight`` more generations of the cache than a mean one.
            ``0`` is LRU with demotion hints and anchor consistency.
        normal_share: while cold keys are held, normal keys are evicted first once they
            are more than this share of the keys held (module doc).
    """

    name = "value"

    def __init__(self, capacity: int, weight: float = DEFAULT_WEIGHT,
                 normal_share: float = NORMAL_SHARE) -> None:
        self._entries: dict[OffloadKey, ValueEntry] = {}
        """Every present key's entry, which is its state (``get``, ``state_of``)."""
        super().__init__(capacity, cast("dict[OffloadKey, BlockState]", self._entries))
        if weight < 0:
            raise ValueError(f"value weight must be >= 0, got {weight}")
        if not 0 < normal_share <= 1:
            raise ValueError(f"value normal_share must be in (0, 1], got {normal_share}")
        self.weight = weight
        self.normal_share = normal_share
        self._heap: Heap = []  # normal keys
        self._low_heap: Heap = []  # cold and demoted keys
        self._dirty: dict[OffloadKey, ValueEntry] = {}  # changed since the heaps were read
        self._num_low = 0
        self._seq = 0
        self._clock = 0
        self._density_sum = 0.0
        self._density_count = 0
        self._anchors = AnchorLinks()

    # -- priorities ---------------------------------------------------------------------

    @property
    def reference_density(self) -> float:
        """Mean density of the hints seen so far (1.0 before any)."""
        return self._density_sum / self._density_count if self._density_count else 1.0

    def _priority(self, entry: ValueEntry) -> float:
        relative = 1.0 if entry.density < 0 else entry.density / self.reference_density
        return entry.stamp + self.weight * len(self._entries) * relative

    def _push(self, key: OffloadKey, entry: ValueEntry, prio: float) -> None:
        """Give ``key`` priority ``prio`` and the next sequence; its heap entry waits in
        ``_dirty`` until ``_flush``."""
        self._seq += 1
        entry.prio = prio
        entry.seq = self._seq
        low = entry.cold or prio == DEMOTED
        self._num_low += low - entry.low
        entry.low = low
        self._dirty[key] = entry

    def _flush(self) -> None:
        """Push the live heap entry of every dirty key (or rebuild both heaps when that is
        cheaper, or stale entries would outnumber live ones)."""
        dirty = self._dirty
        if not dirty:
            return
        held = len(self._entries)
        if (2 * len(dirty) > held
                or len(self._heap) + len(self._low_heap) + len(dirty) > 2 * held + 64):
            self._rebuild_heaps()
            return
        heap, low_heap = self._heap, self._low_heap
        push = heapq.heappush
        for key, entry in dirty.items():
            push(low_heap if entry.low else heap, (entry.prio, entry.seq, key))
        dirty.clear()

    def _rebuild_heaps(self) -> None:
        """Both heaps anew from the live entries (nothing dirty after)."""
        self._dirty.clear()
        self._heap = [(e.prio, e.seq, k) for k, e in self._entries.items() if not e.low]
        self._low_heap = [(e.prio, e.seq, k) for k, e in self._entries.items() if e.low]
        heapq.heapify(self._heap)
        heapq.heapify(self._low_heap)

    # -- EvictionPolicy -----------------------------------------------------------------

    new_state = ValueEntry

    def is_cold(self, key: OffloadKey) -> bool:
        """Whether ``key`` is held cold (inserted cold, not used since, not demoted)."""
        entry = self._entries.get(key)
        return entry is not None and entry.cold and entry.prio != DEMOTED

    def insert(self, key: OffloadKey, state: BlockState) -> None:
        if key in self._entries:
            raise InvariantError(f"value: insert of a key already present ({key.hex()})")
        self._clock += 1
        entry = self._entries[key] = _fresh_entry(state, self._clock)
        self._push(key, entry, self._priority(entry))

    def insert_all(self, keys: Sequence[OffloadKey], states: Sequence[BlockState]) -> None:
        """``insert`` each key in order, in one loop (what ``insert`` does, inlined)."""
        if len(keys) != len(states):
            raise InvariantError(f"value: {len(keys)} keys but {len(states)} states")
        entries = self._entries
        if not entries.keys().isdisjoint(keys) or len(set(keys)) < len(keys):
            raise InvariantError("value: insert of a key already present")
        dirty = self._dirty
        weight = self.weight
        clock, seq = self._clock, self._seq
        try:
            for key, state in zip(keys, states, strict=True):
                clock += 1
                seq += 1
                entry = entries[key] = _fresh_entry(state, clock)
                # ``_priority`` of an entry not valued yet (relative density 1.0).
                entry.prio = clock + weight * len(entries) * 1.0
                entry.seq = seq
                dirty[key] = entry
        finally:
            self._clock, self._seq = clock, seq

    def remove(self, key: OffloadKey) -> BlockState:
        entry = self._entries.pop(key, None)
        if entry is None:
            raise InvariantError(f"value: remove of an absent key ({key.hex()})")
        self._num_low -= entry.low
        self._dirty.pop(key, None)
        self._forget(key)
        return entry

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Present keys become most recent, ``keys[0]`` last, including keys demoted by a
        hint; keys demoted because their anchor left stay demoted."""
        entries = self._entries
        get = entries.get
        dirty = self._dirty
        # What ``_priority`` and ``_push`` do per key, inlined: the number of keys and the
        # reference density do not change during a touch. A key that is neither cold nor
        # demoted (``low`` unset) has nothing of either to clear; a touched key is normal.
        scale = self.weight * len(entries)
        reference = self.reference_density
        clock, num_low = self._clock, self._num_low
        ahead = self._seq - clock  # each touched key takes the next clock and sequence
        for key in reversed(keys):
            entry = get(key)
            if entry is None:
                continue
            if entry.low:
                if entry.prio == DEMOTED and not entry.hinted:
                    continue
                num_low -= 1
                entry.low = entry.cold = entry.hinted = False
            clock += 1
            entry.stamp = clock
            density = entry.density
            entry.prio = clock + (scale if density < 0 else scale * (density / reference))
            entry.seq = clock + ahead
            dirty[key] = entry
        self._clock, self._seq, self._num_low = clock, clock + ahead, num_low

    def warm(self, keys: Sequence[OffloadKey]) -> None:
        """Present cold keys are touched (normal again); the others are left."""
        entries = self._entries
        self.touch([key for key in keys if (entry := entries.get(key)) is not None
                    and entry.cold and entry.prio != DEMOTED])

    def demote(self, keys: Sequence[OffloadKey]) -> None:
        """Present keys go before every other key (in the order given) until touched."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.hinted = entry.prio != DEMOTED or entry.hinted
                self._push(key, entry, DEMOTED)

    def cool(self, keys: Sequence[OffloadKey]) -> int:
        """Present keys not touched since their insertion become cold (evicted before
        normal keys while those are at most ``normal_share`` of the keys held; oldest cold
        key first) until they are touched; demoted keys stay demoted. Returns how many
        went cold."""
        cooled = 0
        for key in keys:
            entry = self._entries.get(key)
            if (entry is not None and not entry.cold and entry.prio != DEMOTED
                    and entry.stamp == entry.inserted):
                entry.cold = True
                self._push(key, entry, self._priority(entry))
                cooled += 1
        return cooled

    def set_values(self, values: Sequence[ValueHint | ValueRun]) -> None:
        """Record densities (a key keeps the highest it was given) and anchors. The value
        part of a key's priority follows its density; its place in time does not move;
        demoted keys stay demoted. A ``ValueRun`` is its hints in order."""
        entries = self._entries
        get = entries.get
        dirty = self._dirty
        anchors = self._anchors
        # ``_priority`` and ``_push`` inlined: the number of keys does not change here, the
        # reference density only when a key is valued for the first time. A key that is
        # not demoted keeps its heap (``low`` is its ``cold``).
        scale = self.weight * len(entries)
        reference = self.reference_density
        for item in values:
            if isinstance(item, ValueRun):
                keys, saved, nbytes, links = item.keys, item.saved, item.nbytes, item.anchors
            else:
                keys, saved, nbytes, links = (item.key,), item.saved, item.nbytes, (item.anchor,)
            if nbytes <= 0:
                continue
            density = saved / nbytes
            if links is None:
                reference = self._value_run(keys, density, scale, reference)
                continue
            for key, anchor in zip(keys, links, strict=False):
                entry = get(key)
                if entry is None:
                    continue
                if density > entry.density:
                    if entry.density < 0:
                        self._density_sum += density
                        self._density_count += 1
                        reference = self._density_sum / self._density_count
                    entry.density = density
                    if entry.prio != DEMOTED:
                        self._seq += 1
                        entry.prio = entry.stamp + scale * (
                            1.0 if density < 0 else density / reference)
                        entry.seq = self._seq
                        dirty[key] = entry
                if anchor is not None and anchor != key and key not in anchors:
                    if anchor not in entries:
                        # Its anchor is gone already: this key can serve no hit (for good).
                        entry.hinted = False
                        self._push(key, entry, DEMOTED)
                        continue
                    anchors.link(key, anchor)

    def _value_run(self, keys: Iterable[OffloadKey], density: float, scale: float,
                   reference: float) -> float:
        """Give ``density`` to the present ``keys`` worth less (``set_values`` without
        anchors); return the reference density after."""
        get = self._entries.get
        dirty = self._dirty
        seq = self._seq
        total, count = self._density_sum, self._density_count
        share = 1.0 if density < 0 else None  # the relative density when not a ratio
        for key in keys:
            entry = get(key)
            if entry is None or not density > entry.density:
                continue
            if entry.density < 0:
                total += density
                count += 1
                reference = total / count
            entry.density = density
            if entry.prio != DEMOTED:
                seq += 1
                entry.prio = entry.stamp + scale * (
                    share if share is not None else density / reference)
                entry.seq = seq
                dirty[key] = entry
        self._seq = seq
        self._density_sum, self._density_count = total, count
        return reference

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> Victims | None:
        if n < 0:
            raise InvariantError(f"value: evict({n})")
        if n == 0:
            return []
        if n > len(self._entries):
            return None
        return self._take(lambda victims, _freed: len(victims) >= n, protected, None)

    def evict_bytes(self, need_bytes: int, need_keys: int, protected: AbstractSet[OffloadKey],
                    size_of: Callable[[OffloadKey], int]) -> Victims:
        victims = self._take(
            lambda found, freed: freed >= need_bytes and len(found) >= need_keys,
            protected, size_of)
        if victims is None:
            raise InvariantError("value: evict_bytes found too few idle keys")
        return victims

    def _take(self, done: Callable[[Victims, int], bool], protected: AbstractSet[OffloadKey],
              size_of: Callable[[OffloadKey], int] | None) -> Victims | None:
        """Pop victims until ``done``, in eviction order (``_next_heap``); all or nothing."""
        self._flush()
        entries = self._entries
        victims: Victims = []
        popped: list[tuple[Heap, tuple[float, int, OffloadKey]]] = []
        freed = 0
        total = len(entries)
        normal = total - self._num_low
        while not done(victims, freed):
            heap = self._next_heap(normal, total)
            if heap is None:
                for source, item in popped:
                    heapq.heappush(source, item)
                return None
            item = heapq.heappop(heap)
            popped.append((heap, item))
            key = item[2]
            entry = entries[key]
            if entry.ref != 0 or key in protected:
                continue
            victims.append((key, entry))
            total -= 1
            normal -= not entry.low
            if size_of is not None:
                freed += size_of(key)
        # Commit: victims leave, skipped live entries go back.
        chosen = {key for key, _ in victims}
        for source, item in popped:
            if item[2] not in chosen:
                heapq.heappush(source, item)
        for key, _ in victims:
            self._num_low -= entries.pop(key).low
        for key, _ in victims:
            self._forget(key)
        return victims

    def _next_heap(self, normal: int, total: int) -> Heap | None:
        """The heap whose top is evicted next (``None``: both empty), given ``normal`` of
        ``total`` keys left are normal."""
        low = live_top(self._low_heap, self._entries)
        high = live_top(self._heap, self._entries)
        if low is None:
            return self._heap if high is not None else None
        return self._low_heap if self._low_first(low[0], high is not None, normal,
                                                 total) else self._heap

    def _low_first(self, low_priority: float, has_normal: bool, normal: int,
                   total: int) -> bool:
        """Whether the next victim is the lowest cold or demoted key (of priority
        ``low_priority``) rather than the lowest normal one, ``normal`` of ``total`` keys
        left being normal: demoted keys first, then normal keys while they are more
        than ``normal_share`` of the keys, cold keys otherwise."""
        return (not has_normal or low_priority == DEMOTED
                or cold_goes_first(normal, total, self.normal_share))

    def _forget(self, key: OffloadKey) -> None:
        """Drop a departed key's anchor links; what depended on it can serve no hit any
        more: demoted for good (a touch does not undo it)."""
        for dep in self._anchors.forget(key):
            entry = self._entries.get(dep)
            if entry is not None:
                entry.hinted = False
                self._push(dep, entry, DEMOTED)

    def items(self) -> Iterator[tuple[OffloadKey, BlockState]]:
        """Every key in the order evictions would take them if none were pinned (a pinned
        key is passed over, but still counts in the share of normal keys)."""
        def by_priority(low: bool) -> list[tuple[OffloadKey, ValueEntry]]:
            return sorted(((k, e) for k, e in self._entries.items() if e.low == low),
                          key=lambda kv: (kv[1].prio, kv[1].seq), reverse=True)

        high, low = by_priority(False), by_priority(True)  # next victim last
        total = len(self._entries)
        normal = len(high)
        while high or low:
            take_low = bool(low) and self._low_first(low[-1][1].prio, bool(high), normal,
                                                     total)
            key, entry = low.pop() if take_low else high.pop()
            normal -= not take_low
            total -= 1
            yield key, entry

    def clear(self) -> None:
        self._entries.clear()
        self._heap.clear()
        self._low_heap.clear()
        self._dirty.clear()
        self._num_low = 0
        self._anchors.clear()
        self._density_sum = 0.0
        self._density_count = 0

    def debug_state(self) -> dict[str, object]:
        return {
            "order": [(k, s.ref, s.slot) for k, s in self.items()],
            "anchors": self._anchors.debug_state(),
        }

    def check_integrity(self) -> None:
        super().check_integrity()
        if any(self._entries.get(k) is not e for k, e in self._dirty.items()):
            raise InvariantError("value: a dirty key is not held")
        for low in (False, True):
            live = {(e.prio, e.seq, k) for k, e in self._entries.items()
                    if e.low == low and k not in self._dirty}
            if not live <= set(self._low_heap if low else self._heap):
                raise InvariantError("value: a key has no live heap entry")
        if any(e.low != (e.cold or e.prio == DEMOTED) or (e.hinted and e.prio != DEMOTED)
               for e in self._entries.values()):
            raise InvariantError("value: a key's heap does not follow its kind")
        if self._num_low != sum(e.low for e in self._entries.values()):
            raise InvariantError("value: the count of cold and demoted keys is off")
        self._anchors.check_integrity(self._entries)

