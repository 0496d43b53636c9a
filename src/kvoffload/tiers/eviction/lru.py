"""Least-recently-used eviction: one ordered dict, least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey
from kvoffload.tiers.eviction.base import (
    BlockState,
    DictStatePolicy,
    Victims,
    drop,
    take_idle,
)


class LRUPolicy(DictStatePolicy):
    """Evicts the least recently inserted or touched idle key.

    ``insert`` appends at the most-recent end; ``touch`` moves present keys there, last key
    first, so the first key of a touch ends most recent (early prefix blocks, shared by the
    most requests, stay hottest). ``evict`` walks from the least-recent end once.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[OffloadKey, BlockState] = OrderedDict()
        super().__init__(capacity, self._order)


    def insert(self, key: OffloadKey, state: BlockState) -> None:
        if key in self._order:
            raise InvariantError(f"lru: insert of a key already present ({key.hex()})")
        self._order[key] = state

    def insert_all(self, keys: Sequence[OffloadKey], states: Sequence[BlockState]) -> None:
        """All keys at the most-recent end, in order; one check, one dict update."""
        order = self._order
        if len(keys) != len(states):
            raise InvariantError(f"lru: {len(keys)} keys but {len(states)} states")
        if not order.keys().isdisjoint(keys):
            raise InvariantError("lru: insert of a key already present")
        order.update(zip(keys, states, strict=True))

    def remove(self, key: OffloadKey) -> BlockState:
        state = self._order.pop(key, None)
        if state is None:
            raise InvariantError(f"lru: remove of an absent key ({key.hex()})")
        return state

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        order = self._order
        if order.keys().isdisjoint(keys):
            return  # none present (stops at the first present key otherwise)
        move = order.move_to_end
        remaining = reversed(keys)
        try:
            for key in remaining:
                move(key)
            return
        except KeyError:
            pass  # an absent key: check each of the rest
        for key in remaining:
            if key in order:
                move(key)

    def demote(self, keys: Sequence[OffloadKey]) -> None:
        """Move present keys to the least-recent end (next victims)."""
        order = self._order
        for key in keys:
            if key in order:
                order.move_to_end(key, last=False)

    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> Victims | None:
        if n < 0:
            raise InvariantError(f"lru: evict({n})")
        if n == 0:
            return []
        if n > len(self._order):
            return None
        victims = take_idle(iter(self._order.items()), n, protected)
        if len(victims) < n:
            return None
        drop(self._order, [key for key, _ in victims])
        return victims

    def evict_bytes(self, need_bytes: int, need_keys: int, protected: AbstractSet[OffloadKey],
                    size_of: Callable[[OffloadKey], int]) -> Victims:
        """One walk from the least-recent end (see ``EvictionPolicy.evict_bytes``)."""
        victims: Victims = []
        freed = 0
        for key, state in self._order.items():
            if freed >= need_bytes and len(victims) >= need_keys:
                break
            if state.ref == 0 and key not in protected:
                victims.append((key, state))
                freed += size_of(key)
        if freed < need_bytes or len(victims) < need_keys:
            raise InvariantError("lru: evict_bytes found too few idle keys")
        for key, _ in victims:
            del self._order[key]
        return victims

    def items(self) -> Iterator[tuple[OffloadKey, BlockState]]:
        return iter(self._order.items())

    def clear(self) -> None:
        self._order.clear()

    def debug_state(self) -> dict[str, object]:
        return {"order": [(k, s.ref, s.slot) for k, s in self._order.items()]}

