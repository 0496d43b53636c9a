"""Slot and byte accounting of host memory (``HostSpace``, the counting part of ``HostTier``).

``HostSpace`` owns the slot allocator and the counters that ``usage``, ``is_full`` and the
byte budget need: keys per group, keys and bytes being written, keys and bytes pinned. It
holds no keys: the key states live in the tier's eviction policy, and ``HostTier`` tells
the space about every change. In its hot loops (pin, unpin, end of a write) the tier
updates the public counters directly; everything else goes through the methods here.

Under slot accounting (the default) every block takes one slot. Under byte accounting
(``OffloadConfig.host_accounting == "bytes"``) every block is also charged its group's bytes
against ``host_capacity_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from itertools import repeat
from operator import itemgetter

from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey, key_group
from kvoffload.tiers.base import TierUsage
from kvoffload.tiers.eviction import WRITING, BlockState, EvictionPolicy, Victims
from kvoffload.tiers.slots import SlotAllocator


class HostSpace:
    """Free slots, the byte budget and the occupancy counters of one ``HostTier``.

    Attributes (counters, kept exact by the tier):
        slots: the slot allocator.
        block_bytes: bytes of one block, per group index.
        num_writing / bytes_writing: keys (and their bytes) being written.
        num_pinned / bytes_pinned: ready keys with ref count > 0 (and their bytes).
        keys_per_group: present keys (ready or being written) per group index.
        charges_bytes / budget: byte accounting is on, with this budget (bytes).
    """

    __slots__ = (
        "_largest_block_bytes",
        "block_bytes",
        "budget",
        "bytes_pinned",
        "bytes_writing",
        "charges_bytes",
        "keys_per_group",
        "num_pinned",
        "num_writing",
        "slots",
    )

    def __init__(self, config: OffloadConfig) -> None:
        self.slots = SlotAllocator(config.num_host_slots)
        self.block_bytes = tuple(g.block_bytes for g in config.resolved)
        self._largest_block_bytes = max(self.block_bytes)
        self.charges_bytes = config.charges_bytes
        self.budget = config.host_capacity_bytes
        self.num_writing = 0
        self.num_pinned = 0
        self.bytes_writing = 0
        self.bytes_pinned = 0
        self.keys_per_group = [0] * len(self.block_bytes)

    def bytes_used(self) -> int:
        """Block bytes of every present key (ready or being written)."""
        return sum(n * b for n, b in zip(self.keys_per_group, self.block_bytes, strict=True))

    def key_bytes(self, key: OffloadKey) -> int:
        """Bytes of one block of ``key``'s group."""
        return self.block_bytes[key_group(key)]

    def choose_victims(self, policy: EvictionPolicy, need: int, need_bytes: int,
                       shield: AbstractSet[OffloadKey]) -> Victims | None:
        """Evict from ``policy`` the idle keys not in ``shield`` that free ``need`` slots
        (and ``need_bytes`` bytes under byte accounting), all or nothing: ``None`` and no
        change when there are too few. The victims are gone from ``policy``; their slots
        and counters are released by ``evicted``."""
        idle = len(policy) - self.num_writing - self.num_pinned
        if self.charges_bytes:
            if not self._can_free(policy, need_bytes, need, idle, shield):
                return None
            return policy.evict_bytes(need_bytes, need, shield, self.key_bytes)
        return policy.evict(need, shield) if need <= idle else None

    def evicted(self, victims: Victims) -> tuple[int, ...]:
        """Release the slots and counts of evicted keys; return their slots in order."""
        slots = tuple([state.slot for _, state in victims])
        self.slots.free(slots)
        keys_per_group = self.keys_per_group
        if len(keys_per_group) == 1:
            keys_per_group[0] -= len(slots)
        else:
            for _, state in victims:
                keys_per_group[state.group] -= 1
        return slots

    def is_full(self) -> bool:
        """``usage().is_full`` without building the usage."""
        if self.charges_bytes:
            return self.bytes_used() + self._largest_block_bytes > self.budget
        return self.slots.num_used >= self.slots.capacity

    def usage(self) -> TierUsage:
        """Occupancy now; ``bytes_by_group`` counts ready and being-written keys."""
        return TierUsage(
            capacity_slots=self.slots.capacity,
            used_slots=self.slots.num_used,
            pinned_slots=self.num_pinned,
            writing_slots=self.num_writing,
            bytes_by_group={g: n * self.block_bytes[g]
                            for g, n in enumerate(self.keys_per_group)},
            capacity_bytes=self.budget if self.charges_bytes else 0,
            largest_block_bytes=self._largest_block_bytes if self.charges_bytes else 0,
        )

    def reset(self) -> None:
        """Every key dropped: all slots free, all counters 0."""
        self.slots.reset()
        self.num_writing = 0
        self.num_pinned = 0
        self.bytes_writing = 0
        self.bytes_pinned = 0
        self.keys_per_group = [0] * len(self.block_bytes)

    def debug_state(self) -> dict[str, object]:
        """A comparable copy of the slots and key counters."""
        return {
            "slots": self.slots.debug_state(),
            "num_writing": self.num_writing,
            "num_pinned": self.num_pinned,
            "keys_per_group": list(self.keys_per_group),
        }

    def check_integrity(self, policy: EvictionPolicy,
                        name: Callable[[OffloadKey], str]) -> None:
        """Raise ``InvariantError`` unless the counters and slots agree with the key states
        in ``policy`` (``name`` formats a key for messages). Changes nothing."""
        writing = pinned = writing_bytes = pinned_bytes = 0
        per_group = [0] * len(self.block_bytes)
        used: list[int] = []
        for key, state in policy.items():
            group = key_group(key)
            if state.ref < WRITING:
                raise InvariantError(f"host: key {name(key)} has ref count {state.ref}")
            if group >= len(per_group):
                raise InvariantError(f"host: key {name(key)} of unknown group {group}")
            if state.group != group:
                raise InvariantError(f"host: key {name(key)} of group {group} has a state "
                                     f"of group {state.group}")
            if state.ref == WRITING:
                writing += 1
                writing_bytes += self.block_bytes[group]
            elif state.ref > 0:
                pinned += 1
                pinned_bytes += self.block_bytes[group]
            per_group[group] += 1
            used.append(state.slot)
        self._check_counts(writing, pinned, per_group, writing_bytes, pinned_bytes)
        self.slots.check_integrity(used)

    def _check_counts(self, writing: int, pinned: int, per_group: list[int],
                      writing_bytes: int, pinned_bytes: int) -> None:
        if (writing, pinned) != (self.num_writing, self.num_pinned):
            raise InvariantError(
                f"host: counted {writing} writing / {pinned} pinned keys, counters say "
                f"{self.num_writing} / {self.num_pinned}")
        if per_group != self.keys_per_group:
            raise InvariantError(f"host: keys per group {per_group} != {self.keys_per_group}")
        if (writing_bytes, pinned_bytes) != (self.bytes_writing, self.bytes_pinned):
            raise InvariantError(
                f"host: {writing_bytes} writing / {pinned_bytes} pinned bytes, counters say "
                f"{self.bytes_writing} / {self.bytes_pinned}")
        if self.charges_bytes and self.bytes_used() > self.budget:
            raise InvariantError(f"host: {self.bytes_used()} bytes held exceed the budget "
                                 f"of {self.budget}")

    def _can_free(self, policy: EvictionPolicy, need_bytes: int, need_keys: int, idle: int,
                  shield: AbstractSet[OffloadKey]) -> bool:
        """Whether idle, unshielded keys hold ``need_bytes`` and number ``need_keys``
        (checked before evicting anything, so a store evicts all or nothing)."""
        idle_bytes = self.bytes_used() - self.bytes_writing - self.bytes_pinned
        for key in shield:
            state: BlockState | None = policy.get(key)
            if state is not None and state.ref == 0:
                idle -= 1
                idle_bytes -= self.block_bytes[state.group]
        return idle >= need_keys and idle_bytes >= need_bytes


