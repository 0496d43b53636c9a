"""The host-memory tier's bookkeeping (``HostTier``).

``HostTier`` decides which host slot each offloaded block lives in, which keys may be read
and which to evict; the worker moves the bytes into and out of those slots. It runs in the
scheduler process and is not thread-safe: one caller drives it.

Under slot accounting (the default) every offloaded block of every group takes one slot
(``OffloadConfig.slot_bytes``, the largest block of any group). Under byte accounting
(``OffloadConfig.host_accounting == "bytes"``) every block is charged its own group's bytes
against the one budget ``host_capacity_bytes``: pages differ in size across groups, and a
small full-attention block must not cost as much as a Mamba state. Either way
``usage().bytes_by_group`` reports the real block bytes. The counting lives in
``kvoffload.tiers.host_space.HostSpace``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import filterfalse, islice
from operator import attrgetter, itemgetter
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey, key_block_hash, key_group, key_groups
from kvoffload.tiers.base import (
    HOST,
    LoadGrant,
    LookupResult,
    PrepareStoreResult,
    Tier,
    TierEvent,
    TierHints,
    TierUsage,
)
from kvoffload.tiers.eviction import WRITING, BlockState, EvictionPolicy, Victims
from kvoffload.tiers.host_space import HostSpace, swap_states, writing_states
from kvoffload.tiers.host_stats import HostTierStats

if TYPE_CHECKING:
    from kvoffload.policies import CachePolicy

__all__ = ["HostTier", "HostTierStats"]


_REF = attrgetter("ref")
_SLOT = attrgetter("slot")
_KEY = itemgetter(0)


def _fmt(key: OffloadKey) -> str:
    return f"{key_block_hash(key).hex()[:16]}/g{key_group(key)}"


class HostTier(Tier):
    """Host-memory tier bookkeeping with a pluggable eviction policy.

    Built from an ``OffloadConfig`` and a cache policy: ``config.num_host_slots`` slots,
    evicted by the policy's eviction (``policy.eviction(config.num_host_slots)``;
    ``kvoffload.offload.build_offload`` resolves ``config.eviction_policy`` to it). Keys
    must belong to one of the config's groups.

    Pins: ``prepare_load`` pins each key (ref +1) until the matching ``complete_load``.
    ``prepare_store`` marks its new keys as being written (not readable, not evictable)
    until ``complete_store``. Nothing else pins.

    Events (when ``enable_events``): one ``removed=True`` event per ``prepare_store`` that
    evicted, one ``removed=False`` event per ``complete_store`` that made keys readable, and
    one ``removed=True`` event for the readable keys dropped by ``reset``. Replaying the
    events in order therefore yields exactly the set of readable keys.

    Demotion record (when ``tracks_demotions``, which a ``CascadeTier`` sets): the tier is
    the one owner of which present keys are under a demotion hint (``TierHints.demote``)
    and not used since. A key leaves the record when it is touched, loaded
    (``prepare_load``), evicted, dropped by a failed store, or by ``reset``; an evicted
    key that was in it is listed in ``PrepareStoreResult.evicted_demoted`` (the cascade
    does not write such a key back).

    Attributes:
        space: the slot and byte accounting (``HostSpace``; read-only use).
        tracks_demotions: keep the demotion record (off: ``evicted_demoted`` is always empty
            and the hot paths skip it).
    """

    name = HOST

    def __init__(self, config: OffloadConfig, policy: CachePolicy, *,
                 enable_events: bool = True) -> None:
        self.config = config
        self.enable_events = enable_events
        self.stats = HostTierStats()
        self.space = HostSpace(config)
        self.tracks_demotions = False
        self._policy: EvictionPolicy = policy.eviction(config.num_host_slots)
        self._events: list[TierEvent] = []
        self._demoted: set[OffloadKey] = set()
        # The hot paths read key states through the policy's dict (no frame per key) and
        # a key's group from its state (a new key's from the key, ``key_groups``).
        self._state_of = self._policy.state_of
        self._single_group = len(self.space.block_bytes) == 1

    # -- inspection -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Total slots."""
        return self.space.slots.capacity

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (read-only use: it holds the keys' states)."""
        return self._policy

    def __len__(self) -> int:
        """Keys present, ready or being written."""
        return len(self._policy)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is present, ready or being written."""
        return key in self._policy

    def __iter__(self) -> Iterator[OffloadKey]:
        """Present keys, next eviction candidate first. Do not mutate while iterating."""
        return (key for key, _ in self._policy.items())

    def ref_count(self, key: OffloadKey) -> int | None:
        """``-1`` being written, ``0`` idle, ``n > 0`` pinned by n loads; ``None`` absent."""
        state = self._state_of(key)
        return None if state is None else state.ref

    def slot_of(self, key: OffloadKey) -> int | None:
        """The key's slot, or ``None`` if absent."""
        state = self._state_of(key)
        return None if state is None else state.slot

    def debug_state(self) -> dict[str, object]:
        """A comparable copy of all bookkeeping (not ``stats``), for before/after tests."""
        return {
            "policy": self._policy.debug_state(),
            **self.space.debug_state(),
            "events": list(self._events),
            "demoted": sorted(self._demoted),
        }

    # -- reads ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        """HIT if ready, PENDING if being written, else MISS. Changes only ``stats``."""
        state = self._state_of(key)
        if state is None:
            self.stats.lookup_misses += 1
            return LookupResult.MISS
        if state.ref == WRITING:
            self.stats.lookup_pending += 1
            return LookupResult.PENDING
        self.stats.lookup_hits += 1
        return LookupResult.HIT

    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadGrant:
        """Pin every key (ref +1; a key listed twice is pinned twice); return the slots in
        order, every block's source being ``"host"``.

        Pins last until ``complete_load`` of the same keys. A key that is absent or being
        written raises ``InvariantError`` and nothing is pinned. Loaded keys leave the
        demotion record.
        """
        slots = self.pin_for_load(keys)
        if not slots:
            return LoadGrant(slots)
        if self._single_group:
            return LoadGrant(slots, MappingProxyType({(HOST, 0): len(slots)}))
        by_group: dict[tuple[str, int], int] = {}
        for key in keys:
            where = (HOST, key_group(key))
            by_group[where] = by_group.get(where, 0) + 1
        return LoadGrant(slots, MappingProxyType(by_group))

    def pin_for_load(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """``prepare_load`` without building its grant (for a cascade, which names the
        sources itself): pin, count the load, take the keys off the demotion record."""
        slots = self.pin(keys)
        self.stats.keys_loaded += len(slots)
        if self._demoted:
            self._demoted.difference_update(keys)
        return slots

    def pin(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """``prepare_load`` without counting a load (a lower tier's demote reads the slot);
        ``complete_load`` releases it."""
        state_of = self._state_of
        block_bytes = self.space.block_bytes
        slots: list[int] = []
        newly_pinned = newly_pinned_bytes = 0
        for key in keys:
            state = state_of(key)
            if state is None or state.ref < 0:
                self._undo_pins(islice(keys, len(slots)))
                what = "absent" if state is None else "still being written"
                raise InvariantError(f"host prepare_load: key {_fmt(key)} is {what}")
            if state.ref == 0:
                newly_pinned += 1
                newly_pinned_bytes += block_bytes[state.group]
            state.ref += 1
            slots.append(state.slot)
        self.space.num_pinned += newly_pinned
        self.space.bytes_pinned += newly_pinned_bytes
        return tuple(slots)

    def _undo_pins(self, keys: Iterable[OffloadKey]) -> None:
        """Take back the pins a failed ``pin`` took (its counters were not yet changed)."""
        for key in keys:
            state = self._state_of(key)
            assert state is not None
            state.ref -= 1

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Unpin each key once per listing (ref -1).

        Raises ``InvariantError`` and changes nothing if any key would drop below its
        pins (absent, being written, or not pinned that many times).
        """
        state_of = self._state_of
        block_bytes = self.space.block_bytes
        unpinned = unpinned_bytes = 0
        for released, key in enumerate(keys):
            state = state_of(key)
            if state is None or state.ref < 1:
                self._undo_releases(islice(keys, released))
                times = sum(1 for other in keys if other == key)
                held = "absent" if state is None else f"ref {state.ref}"
                raise InvariantError(
                    f"host complete_load: key {_fmt(key)} released {times}x but {held} "
                    "(no matching prepare_load)")
            state.ref -= 1
            if state.ref == 0:
                unpinned += 1
                unpinned_bytes += block_bytes[state.group]
        self.space.num_pinned -= unpinned
        self.space.bytes_pinned -= unpinned_bytes

    def _undo_releases(self, keys: Iterable[OffloadKey]) -> None:
        """Give back the pins a failed ``complete_load`` released (counters unchanged)."""
        for key in keys:
            state = self._state_of(key)
            assert state is not None
            state.ref += 1

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark keys recently used; ``keys[0]`` ends most recent. Absent keys are ignored
        (ARC still learns from recently evicted ones). Touched keys leave the demotion
        record."""
        self._policy.touch(keys)
        if self._demoted:
            self._demoted.difference_update(keys)

    # -- writes -----------------------------------------------------------------------

    def hint(self, hints: TierHints) -> int:
        """Hand the hints to the eviction policy in ``TierHints`` order (warm, demote,
        cool, values; ``prefetch`` means nothing here); demoted present keys enter the
        demotion record when ``tracks_demotions``. Returns how many keys went cold."""
        policy = self._policy
        if hints.warm:
            policy.warm(hints.warm)
        if hints.demote:
            policy.demote(hints.demote)
            if self.tracks_demotions:
                self._demoted.update(key for key in hints.demote if key in policy)
        cooled = policy.cool(hints.cool) if hints.cool else 0
        if hints.values:
            policy.set_values(hints.values)
        return cooled

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
        space = self.space
        block_bytes = space.block_bytes
        state_of = self._state_of
        new = list(filterfalse(state_of, keys))  # absent keys (a BlockState is truthy)
        listed = frozenset(keys)
        if len(listed) < len(keys):
            new = list(dict.fromkeys(new))  # repeats dropped, first listing kept
        groups = self._groups_of(new)
        self.stats.keys_deduped += len(keys) - len(new)

        victims: Victims = []
        evicted: tuple[OffloadKey, ...] = ()
        evicted_slots: tuple[int, ...] = ()
        evicted_demoted: tuple[OffloadKey, ...] = ()
        new_bytes = (len(new) * block_bytes[0] if groups is None
                     else sum(block_bytes[g] for g in groups))
        need = len(new) - space.slots.num_free
        need_bytes = (space.bytes_used() + new_bytes - space.budget
                      if space.charges_bytes else 0)
        # A full tier of one group under slot accounting (the steady state) hands each
        # victim's slot and detached state straight to a new key (``swap_states``).
        swap = need == len(new) and self._single_group and not space.charges_bytes
        if need > 0 or need_bytes > 0:
            shield = self._shield(listed, protected)
            chosen = space.choose_victims(policy, need, need_bytes, shield)
            if chosen is None:
                self.stats.stores_rejected += 1
                return None
            victims = chosen
            if swap:
                states = swap_states(victims)
                slots = list(map(_SLOT, states))
                evicted_slots = tuple(reversed(slots))
            else:
                evicted_slots = space.evicted(victims)
            evicted = tuple(map(_KEY, victims))
            if self._demoted:  # evicted keys leave the demotion record
                evicted_demoted = tuple(key for key in evicted if key in self._demoted)
                self._demoted.difference_update(evicted_demoted)
            self.stats.keys_evicted += len(evicted)
            self._emit(evicted, removed=True)

        if not (swap and victims):
            slots = space.slots.allocate(len(new))
            states = writing_states(slots, groups, victims, policy.new_state)
            if groups is None:
                space.keys_per_group[0] += len(new)
            else:
                keys_per_group = space.keys_per_group
                for group in groups:
                    keys_per_group[group] += 1
        policy.insert_all(new, states)
        space.num_writing += len(new)
        space.bytes_writing += new_bytes
        self.stats.keys_reserved += len(new)
        return PrepareStoreResult(keys_to_store=tuple(new), slots=tuple(slots), evicted=evicted,
                                  evicted_slots=evicted_slots, evicted_demoted=evicted_demoted)

    def _groups_of(self, keys: Sequence[OffloadKey]) -> list[int] | None:
        """The group of each key; ``None`` when the config has one group (every key's is
        0). A key of a group the config does not have raises ``InvariantError``."""
        groups = key_groups(keys)
        num_groups = len(self.space.block_bytes)
        if self._single_group:
            if not any(groups):
                return None
        elif max(groups, default=0) < num_groups:
            return groups
        key = next(key for key, group in zip(keys, groups, strict=True)
                   if group >= num_groups)
        raise InvariantError(
            f"host prepare_store: key {_fmt(key)} names group {key_group(key)}, "
            f"config has {num_groups}")

    @staticmethod
    def _shield(listed: frozenset[OffloadKey], protected: AbstractSet[OffloadKey],
                ) -> AbstractSet[OffloadKey]:
        """What a store may not evict: its own input keys (``listed``) and ``protected``."""
        if not protected:
            return listed
        # A cascade's protected set already holds the keys it promotes: no copy then.
        if listed <= protected:
            return protected
        return listed.union(protected)

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """End the write of keys being written.

        On success they become readable and idle (evictable) and a ``removed=False``
        event is queued. On failure they are removed (and leave the demotion record) and
        their slots freed. Keys that are ready or absent are ignored, so repeating a call
        is harmless. The caller must complete each store job once: a stale repeat after a
        key was evicted and is being written again by another job would end that other
        write.
        """
        space = self.space
        block_bytes = space.block_bytes
        state_of = self._state_of
        done: list[OffloadKey] = []
        if success and self._single_group:  # the common case: no states to keep
            self._complete_one_group(keys)
            return
        states: list[BlockState] = []
        remove = self._policy.remove
        for key in keys:
            state = state_of(key)
            if state is not None and state.ref == WRITING:
                if success:
                    state.ref = 0
                else:
                    remove(key)
                done.append(key)
                states.append(state)
        if not done:
            return
        space.num_writing -= len(done)
        space.bytes_writing -= (len(done) * block_bytes[0] if self._single_group
                                else sum(block_bytes[state.group] for state in states))
        if success:
            self.stats.keys_stored += len(done)
            if self.enable_events:
                self._emit(tuple(done), removed=False)
            return
        keys_per_group = space.keys_per_group
        for state in states:
            keys_per_group[state.group] -= 1
        space.slots.free(state.slot for state in states)
        self.stats.keys_store_failed += len(done)
        if self._demoted:
            self._demoted.difference_update(done)

    def _complete_one_group(self, keys: Iterable[OffloadKey]) -> None:
        """``complete_store(keys, success=True)`` for a config of one group."""
        state_of = self._state_of
        done: list[OffloadKey] = []
        mark = done.append
        for key in keys:
            state = state_of(key)
            if state is not None and state.ref == WRITING:
                state.ref = 0
                mark(key)
        if done:
            space = self.space
            space.num_writing -= len(done)
            space.bytes_writing -= len(done) * space.block_bytes[0]
            self.stats.keys_stored += len(done)
            if self.enable_events:
                self._emit(tuple(done), removed=False)

    # -- housekeeping -----------------------------------------------------------------

    def take_events(self) -> list[TierEvent]:
        """Return and clear the queued events (always empty when events are disabled)."""
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Drop every key, pins and writes included; slots restart from 0; the demotion
        record is emptied.

        The caller guarantees that no completion for an earlier job arrives afterwards.
        Queued events are kept, and a ``removed`` event lists the readable keys dropped.
        ``stats`` are kept.
        """
        if self.enable_events:
            self._emit(tuple(key for key, state in self._policy.items() if state.ref >= 0),
                       removed=True)
        self._policy.clear()
        self.space.reset()
        self._demoted.clear()

    def is_full(self) -> bool:
        return self.space.is_full()  # as TierUsage.is_full, without building the usage

    def usage(self) -> TierUsage:
        """Occupancy now; ``bytes_by_group`` counts ready and being-written keys."""
        return self.space.usage()

    def check_integrity(self) -> None:
        """Raise ``InvariantError`` unless keys, states, counters and slots agree and every
        key in the demotion record is present."""
        self._policy.check_integrity()
        self.space.check_integrity(self._policy, _fmt)
        if any(key not in self._policy for key in self._demoted):
            raise InvariantError("host: a key in the demotion record is not present")

    def _emit(self, keys: tuple[OffloadKey, ...], *, removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(TierEvent(keys=keys, tier=self.name, removed=removed))
