"""The host-memory tier's bookkeeping (``HostTier``).

``HostTier`` decides which host slot each offloaded block lives in, which keys may be read
and which to evict; the worker moves the bytes into and out of those slots. It runs in the
scheduler process and is not thread-safe: one caller drives it.

Under slot accounting (the default) every offloaded block of every group takes one slot
(``OffloadConfig.slot_bytes``, the largest block of any group). Under byte accounting
(``OffloadConfig.host_accounting == "bytes"``) every block is charged its own group's bytes
against the one budget ``host_capacity_bytes``: pages differ in size across groups, and a
small full-attention block must not cost as much as a Mamba state. Either way
``usage().bytes_by_group`` reports the real block bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey, key_block_hash, key_group
from kvoffload.tiers.base import (
    LookupResult,
    PrepareStoreResult,
    Tier,
    TierEvent,
    TierUsage,
)
from kvoffload.tiers.eviction import WRITING, BlockState, EvictionPolicy, ValueHint, make_policy
from kvoffload.tiers.slots import SlotAllocator


@dataclass(slots=True)
class HostTierStats:
    """Cumulative counters of one ``HostTier`` (plain data; ``reset`` keeps them).

    Attributes:
        lookup_hits / lookup_misses / lookup_pending: ``lookup`` answers.
        keys_loaded: keys pinned by ``prepare_load``.
        keys_deduped: ``prepare_store`` input keys skipped as already present.
        keys_reserved: keys given a slot by ``prepare_store``.
        stores_rejected: ``prepare_store`` calls answered ``None`` (no room).
        keys_stored: keys made readable by ``complete_store``.
        keys_store_failed: keys dropped by ``complete_store(success=False)``.
        keys_evicted: keys evicted to make room.
    """

    lookup_hits: int = 0
    lookup_misses: int = 0
    lookup_pending: int = 0
    keys_loaded: int = 0
    keys_deduped: int = 0
    keys_reserved: int = 0
    stores_rejected: int = 0
    keys_stored: int = 0
    keys_store_failed: int = 0
    keys_evicted: int = 0


def _fmt(key: OffloadKey) -> str:
    return f"{key_block_hash(key).hex()[:16]}/g{key_group(key)}"


class HostTier(Tier):
    """Host-memory tier bookkeeping with a pluggable eviction policy.

    Built from an ``OffloadConfig``: ``config.num_host_slots`` slots, the policy named by
    ``config.eviction_policy``. Keys must belong to one of the config's groups.

    Pins: ``prepare_load`` pins each key (ref +1) until the matching ``complete_load``.
    ``prepare_store`` marks its new keys as being written (not readable, not evictable)
    until ``complete_store``. Nothing else pins.

    Events (when ``enable_events``): one ``removed=True`` event per ``prepare_store`` that
    evicted, one ``removed=False`` event per ``complete_store`` that made keys readable, and
    one ``removed=True`` event for the readable keys dropped by ``reset``. Replaying the
    events in order therefore yields exactly the set of readable keys.
    """

    name = "host"

    def __init__(self, config: OffloadConfig, *, enable_events: bool = True) -> None:
        self.config = config
        self.enable_events = enable_events
        self.stats = HostTierStats()
        capacity = config.num_host_slots
        self._block_bytes = tuple(g.block_bytes for g in config.resolved)
        self._largest_block_bytes = max(self._block_bytes)
        self._policy: EvictionPolicy = make_policy(config.eviction_policy, capacity)
        self._slots = SlotAllocator(capacity)
        self._num_writing = 0
        self._num_pinned = 0
        self._keys_per_group = [0] * len(self._block_bytes)
        self._events: list[TierEvent] = []
        self._charges_bytes = config.charges_bytes
        self._budget = config.host_capacity_bytes
        self._bytes_writing = 0
        self._bytes_pinned = 0

    # -- inspection -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Total slots."""
        return self._slots.capacity

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (read-only use: it holds the keys' states)."""
        return self._policy

    @property
    def allocator(self) -> SlotAllocator:
        """The slot allocator (read-only use)."""
        return self._slots

    def __len__(self) -> int:
        """Keys present, ready or being written."""
        return len(self._policy)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is present, ready or being written."""
        return key in self._policy

    def __iter__(self) -> Iterator[OffloadKey]:
        """Present keys, next eviction candidate first. Do not mutate while iterating."""
        return (key for key, _ in self._policy.items())

    def keys(self) -> Iterator[OffloadKey]:
        """Same as ``iter(tier)``."""
        return iter(self)

    def ref_count(self, key: OffloadKey) -> int | None:
        """``-1`` being written, ``0`` idle, ``n > 0`` pinned by n loads; ``None`` absent."""
        state = self._policy.get(key)
        return None if state is None else state.ref

    def slot_of(self, key: OffloadKey) -> int | None:
        """The key's slot, or ``None`` if absent."""
        state = self._policy.get(key)
        return None if state is None else state.slot

    def debug_state(self) -> dict[str, object]:
        """A comparable copy of all bookkeeping (not ``stats``), for before/after tests."""
        return {
            "policy": self._policy.debug_state(),
            "slots": self._slots.debug_state(),
            "num_writing": self._num_writing,
            "num_pinned": self._num_pinned,
            "keys_per_group": list(self._keys_per_group),
            "events": list(self._events),
        }

    # -- reads ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        """HIT if ready, PENDING if being written, else MISS. Changes only ``stats``."""
        state = self._policy.get(key)
        if state is None:
            self.stats.lookup_misses += 1
            return LookupResult.MISS
        if state.ref == WRITING:
            self.stats.lookup_pending += 1
            return LookupResult.PENDING
        self.stats.lookup_hits += 1
        return LookupResult.HIT

    def prepare_load(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """Pin every key (ref +1; a key listed twice is pinned twice); return slots in order.

        Pins last until ``complete_load`` of the same keys. A key that is absent or being
        written raises ``InvariantError`` and nothing is pinned.
        """
        slots = self.pin(keys)
        self.stats.keys_loaded += len(slots)
        return slots

    def pin(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """``prepare_load`` without counting a load (a lower tier's demote reads the slot);
        ``complete_load`` releases it."""
        states: list[BlockState] = []
        for key in keys:
            state = self._policy.get(key)
            if state is None or state.ref == WRITING:
                what = "absent" if state is None else "still being written"
                raise InvariantError(f"host prepare_load: key {_fmt(key)} is {what}")
            states.append(state)
        for key, state in zip(keys, states, strict=True):
            if state.ref == 0:
                self._num_pinned += 1
                self._bytes_pinned += self._block_bytes[key_group(key)]
            state.ref += 1
        return tuple(state.slot for state in states)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Unpin each key once per listing (ref -1).

        Raises ``InvariantError`` and changes nothing if any key would drop below its
        pins (absent, being written, or not pinned that many times).
        """
        counts = Counter(keys)
        states: list[tuple[OffloadKey, BlockState, int]] = []
        for key, n in counts.items():
            state = self._policy.get(key)
            if state is None or state.ref < n:
                held = "absent" if state is None else f"ref {state.ref}"
                raise InvariantError(
                    f"host complete_load: key {_fmt(key)} released {n}x but {held} "
                    "(no matching prepare_load)")
            states.append((key, state, n))
        for key, state, n in states:
            state.ref -= n
            if state.ref == 0:
                self._num_pinned -= 1
                self._bytes_pinned -= self._block_bytes[key_group(key)]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark keys recently used; ``keys[0]`` ends most recent. Absent keys are ignored
        (ARC still learns from recently evicted ones)."""
        self._policy.touch(keys)

    # -- writes -----------------------------------------------------------------------

    def demote(self, keys: Sequence[OffloadKey]) -> None:
        self._policy.demote(keys)

    def cool(self, keys: Sequence[OffloadKey]) -> int:
        return self._policy.cool(keys)

    def warm(self, keys: Sequence[OffloadKey]) -> None:
        self._policy.warm(keys)

    def set_values(self, values: Sequence[ValueHint]) -> None:
        """Hand (key, compute saved, bytes) hints to the eviction policy."""
        self._policy.set_values(values)

    def prepare_store(self, keys: Sequence[OffloadKey], *,
                      protected: AbstractSet[OffloadKey] = frozenset(),
                      ) -> PrepareStoreResult | None:
        """Reserve a slot for every key not yet present, evicting idle keys if needed.

        Keys already present (ready or being written) and repeats are skipped. New keys
        become "being written" until ``complete_store``. Victims are idle (ref 0) keys not
        in ``keys``; they are gone when this returns and a ``removed`` event is queued.

        ``protected`` keys are not evicted either (a cascade shields the keys requests
        are about to load).

        Returns ``None`` and changes nothing (except ``stats.stores_rejected``) when there
        are not enough evictable keys. A key of a group the config does not have raises
        ``InvariantError``, also without change.
        """
        policy = self._policy
        num_groups = len(self._block_bytes)
        new: list[OffloadKey] = []
        groups: list[int] = []
        seen: set[OffloadKey] = set()
        for key in keys:
            if key in seen or policy.get(key) is not None:
                continue
            group = key_group(key)
            if group >= num_groups:
                raise InvariantError(
                    f"host prepare_store: key {_fmt(key)} names group {group}, "
                    f"config has {num_groups}")
            seen.add(key)
            new.append(key)
            groups.append(group)
        self.stats.keys_deduped += len(keys) - len(new)

        evicted: tuple[OffloadKey, ...] = ()
        evicted_slots: tuple[int, ...] = ()
        need = len(new) - self._slots.num_free
        block_bytes = self._block_bytes
        new_bytes = sum(block_bytes[g] for g in groups)
        need_bytes = self._bytes_used() + new_bytes - self._budget if self._charges_bytes else 0
        if need > 0 or need_bytes > 0:
            idle = len(policy) - self._num_writing - self._num_pinned
            # A cascade's protected set already holds the keys it promotes: no copy then.
            shield: AbstractSet[OffloadKey] = (
                protected if protected and all(key in protected for key in keys)
                else frozenset(keys).union(protected))
            if self._charges_bytes:
                victims = (policy.evict_bytes(need_bytes, need, shield, self._key_bytes)
                           if self._can_free(need_bytes, need, idle, shield) else None)
            else:
                victims = policy.evict(need, shield) if need <= idle else None
            if victims is None:
                self.stats.stores_rejected += 1
                return None
            evicted_slots = tuple(state.slot for _, state in victims)
            self._slots.free(evicted_slots)
            evicted = tuple(key for key, _ in victims)
            for key in evicted:
                self._keys_per_group[key_group(key)] -= 1
            self.stats.keys_evicted += len(evicted)
            self._emit(evicted, removed=True)

        slots = self._slots.allocate(len(new))
        for key, slot, group in zip(new, slots, groups, strict=True):
            policy.insert(key, BlockState(slot))
            self._keys_per_group[group] += 1
        self._num_writing += len(new)
        self._bytes_writing += new_bytes
        self.stats.keys_reserved += len(new)
        return PrepareStoreResult(keys_to_store=tuple(new), slots=tuple(slots), evicted=evicted,
                                  evicted_slots=evicted_slots)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """End the write of keys being written.

        On success they become readable and idle (evictable) and a ``removed=False``
        event is queued. On failure they are removed and their slots freed. Keys that are
        ready or absent are ignored, so repeating a call is harmless. The caller must
        complete each store job once: a stale repeat after a key was evicted and is being
        written again by another job would end that other write.
        """
        done: list[OffloadKey] = []
        states: list[BlockState] = []
        for key in keys:
            state = self._policy.get(key)
            if state is not None and state.ref == WRITING:
                self._bytes_writing -= self._block_bytes[key_group(key)]
                if success:
                    state.ref = 0
                else:
                    self._policy.remove(key)
                    self._keys_per_group[key_group(key)] -= 1
                done.append(key)
                states.append(state)
        self._num_writing -= len(done)
        if success:
            self.stats.keys_stored += len(done)
            self._emit(tuple(done), removed=False)
        else:
            self._slots.free(state.slot for state in states)
            self.stats.keys_store_failed += len(done)

    # -- housekeeping -----------------------------------------------------------------

    def take_events(self) -> list[TierEvent]:
        """Return and clear the queued events (always empty when events are disabled)."""
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Drop every key, pins and writes included; slots restart from 0.

        The caller guarantees that no completion for an earlier job arrives afterwards.
        Queued events are kept, and a ``removed`` event lists the readable keys dropped.
        ``stats`` are kept.
        """
        if self.enable_events:
            self._emit(tuple(key for key, state in self._policy.items() if state.ref >= 0),
                       removed=True)
        self._policy.clear()
        self._slots.reset()
        self._num_writing = 0
        self._num_pinned = 0
        self._bytes_writing = 0
        self._bytes_pinned = 0
        self._keys_per_group = [0] * len(self._block_bytes)

    def is_full(self) -> bool:
        if self._charges_bytes:  # as TierUsage.is_full, without building the usage
            return self._bytes_used() + self._largest_block_bytes > self._budget
        return self._slots.num_used >= self._slots.capacity

    def usage(self) -> TierUsage:
        """Occupancy now; ``bytes_by_group`` counts ready and being-written keys."""
        return TierUsage(
            capacity_slots=self._slots.capacity,
            used_slots=self._slots.num_used,
            pinned_slots=self._num_pinned,
            writing_slots=self._num_writing,
            bytes_by_group={g: n * self._block_bytes[g]
                            for g, n in enumerate(self._keys_per_group)},
            capacity_bytes=self._budget if self._charges_bytes else 0,
            largest_block_bytes=self._largest_block_bytes if self._charges_bytes else 0,
        )

    def check_integrity(self) -> None:
        """Raise ``InvariantError`` unless keys, states, counters and slots agree."""
        self._policy.check_integrity()
        writing = pinned = 0
        per_group = [0] * len(self._block_bytes)
        used: list[int] = []
        for key, state in self._policy.items():
            if state.ref == WRITING:
                writing += 1
            elif state.ref > 0:
                pinned += 1
            elif state.ref != 0:
                raise InvariantError(f"host: key {_fmt(key)} has ref count {state.ref}")
            group = key_group(key)
            if group >= len(per_group):
                raise InvariantError(f"host: key {_fmt(key)} of unknown group {group}")
            per_group[group] += 1
            used.append(state.slot)
        if (writing, pinned) != (self._num_writing, self._num_pinned):
            raise InvariantError(
                f"host: counted {writing} writing / {pinned} pinned keys, counters say "
                f"{self._num_writing} / {self._num_pinned}")
        if per_group != self._keys_per_group:
            raise InvariantError(f"host: keys per group {per_group} != {self._keys_per_group}")
        writing_bytes = pinned_bytes = 0
        for key, state in self._policy.items():
            if state.ref == WRITING:
                writing_bytes += self._block_bytes[key_group(key)]
            elif state.ref > 0:
                pinned_bytes += self._block_bytes[key_group(key)]
        if (writing_bytes, pinned_bytes) != (self._bytes_writing, self._bytes_pinned):
            raise InvariantError(
                f"host: {writing_bytes} writing / {pinned_bytes} pinned bytes, counters say "
                f"{self._bytes_writing} / {self._bytes_pinned}")
        if self._charges_bytes and self._bytes_used() > self._budget:
            raise InvariantError(f"host: {self._bytes_used()} bytes held exceed the budget "
                                 f"of {self._budget}")
        self._slots.check_integrity(used)

    def _bytes_used(self) -> int:
        """Block bytes of every present key (ready or being written)."""
        return sum(n * b for n, b in zip(self._keys_per_group, self._block_bytes, strict=True))

    def _key_bytes(self, key: OffloadKey) -> int:
        return self._block_bytes[key_group(key)]

    def _can_free(self, need_bytes: int, need_keys: int, idle: int,
                  shield: AbstractSet[OffloadKey]) -> bool:
        """Whether idle, unshielded keys hold ``need_bytes`` and number ``need_keys``
        (checked before evicting anything, so a store evicts all or nothing)."""
        idle_bytes = self._bytes_used() - self._bytes_writing - self._bytes_pinned
        for key in shield:
            state = self._policy.get(key)
            if state is not None and state.ref == 0:
                idle -= 1
                idle_bytes -= self._block_bytes[key_group(key)]
        return idle >= need_keys and idle_bytes >= need_bytes

    def _emit(self, keys: tuple[OffloadKey, ...], *, removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(TierEvent(keys=keys, tier=self.name, removed=removed))