_STATE = itemgetter(1)


def writing_states(slots: list[int], groups: list[int] | None, victims: Victims,
                   make: Callable[..., BlockState] = BlockState) -> list[BlockState]:
    """A "being written" state for each new key (slot and group in order, ``groups`` None:
    all group 0). The states of this store's victims are detached (nothing refers to
    them any more) and are reused first, so a full tier makes no object per key; the
    others are made by ``make`` (the policy's ``EvictionPolicy.new_state``)."""
    states: list[BlockState] = []
    for (_, state), slot, group in zip(victims, slots, groups or repeat(0), strict=False):
        state.slot = slot
        state.ref = WRITING
        state.group = group
        states.append(state)
    rest = slots[len(states):]
    if rest:
        if groups is None:
            states.extend(map(make, rest))
        else:
            states.extend(map(make, rest, repeat(WRITING), groups[len(states):]))
    return states


def swap_states(victims: Victims) -> list[BlockState]:
    """The new keys' states when a store into a full tier of one group evicted exactly
    one victim per new key: the victims' detached states, last victim first, marked
    "being written", each keeping its slot. This is what freeing the victims' slots and
    allocating as many again gives (the slot allocator hands the last freed slot out
    first) and what ``writing_states`` then builds, without marking the slots free and
    used again: the allocator and the per-group key count end as they were."""
    states = list(map(_STATE, reversed(victims)))
    for state in states:
        state.ref = WRITING
    return states
