"""Eviction by the future (the ``oracle`` reference; ``kvoffload.sim.oracle.binding``).

``OraclePolicy`` evicts the idle key whose next use lies furthest ahead, weighted by its
bytes: the victim maximises ``(next use - now) x bytes``, where ``now`` is the first
request of the workload that has not started yet and a key no later request uses comes
first (Belady's rule with sizes, as in Belady-Size). It is a heuristic bound, not the
optimum: with keys of different sizes, and with hits that need a whole prefix, choosing
the best victims is NP-hard, and furthest-next-use-per-byte is the usual approximation.
Ties go to the deepest block (a shallower prefix keeps serving the hits that stop there).
Recency and the tier's hints (demote, cool, warm, values) are ignored: the future replaces
them.

Where it gets the future: an ``OracleClock`` (``next_use``, ``depth``, the keys each
request uses) that the store policy advances when a request starts; at each start the
keys that request used are rescored, so every other key's score stays exact without a
pass over the tier. One heap per group holds the keys, furthest next use first: within a
group every key has the same bytes, so the heap's top is that group's best victim, and
``evict`` compares the groups' tops only.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey, key_group
from kvoffload.tiers.eviction.base import BlockState, DictStatePolicy, Victims


class OracleClock(Protocol):
    """What the oracle's eviction asks of the future (``sim.oracle.binding.OracleRun``)."""

    @property
    def now(self) -> int:
        """The first request, in workload order, that has not started."""
        ...

    def next_use(self, key: OffloadKey) -> int:
        """The first request not started yet that uses ``key`` (a large number if none)."""
        ...

    def depth(self, key: OffloadKey) -> int:
        """Tokens of the prefix ending with ``key``'s block (0 if unknown)."""
        ...

    def subscribe(self, listener: Callable[[Sequence[OffloadKey]], None]) -> None:
        """Call ``listener`` with the keys a request uses when it starts."""
        ...


Entry = tuple[int, int, int, OffloadKey]
"""A heap entry: (-next use, -depth, sequence number, key)."""


class OraclePolicy(DictStatePolicy):
    """Furthest next use per byte first (module docstring)."""

    name = "oracle"

    def __init__(self, capacity: int, clock: OracleClock) -> None:
        super().__init__(capacity)
        self._clock = clock
        self._seq: dict[OffloadKey, int] = {}
        self._heaps: dict[int, list[Entry]] = {}
        self._counter = 0
        clock.subscribe(self._rescore)


    def _push(self, key: OffloadKey, group: int) -> None:
        self._counter += 1
        self._seq[key] = self._counter
        heap = self._heaps.setdefault(group, [])
        heapq.heappush(heap, (-self._clock.next_use(key), -self._clock.depth(key),
                              self._counter, key))
        if len(heap) > 64 and len(heap) > 4 * len(self._states):
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap entries (removed or rescored keys)."""
        for group, heap in self._heaps.items():
            live = [e for e in heap if self._seq.get(e[3]) == e[2]]
            heapq.heapify(live)
            self._heaps[group] = live

    def _rescore(self, keys: Sequence[OffloadKey]) -> None:
        states = self._states
        for key in keys:
            if key in states:
                self._push(key, key_group(key))

    def insert(self, key: OffloadKey, state: BlockState) -> None:
        if key in self._states:
            raise InvariantError(f"oracle: insert of a key already present ({key.hex()})")
        self._states[key] = state
        self._push(key, key_group(key))

    def remove(self, key: OffloadKey) -> BlockState:
        state = self._states.pop(key, None)
        if state is None:
            raise InvariantError(f"oracle: remove of an absent key ({key.hex()})")
        del self._seq[key]
        return state

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Nothing: a use changes no key's next use (the clock rescores at starts)."""
        del keys

    def _top(self, group: int, protected: AbstractSet[OffloadKey],
             skipped: list[Entry]) -> Entry | None:
        """The group's best victim entry (left on its heap); stale entries are dropped
        and keys that may not go now are set aside in ``skipped``."""
        heap = self._heaps[group]
        while heap:
            entry = heap[0]
            key = entry[3]
            if self._seq.get(key) != entry[2]:
                heapq.heappop(heap)
                continue
            if self._states[key].ref != 0 or key in protected:
                skipped.append(heapq.heappop(heap))
                continue
            return entry
        return None

    def _take(self, protected: AbstractSet[OffloadKey], sizes: Callable[[OffloadKey], int],
              enough: Callable[[int, int], bool]) -> Victims | None:
        victims: Victims = []
        skipped: dict[int, list[Entry]] = {g: [] for g in self._heaps}
        freed = 0
        now = self._clock.now
        try:
            while not enough(freed, len(victims)):
                best: tuple[int, int, int] | None = None
                best_group = -1
                for group in self._heaps:
                    entry = self._top(group, protected, skipped[group])
                    if entry is None:
                        continue
                    size = sizes(entry[3])
                    score = (-entry[0] - now + 1) * size, -entry[1], -entry[2]
                    if best is None or score > best:
                        best, best_group = score, group
                if best is None:
                    break
                _, _, _, key = heapq.heappop(self._heaps[best_group])
                del self._seq[key]
                victims.append((key, self._states.pop(key)))
                freed += sizes(key)
        finally:
            for group, entries in skipped.items():
                for entry in entries:
                    heapq.heappush(self._heaps[group], entry)
        if not enough(freed, len(victims)):
            # Put them back as they were: evict is atomic.
            for key, state in victims:
                self._states[key] = state
                self._push(key, key_group(key))
            return None
        return victims

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> Victims | None:
        if n < 0:
            raise InvariantError(f"oracle: evict({n})")
        if n == 0:
            return []
        if n > len(self._states):
            return None
        return self._take(protected, lambda key: 1, lambda freed, count: count >= n)

    def evict_bytes(self, need_bytes: int, need_keys: int, protected: AbstractSet[OffloadKey],
                    size_of: Callable[[OffloadKey], int]) -> Victims:
        victims = self._take(protected, size_of,
                             lambda freed, count: freed >= need_bytes and count >= need_keys)
        if victims is None:
            raise InvariantError("oracle: evict_bytes found too few idle keys")
        return victims

    def items(self) -> Iterator[tuple[OffloadKey, BlockState]]:
        """Present keys, furthest next use first (one group at a time is not the exact
        victim order across groups of different sizes; this is for inspection)."""
        clock = self._clock
        order = sorted(self._states, key=lambda k: (-clock.next_use(k), -clock.depth(k)))
        return iter([(key, self._states[key]) for key in order])

    def clear(self) -> None:
        self._states.clear()
        self._seq.clear()
        self._heaps.clear()

    def debug_state(self) -> dict[str, object]:
        return {"keys": sorted((k, s.ref, s.slot) for k, s in self._states.items())}
