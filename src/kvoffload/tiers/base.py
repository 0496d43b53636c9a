"""The tier contract: bookkeeping for one storage tier (host memory, disk, remote).

A tier's bookkeeping runs in the scheduler process and never moves a byte: it decides which
slot a key lives in, which keys may be read, and which to evict. Workers move the bytes.

Lifecycle of a key::

    prepare_store -> (being written: not readable, not evictable)
        complete_store(success=True)  -> ready (readable; evictable while ref count is 0)
        complete_store(success=False) -> gone, slot free again
    ready: prepare_load -> ref count +1 (pinned) ... complete_load -> ref count -1

Rules every tier keeps (``docs/architecture.md``, rules 1-3):

* ``lookup`` answers HIT only for ready keys; PENDING for keys being written.
* ``prepare_store`` is atomic: it either returns a result and has reserved a slot for every
  key in ``keys_to_store``, or returns ``None`` and changed nothing. It never evicts one of
  its own input keys, a key being written, or a pinned key.
* Ref counts are exact: ``complete_load`` must match a ``prepare_load`` key for key;
  a mismatch raises ``InvariantError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from kvoffload.errors import InvariantError
from kvoffload.jobs import TierWork, WorkerReport
from kvoffload.keys import OffloadKey
from kvoffload.tiers.eviction.base import ValueHint, ValueRun

HOST = "host"
"""Tier name of host memory (``LoadGrant.blocks_by_source``, ``CascadeStats``)."""


class LookupResult(Enum):
    """What a tier knows about a key right now: ``Tier.lookup`` answers it, and so does a
    lower tier's ``LowerTier.status`` (``kvoffload.tiers.lower``)."""

    HIT = "hit"
    """Stored and ready to read (in a lower tier: a promote can start)."""
    MISS = "miss"
    """Not stored (or, for a lower tier, the tier is skipped for now)."""
    PENDING = "pending"
    """Being written, or the answer is not known yet (slow tiers): ask again later."""


