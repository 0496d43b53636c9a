"""Adaptive Replacement Cache (ARC) eviction.

Four ordered lists, least recent first:

* ``t1``: keys seen once (inserted, not yet touched while ready);
* ``t2``: keys seen again (touched while ready);
* ``b1`` / ``b2``: ghosts, keys recently evicted from ``t1`` / ``t2`` (no state, no slot).

``target_t1_size`` is how large ``t1`` should be. A touch of a ``b1`` ghost (a key evicted
too early for being "seen once") raises it by ``max(1, |b2| / |b1|)``, capped at capacity;
a touch of a ``b2`` ghost lowers it by ``max(1, |b1| / |b2|)``, floored at 0.

Besides the lists, one plain dict maps every present key to its state, so that a tier's
per-key lookups are one dict ``get`` (``state_of``) whichever list holds the key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain, islice

from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey
from kvoffload.tiers.eviction.base import (
    BlockState,
    DictStatePolicy,
    Victims,
    drop,
    take_idle,
)


class ARCPolicy(DictStatePolicy):
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
        # ``self._states`` (DictStatePolicy): every present key, t1 and t2 together.


    def insert(self, key: OffloadKey, state: BlockState) -> None:
        if key in self._states:
            raise InvariantError(f"arc: insert of a key already present ({key.hex()})")
        self.t1[key] = state
        self._states[key] = state
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def insert_all(self, keys: Sequence[OffloadKey], states: Sequence[BlockState]) -> None:
        """All keys at ``t1``'s MRU end, in order, their ghosts dropped (one check, two
        dict updates, and per ghost list one intersection: a ghost is walked only when
        it is one of the keys)."""
        present = self._states
        if len(keys) != len(states):
            raise InvariantError(f"arc: {len(keys)} keys but {len(states)} states")
        if not present.keys().isdisjoint(keys):
            raise InvariantError("arc: insert of a key already present")
        pairs = list(zip(keys, states, strict=True))
        self.t1.update(pairs)
        present.update(pairs)
        for ghost in (self.b1, self.b2):
            if ghost:
                back = ghost.keys() & keys
                if back:
                    drop(ghost, back)  # the order of deletion does not matter

    def remove(self, key: OffloadKey) -> BlockState:
        state = self._states.pop(key, None)
        if state is None:
            raise InvariantError(f"arc: remove of an absent key ({key.hex()})")
        if self.t1.pop(key, None) is None:
            del self.t2[key]
        return state

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        if self._states.keys().isdisjoint(keys):
            # Nothing present (the misses a store is about to write): only ghosts count,
            # and only the ghost keys are walked.
            in_b1 = bool(b1) and not b1.keys().isdisjoint(keys)
            in_b2 = bool(b2) and not b2.keys().isdisjoint(keys)
            if in_b1 != in_b2:  # one ghost list: its keys found at C speed
                ghost = b1 if in_b1 else b2
                self._ghost_hits(list(filter(ghost.__contains__, reversed(keys))))
            elif in_b1:
                self._ghost_hits([key for key in reversed(keys) if key in b1 or key in b2])
            return
        get1 = t1.get
        move1 = t1.move_to_end
        move2 = t2.move_to_end
        ghosts: list[OffloadKey] = []
        for key in reversed(keys):
            state = get1(key)
            if state is None:
                if key in t2:
                    move2(key)
                elif key in b1 or key in b2:
                    ghosts.append(key)
            elif state.ref < 0:  # being written: the store's own touch, not a second use
                move1(key)
            else:
                del t1[key]
                t2[key] = state
        if ghosts:
            self._ghost_hits(ghosts)

    def _ghost_hits(self, keys: Sequence[OffloadKey]) -> None:
        """A touch of ghosts, in order: each adapts ``target_t1_size`` (module doc) and
        moves to its list's MRU end. Moves within a ghost list change no list's size, so
        each list's step is the same for all the keys (present keys touched in the same
        call change no ghost list either)."""
        b1, b2 = self.b1, self.b2
        up = max(1.0, len(b2) / len(b1)) if b1 else 0.0
        down = max(1.0, len(b1) / len(b2)) if b2 else 0.0
        cap = float(self.capacity)
        target = self.target_t1_size
        move1 = b1.move_to_end
        move2 = b2.move_to_end
        for key in keys:
            if key in b1:
                target = min(target + up, cap)
                move1(key)
            else:
                target = max(target - down, 0.0)
                move2(key)
        self.target_t1_size = target

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> Victims | None:
        if n < 0:
            raise InvariantError(f"arc: evict({n})")
        if n == 0:
            return []
        if n > len(self._states):
            return None
        t1, t2, b1, b2, states = self.t1, self.t2, self.b1, self.b2, self._states
        # The rule (class doc) takes from t1 while the simulated t1 size is at least the
        # target, from t2 after that, and from t1 again once t2 has no evictable key: the
        # victims come in three runs, each one scan going on from where it stopped.
        target = int(self.target_t1_size)
        t1_first = len(t1) - target + 1 if len(t1) >= target else 0
        t1_entries = iter(t1.items())
        from_t1 = take_idle(t1_entries, min(t1_first, n), protected)
        from_t2 = take_idle(iter(t2.items()), n - len(from_t1), protected)
        more_t1 = take_idle(t1_entries, n - len(from_t1) - len(from_t2), protected)
        if len(from_t1) + len(from_t2) + len(more_t1) < n:
            return None
        # Commit: t1 victims become b1 ghosts, t2 victims b2 ghosts, oldest ghosts go.
        capacity = self.capacity
        if more_t1:
            from_t1 = from_t1 + more_t1
        if from_t1:
            _to_ghosts(from_t1, states, t1, b1, capacity)
        if from_t2:
            _to_ghosts(from_t2, states, t2, b2, capacity)
            if more_t1:  # victims in the order taken: t1, then t2, then t1 again
                return from_t1[:-len(more_t1)] + from_t2 + more_t1
            return from_t1 + from_t2
        return from_t1

    def items(self) -> Iterator[tuple[OffloadKey, BlockState]]:
        return chain(self.t1.items(), self.t2.items())

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self._states.clear()
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
        if (len(self._states) != len(self.t1) + len(self.t2)
                or any(self._states.get(k) is not s for k, s in self.items())):
            raise InvariantError("arc: the dict of present keys disagrees with t1 and t2")
        if not self.b1.keys().isdisjoint(self.b2.keys()):
            raise InvariantError("arc: a key is in both ghost lists")
        for ghost in (self.b1, self.b2):
            if len(ghost) > self.capacity:
                raise InvariantError(f"arc: ghost list of {len(ghost)} exceeds capacity")
            if not ghost.keys().isdisjoint(self._states.keys()):
                raise InvariantError("arc: a key is both present and a ghost")
        if not 0.0 <= self.target_t1_size <= self.capacity:
            raise InvariantError(f"arc: target_t1_size {self.target_t1_size} out of range")


def _to_ghosts(victims: Victims, states: dict[OffloadKey, BlockState],
               present: OrderedDict[OffloadKey, BlockState],
               ghosts: OrderedDict[OffloadKey, None], capacity: int) -> None:
    """Move ``victims`` out of ``present`` (and the dict of present keys) into ``ghosts``
    as its newest entries, then trim ``ghosts`` to ``capacity`` from its oldest end."""
    for key, _ in victims:
        del states[key]
        del present[key]
        ghosts[key] = None
    excess = len(ghosts) - capacity
    if excess > 0:
        drop(ghosts, list(islice(ghosts, excess)))
