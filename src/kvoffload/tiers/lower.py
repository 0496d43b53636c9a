"""The contract of a lower tier's bookkeeping (disk, remote), as the cascade uses it.

A lower tier sits below host memory. The engine never reads it directly: a block found
there is first *promoted* into a host slot (a ``PROMOTE`` tier job), then loaded from host
memory like any other hit. Blocks reach it by *demotion* from host memory (``DEMOTE``),
either when host memory evicts them (write-back) or as soon as they are stored
(write-through). Like ``HostTier``, a lower tier's bookkeeping runs in the scheduler
process, decides, and never moves a byte; the workers' tier I/O does.

Lifecycle of a key in a lower tier, driven by ``CascadeTier``::

    begin_write -> (being written: PENDING) -> end_write(ok=True)  -> HIT
                                             -> end_write(ok=False) -> MISS
    HIT: begin_read (pins, where the tier can) ... end_read(ok)  (ok=False: the block
         was missing, truncated, corrupt or foreign -> dropped -> MISS)

``status`` answers with the tier contract's ``LookupResult`` (HIT, MISS, PENDING).

Deletions a tier decides (evictions, dropped blocks, garbage found at start) are handed
out by ``take_deletes`` and become ``DELETE`` tier jobs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.keys import OffloadKey
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.config import WriteMode


@dataclass
class LowerTierStats:
    """Cumulative counters of one lower tier (plain data).

    Attributes:
        lookups_present / lookups_absent / lookups_pending: ``status`` answers.
        reads_ok / reads_failed: promotes out of this tier, by outcome.
        writes_started / writes_ok / writes_failed / writes_skipped: demotes into it
            (skipped: already present, no room, or the tier is unreachable).
        evicted: keys evicted to stay within the budget.
        dropped: keys dropped after a failed read or write.
        unreachable: times the tier was marked unreachable.
    """

    lookups_present: int = 0
    lookups_absent: int = 0
    lookups_pending: int = 0
    reads_ok: int = 0
    reads_failed: int = 0
    writes_started: int = 0
    writes_ok: int = 0
    writes_failed: int = 0
    writes_skipped: int = 0
    evicted: int = 0
    dropped: int = 0
    unreachable: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class LowerTier(ABC):
    """Bookkeeping of one tier below host memory (see the module docstring)."""

    name: str
    write_mode: WriteMode
    stats: LowerTierStats

    def held(self) -> tuple[int, int]:
        """(bytes, blocks) this tier holds, where it tracks them; (0, 0) for one that does
        not (a store shared by a fleet). Changes nothing."""
        return 0, 0

    @abstractmethod
    def status(self, key: OffloadKey) -> LookupResult:
        """Whether ``key`` can be promoted now. May start an asynchronous existence check
        (then PENDING) but never blocks on I/O."""

    @abstractmethod
    def begin_read(self, key: OffloadKey) -> bool:
        """A promote of a HIT key starts; pin it where the tier can. False: not
        readable after all (nothing changed)."""

    @abstractmethod
    def end_read(self, key: OffloadKey, ok: bool) -> None:
        """The promote of ``key`` ended on every rank. ``ok=False`` drops the key (its
        remains are deleted)."""

    @abstractmethod
    def begin_write(self, key: OffloadKey) -> bool:
        """Reserve room for a demote of ``key``, evicting if needed. False (nothing
        changed, except evictions it could not avoid) when the key is present or being
        written already, the tier has no room, or it is unreachable."""

    @abstractmethod
    def end_write(self, key: OffloadKey, ok: bool) -> None:
        """The demote of ``key`` ended on every rank: HIT on success, dropped else."""

    def answer_wait_s(self, key: OffloadKey) -> float:
        """Seconds an answer about ``key`` that this tier asked for and has not heard back
        on (an existence check queued or in flight) may still take at most: the bound of
        the call that asks, after which the tier answers or marks itself unreachable.
        0.0 when no answer about ``key`` is outstanding (the default: the tier knows its
        contents at once). Changes nothing."""
        del key
        return 0.0

    def touch(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """Mark keys recently used (first key most recent); absent keys are ignored."""

    def mark_unreachable(self) -> None:  # noqa: B027 - optional hook
        """A worker could not reach the tier: skip it for a while."""

    def take_deletes(self) -> list[OffloadKey]:
        """Keys whose stored blocks must be deleted (each returned once)."""
        return []

    @abstractmethod
    def reset(self) -> bool:
        """Forget in-flight reads and writes (their reports will be ignored) after a cache
        reset. Returns True when every stored block must be purged as well."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise ``InvariantError`` if the bookkeeping is inconsistent."""

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Block until no asynchronous existence check is in flight (simulators and tests
        that model a step's duration; an engine never calls it). True when idle."""
        del timeout
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release threads and connections; the tier answers MISS afterwards."""