@dataclass(frozen=True)
class PrepareStoreResult:
    """Outcome of a successful ``prepare_store``.

    Attributes:
        keys_to_store: the input keys that need writing, in input order (keys already
            present, ready or being written, are left out).
        slots: destination slot of each key in ``keys_to_store``, same order.
        evicted: keys evicted to make room.
        evicted_slots: the slot each evicted key held, same order (a lower tier demotes
            the victims' bytes from there before the slots are written again). Not
            compared: two results are equal when they reserve and evict the same keys.
        evicted_demoted: the evicted keys that were under a demotion hint and not used
            since (only where the tier keeps that record, ``HostTier(tracks_demotions=True)``): a
            cascade does not write them back. Not compared either.
    """

    keys_to_store: tuple[OffloadKey, ...]
    slots: tuple[int, ...]
    evicted: tuple[OffloadKey, ...]
    evicted_slots: tuple[int, ...] = field(default=(), compare=False)
    evicted_demoted: tuple[OffloadKey, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class TierHints:
    """Eviction hints for one ``Tier.hint`` call; every field defaults to empty.

    The planner knows what keys are worth; the tier's eviction policy decides what that
    means for the order of evictions. Within one call the hints are applied in this order,
    each to the keys present at that point (absent keys are ignored):

    1. ``warm``: present cold keys are about to be used: they become normal, as if used.
    2. ``demote``: present keys are worth little (no likely hit uses them): evicted first;
       a tier with lower tiers also keeps them from write-back until they are used
       (``touch`` or ``prepare_load``).
    3. ``cool``: present keys not used since their insertion become *cold*: evicted before
       keys inserted or used normally (see ``EvictionPolicy.cool``), until used; the
       count of keys that went cold is what ``Tier.hint`` returns.
    4. ``values``: what present keys are worth (``ValueHint``: key, compute saved, bytes
       held, anchor; or a ``ValueRun``: one value for many keys) for value-aware eviction.
    5. ``prefetch``: a lookup found these keys PENDING and would hit them once readable; a
       tier whose PENDING means "in a slower tier" brings them up with the next step plan.

    The order is the one in which the planner gives them within one step (a preempted
    request's keys are warmed before the step's stores; a store demotes the previous
    resume point, then cools its new keys, then values them), so one call with several
    fields behaves as the separate calls made in that order.
    """

    warm: tuple[OffloadKey, ...] = ()
    demote: tuple[OffloadKey, ...] = ()
    cool: tuple[OffloadKey, ...] = ()
    values: tuple[ValueHint | ValueRun, ...] = ()
    prefetch: tuple[OffloadKey, ...] = ()


@dataclass(frozen=True)
class LoadGrant:
    """Outcome of ``Tier.prepare_load``: where the pinned keys are and where they came from.

    Attributes:
        slots: the host slot of each key, in input order.
        blocks_by_source: blocks of this load by (tier that served it, group index): the
            tier is ``"host"`` (``HOST``) for a block that was in host memory when a request
            asked for it, else the name of the lower tier it was promoted from for that
            request. The counts sum to ``len(slots)``. Read-only.
    """

    slots: tuple[int, ...]
    blocks_by_source: Mapping[tuple[str, int], int] = field(
        default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class LowerUsage:
    """A snapshot of one tier below host memory (``Tier.lower_usage``).

    Attributes:
        name: the lower tier's name ("disk", "remote", ...).
        used_bytes: bytes it holds, where it tracks them (0 where it does not: a shared
            remote store).
        blocks: blocks it holds, where it tracks them (else 0).
    """

    name: str
    used_bytes: int
    blocks: int


@dataclass(frozen=True)
class TierEvent:
    """Keys that became readable (``removed=False``) or left the tier (``removed=True``)."""

    keys: tuple[OffloadKey, ...]
    tier: str
    removed: bool


@dataclass(frozen=True)
class TierUsage:
    """A snapshot of a tier's occupancy.

    Attributes:
        capacity_slots: total slots.
        used_slots: slots holding a key (ready or being written).
        pinned_slots: ready keys with ref count > 0.
        writing_slots: keys being written.
        bytes_by_group: bytes held per group index (real block sizes, not slot sizes).
        capacity_bytes: the byte budget when the tier charges each block its own bytes
            (``host_accounting="bytes"``); 0 when slots are the budget.
        largest_block_bytes: bytes of the largest group's block (byte budgets only).
    """

    capacity_slots: int
    used_slots: int
    pinned_slots: int
    writing_slots: int
    bytes_by_group: dict[int, int]
    capacity_bytes: int = 0
    largest_block_bytes: int = 0

    @property
    def is_full(self) -> bool:
        """No room for one more block of the largest kind without evicting."""
        if self.capacity_bytes:
            held = sum(self.bytes_by_group.values())
            return held + self.largest_block_bytes > self.capacity_bytes
        return self.used_slots >= self.capacity_slots


class Tier(ABC):
    """Bookkeeping of one storage tier. See the module docstring for the contract."""

    name: str

    @abstractmethod
    def lookup(self, key: OffloadKey) -> LookupResult:
        """Whether ``key`` can be read now. Changes nothing."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadGrant:
        """Pin every key (all must be HIT); return their slots in order and the tier each
        block came from (``LoadGrant``).

        Pins last until the matching ``complete_load``. A key that is not ready raises
        ``InvariantError``.
        """

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Undo one ``prepare_load`` of the same keys (ref count -1 each)."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark present keys recently used; the *first* key ends up most recent.

        Keys not present are ignored.
        """

    def hint(self, hints: TierHints) -> int:
        """Apply eviction hints to present keys (see ``TierHints`` for each kind and the
        order they are applied in). Keys not present are ignored; nothing is pinned.
        Returns how many keys went cold (``TierHints.cool``). Default: all ignored (0)."""
        del hints
        return 0

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is present, ready or being written (no lookup is counted)."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreResult | None:
        """Reserve slots for the keys not yet present, evicting if needed (atomic)."""

    @abstractmethod
    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """Finish a store: ready on success, removed with slots freed on failure.

        Keys that are already ready are left alone, so a repeated call is harmless.
        """

    @abstractmethod
    def take_events(self) -> list[TierEvent]:
        """Return and clear the events queued since the last call."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every key. The caller guarantees no completion arrives for older jobs."""

    @abstractmethod
    def usage(self) -> TierUsage:
        """Occupancy snapshot."""

    def is_full(self) -> bool:
        """``usage().is_full`` (no room for one more block of the largest kind without
        evicting); tiers may answer it without building the whole ``TierUsage``: admission
        asks once per candidate block."""
        return self.usage().is_full

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise ``InvariantError`` if internal bookkeeping is inconsistent."""

    # -- tier jobs (lower tiers below host memory; see ``kvoffload.tiers.cascade``) ------

    def take_tier_work(self) -> TierWork:
        """Tier jobs for the next step plan, and tier jobs the workers must wait for first.

        Called once per step plan, after the plan's stores were reserved. A tier without
        lower tiers has none.
        """
        return TierWork()

    def update_from_tier_reports(self, reports: Sequence[WorkerReport]) -> None:
        """Count the tier-job parts of the workers' reports (``tier_finished`` and so on).

        A tier without lower tiers never issues tier jobs, so any report of one is a bug.
        """
        for report in reports:
            if report.tier_finished or report.tier_failed:
                raise InvariantError(f"{self.name}: rank {report.rank} reported tier jobs, "
                                     "but this tier never issues any")

    def has_pending_work(self) -> bool:
        """Tier jobs in flight or not yet handed out."""
        return False

    def answer_wait_s(self, keys: Iterable[OffloadKey]) -> float:
        """Seconds a lookup that found ``keys`` PENDING may keep waiting for answers a
        lower tier asked for about them and has not heard back on (the largest such bound:
        the remote tier's round-trip timeout while its existence check is outstanding), or
        for host room to promote them into (a cascade's ``room_wait_s``); 0.0 when no such
        wait is outstanding -- the keys are being written or promoted, which the planner
        bounds by steps. Default: 0.0 (no lower tiers). Changes nothing."""
        del keys
        return 0.0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads and connections (lower tiers); the tier is not used after."""

    # -- structure (for engines and reports; the planner needs none of it) -------------

    def lower_usage(self) -> tuple[LowerUsage, ...]:
        """Occupancy of each tier below host memory, in lookup order (empty without lower
        tiers). Changes nothing."""
        return ()

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Block until no lower tier has an asynchronous existence check in flight, at
        most ``timeout`` seconds each; True when idle. For simulators and tests whose
        steps take no wall time (a real step outlasts a check). Default: idle at once."""
        del timeout
        return True
