"""Adaptive Replacement Cache (ARC) eviction.

Four ordered lists, least recent first:

* ``t1``: keys seen once (inserted, not yet touched while ready);
* ``t2``: keys seen again (touched while ready);
* ``b1`` / ``b2``: ghosts, keys recently evicted from ``t1`` / ``t2`` (no state, no slot).

``target_t1_size`` is how large ``t1`` should be. A touch of a ``b1`` ghost (a key evicted
too early for being "seen once") raises it by ``max(1, |b2| / |b1|)``, capped at capacity;
a touch of a ``b2`` ghost lowers it by ``max(1, |b1| / |b2|)``, floored at 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain

from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey
from kvoffload.tiers.eviction.base import (
    BlockState,
    EvictionPolicy,
    Victims,
    next_evictable,
)


class ARCPolicy(EvictionPolicy):
    """ARC over the tier's keys.

    * ``insert`` puts the key at the MRU end of ``t1`` and drops any ghost of it.
    * ``touch`` (last key first, so the first key ends most recent): a ready ``t1`` key moves
      to ``t2``; a ``t1`` key still being written only moves to ``t1``'s MRU end (the store's
      own touch is not a second access); a ``t2`` key moves to ``t2``'s MRU end; a ghost
      adapts ``target_t1_size`` and moves to its ghost list's MRU end.
    * ``evict`` simulates first: it takes from ``t1`` while the simulated ``t1`` size is at
      least ``int(target_t1_size)``, else from ``t2``; when the preferred list has no
      evictable key left it takes from the other. Only if ``n`` victims are found does it
      commit: ``t1`` victims become ``b1`` ghosts, ``t2`` victims ``b2`` ghosts, and each
      ghost list is trimmed (oldest first) to ``capacity``.

    The lists are public for inspection; mutate them only through the methods.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, BlockState] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, BlockState] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockState | None:
        state = self.t1.get(key)
        return state if state is not None else self.t2.get(key)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def insert(self, key: OffloadKey, state: BlockState) -> None:
        if key in self.t1 or key in self.t2:
            raise InvariantError(f"arc: insert of a key already present ({key.hex()})")
        self.t1[key] = state
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> BlockState:
        state = self.t1.pop(key, None)
        if state is None:
            state = self.t2.pop(key, None)
        if state is None:
            raise InvariantError(f"arc: remove of an absent key ({key.hex()})")
        return state

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        for key in reversed(keys):
            state = t1.get(key)
            if state is not None:
                if state.ref >= 0:
                    del t1[key]
                    t2[key] = state
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1:
                delta = max(1.0, len(b2) / len(b1))
                self.target_t1_size = min(self.target_t1_size + delta, float(self.capacity))
                b1.move_to_end(key)
            elif key in b2:
                delta = max(1.0, len(b1) / len(b2))
                self.target_t1_size = max(self.target_t1_size - delta, 0.0)
                b2.move_to_end(key)

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> Victims | None:
        if n < 0:
            raise InvariantError(f"arc: evict({n})")
        if n == 0:
            return []
        if n > len(self):
            return None
        plan = self._plan_victims(n, protected)
        if plan is None:
            return None
        from_t1, from_t2, order = plan
        # Commit.
        for key, _ in from_t1:
            del self.t1[key]
            self.b1[key] = None
        for key, _ in from_t2:
            del self.t2[key]
            self.b2[key] = None
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        it1, it2 = iter(from_t1), iter(from_t2)
        return [next(it1) if took_t1 else next(it2) for took_t1 in order]

    def _plan_victims(self, n: int, protected: AbstractSet[OffloadKey],
                      ) -> tuple[Victims, Victims, list[bool]] | None:
        """Simulate ``evict(n)`` without changing anything: the victims from ``t1`` and
        from ``t2`` (each in list order) and, per victim in eviction order, whether it came
        from ``t1``; ``None`` when fewer than ``n`` keys are evictable. One iterator per
        list (monotonic scans: linear per call)."""
        t1_iter = iter(self.t1.items())
        t2_iter = iter(self.t2.items())
        target = int(self.target_t1_size)
        virtual_t1 = len(self.t1)
        from_t1: Victims = []
        from_t2: Victims = []
        order: list[bool] = []  # True: the i-th victim came from t1
        t1_done = t2_done = False
        while len(order) < n:
            prefer_t1 = virtual_t1 >= target
            entry = None
            took_t1 = False
            for use_t1 in (prefer_t1, not prefer_t1):
                if use_t1 and not t1_done:
                    entry = next_evictable(t1_iter, protected)
                    t1_done = entry is None
                elif not use_t1 and not t2_done:
                    entry = next_evictable(t2_iter, protected)
                    t2_done = entry is None
                if entry is not None:
                    took_t1 = use_t1
                    break
            if entry is None:
                return None
            if took_t1:
                from_t1.append(entry)
                virtual_t1 -= 1
            else:
                from_t2.append(entry)
            order.append(took_t1)
        return from_t1, from_t2, order

    def items(self) -> Iterator[tuple[OffloadKey, BlockState]]:
        return chain(self.t1.items(), self.t2.items())

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def debug_state(self) -> dict[str, object]:
        return {
            "t1": [(k, s.ref, s.slot) for k, s in self.t1.items()],
            "t2": [(k, s.ref, s.slot) for k, s in self.t2.items()],
            "b1": list(self.b1),
            "b2": list(self.b2),
            "target_t1_size": self.target_t1_size,
        }

    def check_integrity(self) -> None:
        super().check_integrity()
        if not self.t1.keys().isdisjoint(self.t2.keys()):
            raise InvariantError("arc: a key is in both t1 and t2")
        if not self.b1.keys().isdisjoint(self.b2.keys()):
            raise InvariantError("arc: a key is in both ghost lists")
        for ghost in (self.b1, self.b2):
            if len(ghost) > self.capacity:
                raise InvariantError(f"arc: ghost list of {len(ghost)} exceeds capacity")
            if not (ghost.keys().isdisjoint(self.t1.keys())
                    and ghost.keys().isdisjoint(self.t2.keys())):
                raise InvariantError("arc: a key is both present and a ghost")
        if not 0.0 <= self.target_t1_size <= self.capacity:
            raise InvariantError(f"arc: target_t1_size {self.target_t1_size} out of range")

