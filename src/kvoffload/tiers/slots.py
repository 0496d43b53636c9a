"""Slot allocation for a fixed-size tier.

A tier holds ``capacity`` equal slots, numbered ``0 .. capacity - 1``. ``SlotAllocator``
hands them out in a fixed order: slots never used before first, counting up, then slots
given back, last freed first (a LIFO free list). The order is deterministic, so tests and
replays see the same slot numbers every run.

State is compact for millions of slots: one byte per slot (used or not) and an ``array``
of recycled slot numbers.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from kvoffload.errors import InvariantError


class SlotAllocator:
    """Hands out and takes back slot numbers of one tier.

    Every misuse (freeing a free slot, a number out of range, asking for more slots than
    are free) raises ``InvariantError`` before anything changes.
    """

    __slots__ = ("_capacity", "_free", "_next", "_used")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity = capacity
        self._next = 0
        """Slots ``[0, _next)`` have been handed out at least once."""
        self._free = array("q")
        """Recycled slots; the last one appended is handed out first."""
        self._used = bytearray(capacity)
        """1 for a slot currently handed out, else 0."""

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        """Slots that ``allocate`` can hand out now."""
        return self._capacity - self._next + len(self._free)

    @property
    def num_used(self) -> int:
        """Slots handed out and not freed."""
        return self._next - len(self._free)

    def is_used(self, slot: int) -> bool:
        """Whether ``slot`` is handed out now."""
        return 0 <= slot < self._capacity and self._used[slot] == 1

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` slots: never-used ones first (ascending), then recycled ones (LIFO).

        Raises ``InvariantError`` (and changes nothing) if fewer than ``n`` are free; the
        caller must check ``num_free`` (or evict) first.
        """
        if n < 0:
            raise InvariantError(f"allocate({n}): negative count")
        if n > self.num_free:
            raise InvariantError(f"allocate({n}): only {self.num_free} slots free")
        fresh = min(n, self._capacity - self._next)
        out = list(range(self._next, self._next + fresh))
        self._next += fresh
        recycled = n - fresh
        if recycled:
            free = self._free
            start = len(free) - recycled
            out.extend(reversed(free[start:]))  # last freed first
            del free[start:]
        used = self._used
        for slot in out:
            used[slot] = 1
        return out

    def free(self, slots: Iterable[int]) -> None:
        """Give ``slots`` back; the last one given is the next one handed out.

        Raises ``InvariantError`` (and changes nothing) if any slot is out of range, not
        handed out, or listed twice.
        """
        given = slots if isinstance(slots, (list, tuple)) else list(slots)
        used = self._used
        capacity = self._capacity
        for i, slot in enumerate(given):
            if 0 <= slot < capacity and used[slot] == 1:
                used[slot] = 0  # marked free at once, so a repeat below is caught
                continue
            for done in given[:i]:  # undo, then say what was wrong
                used[done] = 1
            if not 0 <= slot < capacity:
                raise InvariantError(f"free: slot {slot} out of range [0, {capacity})")
            if slot in given[:i]:
                raise InvariantError(f"free: a slot is listed twice in {list(given)}")
            raise InvariantError(f"free: slot {slot} is not in use (double free?)")
        self._free.extend(given)

    def reset(self) -> None:
        """Free every slot and forget the history: the next slot handed out is 0."""
        self._next = 0
        self._free = array("q")
        self._used = bytearray(self._capacity)

    def debug_state(self) -> tuple[int, tuple[int, ...], bytes]:
        """A comparable copy of the whole state (next fresh slot, free list, usage map)."""
        return self._next, tuple(self._free), bytes(self._used)

    def check_integrity(self, used_slots: Iterable[int] | None = None) -> None:
        """Raise ``InvariantError`` if the allocator's state is inconsistent.

        Checks that no slot is both free and used, that recycled slots are unique and were
        handed out before, and that the counts agree. If ``used_slots`` is given (the slots
        the tier's keys occupy), it must be exactly the set of used slots, without repeats.
        """
        if not 0 <= self._next <= self._capacity:
            raise InvariantError(f"slots: next fresh slot {self._next} outside capacity")
        if len(self._used) != self._capacity:
            raise InvariantError("slots: usage map has the wrong size")
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise InvariantError("slots: a recycled slot is listed twice")
        for slot in free_set:
            if not 0 <= slot < self._next:
                raise InvariantError(f"slots: recycled slot {slot} was never handed out")
            if self._used[slot] != 0:
                raise InvariantError(f"slots: slot {slot} is both free and used")
        marked = self._used.count(1)
        if self._used.count(0) + marked != self._capacity:
            raise InvariantError("slots: usage map holds values other than 0 and 1")
        if marked != self.num_used:
            raise InvariantError(f"slots: {marked} slots marked used, counts say {self.num_used}")
        if self._used.find(1, self._next) != -1:
            raise InvariantError("slots: a never-handed-out slot is marked used")
        if used_slots is None:
            return
        given = list(used_slots)
        given_set = set(given)
        if len(given_set) != len(given):
            raise InvariantError("slots: two keys share one slot")
        if len(given_set) != marked or any(not self.is_used(s) for s in given_set):
            raise InvariantError(
                f"slots: keys occupy {len(given_set)} slots, allocator has {marked} in use "
                "(a leaked or foreign slot)")
