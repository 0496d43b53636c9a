"""The tier contract: bookkeeping for one storage tier (host memory, disk, remote).

A tier's bookkeeping runs in the scheduler process and never moves a byte: it decides which
slot a key lives in, which keys may be read, and which to evict. Workers move the bytes.

Lifecycle of a key::

    prepare_store -> (being written: not readable, not evictable)
        complete_store(success=True)  -> ready (readable; evictable while ref count is 0)
        complete_store(success=False) -> gone, slot free again
    ready: prepare_load -> ref count +1 (pinned) ... complete_load -> ref count -1

Rules every tier keeps (SYSTEM.md section 5):

* ``lookup`` answers HIT only for ready keys; PENDING for keys being written.
* ``prepare_store`` is atomic: it either returns a result and has reserved a slot for every
  key in ``keys_to_store``, or returns ``None`` and changed nothing. It never evicts one of
  its own input keys, a key being written, or a pinned key.
* Ref counts are exact: ``complete_load`` must match a ``prepare_load`` key for key;
  a mismatch raises ``InvariantError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvoffload.errors import InvariantError
from kvoffload.jobs import TierWork, WorkerReport
from kvoffload.keys import OffloadKey
from kvoffload.tiers.eviction.base import ValueHint


class LookupResult(Enum):
    HIT = "hit"
    """Stored and ready to read."""
    MISS = "miss"
    """Not stored."""
    PENDING = "pending"
    """Being written (or not yet known, for slow tiers): ask again later."""


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
    """

    keys_to_store: tuple[OffloadKey, ...]
    slots: tuple[int, ...]
    evicted: tuple[OffloadKey, ...]
    evicted_slots: tuple[int, ...] = field(default=(), compare=False)


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
    def prepare_load(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """Pin every key (all must be HIT) and return their slots in order.

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

    def demote(self, keys: Sequence[OffloadKey]) -> None:
        """Hint that present keys are worth little: evict them first. Default: ignored."""
        del keys

    def cool(self, keys: Sequence[OffloadKey]) -> int:
        """Hint that present keys not used since their insertion are *cold*: evicted
        before keys inserted or used normally (see ``EvictionPolicy.cool``), until used.
        Returns how many keys went cold. Default: ignored (0)."""
        del keys
        return 0

    def warm(self, keys: Sequence[OffloadKey]) -> None:
        """Hint that present cold keys are about to be used: they become normal, as if
        used. Default: ignored."""
        del keys

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

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads and connections (lower tiers); the tier is not used after."""

    def set_values(self, values: Sequence[ValueHint]) -> None:  # noqa: B027
        """Optional hint for value-aware eviction: (key, compute saved, bytes held)."""

    def prefetch(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """A lookup found ``keys`` PENDING and would hit them once readable: a tier whose
        PENDING means "in a slower tier" starts bringing them up. Default: nothing."""
