"""The tier cascade (``CascadeTier``): host memory first, then disk, then a remote store.

The planner keeps talking to one ``Tier``. The cascade wraps the ``HostTier`` -- the only
tier the engine loads from -- and the lower tiers' bookkeeping (``LowerTier``: disk,
remote), and turns what happens in host memory into *tier jobs* for the workers:

* **Promote.** A lookup of a key host memory lacks asks each lower tier in order. Where
  one holds it (or is still writing it, or is still asking a server), the lookup answers
  PENDING; the planner then defers the request (bounded by ``max_deferred_steps``, or by
  ``answer_wait_s`` seconds while a lower tier is still asking a server about it) and
  ``prefetch``-es the keys its hit would read, which are *wanted* if a lower tier holds
  them -- only those, not every key the lookup looked at (a Mamba group looks at many
  states to use one). When the step plan is built
  (``take_tier_work``) every wanted key gets a host slot (``prepare_store``, evicting idle
  keys but never one a prefetch of this step named) and a ``PROMOTE`` job reads it from the
  lower tier into that slot. When every rank reported it the key becomes readable in host
  memory (HIT at the next lookup); if any rank failed (missing, truncated, corrupt or
  foreign block, I/O error) the slot is freed, the lower tier drops the key, and the
  lookup after answers MISS -- the engine recomputes, it never gets wrong bytes. A key host
  memory has no slot for waits for one while keys held there will become evictable (being
  written, or pinned by loads), for at most ``room_wait_s`` seconds, and ``room_stall_s``
  seconds in which no promote got a slot, reported through ``answer_wait_s`` so the
  planner defers its request by time, not by steps an idle engine spins through in
  milliseconds; then, or at once when nothing will free or the request's prefetch is
  larger than host memory, its next lookup answers MISS and the request recomputes.
* **Demote, write-back.** Keys host memory evicts go to every write-back tier. Their slot
  is about to be written again (by this very plan's stores or promotes), so the ``DEMOTE``
  job is a *snapshot*: the worker copies the slot's bytes before it submits anything else
  of the plan, then writes them out asynchronously.
* **Demote, write-through.** Keys that become readable in host memory (stored by the
  engine or promoted) go to every write-through tier that lacks them. The host key stays
  pinned (a ``prepare_load`` pin) until the job reports, so the worker reads the slot
  itself, no copy.
* **Delete / purge.** Deletions the lower tiers decide (evictions, dropped keys, garbage
  found at start) become ``DELETE`` jobs; ``reset`` purges the disk tier.

Asynchrony: nothing here does I/O, and a step waits on a lower tier only through the
planner's ordinary deferral of a request whose blocks are being promoted.

Accounting follows the planner's rules for transfer jobs (``kvoffload.ledger.JobLedger``):
a tier job is done when every rank has reported it, exactly once; reports of jobs from
before ``reset`` are ignored (and the next plan flushes those jobs on the workers); a
report of a job never issued raises ``InvariantError``. The jobs themselves are kept by
``kvoffload.tiers.tier_jobs.TierJobQueue``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from types import MappingProxyType

from kvoffload.jobs import TierWork, WorkerReport
from kvoffload.keys import OffloadKey, key_group
from kvoffload.tiers.base import (
    HOST,
    LoadGrant,
    LookupResult,
    LowerUsage,
    PrepareStoreResult,
    Tier,
    TierEvent,
    TierHints,
    TierUsage,
)
from kvoffload.tiers.eviction import WRITING
from kvoffload.tiers.host import HostTier
from kvoffload.tiers.lower import LowerTier
from kvoffload.tiers.tier_jobs import CascadeStats, TierJobQueue, bump

__all__ = ["HOST", "ROOM_STALL_S", "ROOM_WAIT_S", "CascadeStats", "CascadeTier"]

ROOM_WAIT_S = 1.0
"""Seconds a wanted key may wait for a host slot (``CascadeTier``'s ``room_wait_s``).
Room comes when loads in flight finish and unpin their keys, or promotes and stores land:
one step's transfers, milliseconds on a GPU host and tens of them on a CPU one. The
bound only ends waits that something stalls (a worker's copies held up); a prefix that
takes longer to come back than this is better recomputed anyway."""

ROOM_STALL_S = 0.25
"""Seconds keys may wait for host slots while no promote gets one (``CascadeTier``'s
``room_stall_s``): waiting requests that take turns see a promote start every load or
so; where none starts (host memory far smaller than the hits loading at once, new stores
taking every slot that frees), waiting longer only delays the recompute."""


class CascadeTier(Tier):
    """Host memory plus lower tiers behind the one ``Tier`` the planner uses.

    Everything ``HostTier`` promises holds for the keys of host memory. ``lookup`` answers
    PENDING for a key only a lower tier holds; a ``prefetch`` hint of such keys makes the
    next step plan bring them up. The host tier keeps the demotion record
    (``HostTier.tracks_demotions`` is set): host victims under a demotion hint are not
    written back.
    """

    name = "cascade"

    def __init__(self, host: HostTier, lowers: Sequence[LowerTier], *,
                 room_wait_s: float = ROOM_WAIT_S, room_stall_s: float = ROOM_STALL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("room_wait_s", room_wait_s), ("room_stall_s", room_stall_s)):
            if not 0.0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds, 0 or more, "
                                 f"got {value!r}")
        names = [lt.name for lt in lowers]
        if len(set(names)) != len(names) or HOST in names:
            raise ValueError(f"lower tier names must be unique and not {HOST!r}: {names}")
        self.host = host
        host.tracks_demotions = True
        self.lowers = tuple(lowers)
        self.stats = CascadeStats()
        self._by_name = {lt.name: lt for lt in self.lowers}
        self._jobs = TierJobQueue(host, self.lowers, self.stats)
        self._want: dict[OffloadKey, LowerTier] = {}
        self._interest: set[OffloadKey] = set()
        self._no_room: set[OffloadKey] = set()
        """Wanted keys that found no host slot and may not wait: MISS until the next plan."""
        self._room_wait_s = room_wait_s
        self._room_stall_s = room_stall_s
        self._promoted_at = 0.0
        """When a promote last got a host slot (while keys waited for one)."""
        self._clock = clock
        self._awaiting_room: dict[OffloadKey, float] = {}
        """Wanted keys waiting for a host slot, and since when."""
        self._too_big: set[OffloadKey] = set()
        """Keys of this step's prefetches larger than host memory: they never wait."""
        self._jobs.collect_deletes()

    # -- host delegation ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.host)

    def __contains__(self, key: object) -> bool:
        return key in self.host

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self.host)

    @property
    def room_deferral_s(self) -> float:
        """The ``answer_wait_s`` of a key waiting for a host slot: twice ``room_wait_s``,
        so the cascade, not the planner, ends the wait (and counts it), though its clock
        starts one step plan after the planner's first deferral."""
        return 2.0 * self._room_wait_s

    def lower(self, name: str) -> LowerTier:
        """The lower tier called ``name``."""
        return self._by_name[name]

    def lower_usage(self) -> tuple[LowerUsage, ...]:
        """Each lower tier's bytes and blocks held, in lookup order (0 where a tier does
        not track them, e.g. the shared remote store)."""
        return tuple(LowerUsage(lt.name, *lt.held()) for lt in self.lowers)

    # -- reads --------------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> LookupResult:
        """Host memory's answer; for a host miss, PENDING while a lower tier holds the key,
        is writing it or is finding out, else MISS. Changes no tier's contents."""
        result = self.host.lookup(key)
        if result is not LookupResult.MISS:
            return result
        if key in self._no_room:
            return LookupResult.MISS
        if key in self._want:
            return LookupResult.PENDING
        for lower in self.lowers:
            if lower.status(key) is not LookupResult.MISS:
                return LookupResult.PENDING
        return LookupResult.MISS

    def prepare_load(self, keys: Sequence[OffloadKey]) -> LoadGrant:
        """``HostTier.prepare_load``; each block's source is the tier it came from for
        this request ("host", or the lower tier it was promoted from since it was last
        loaded), also counted in ``stats.loaded_blocks`` / ``loaded_group_blocks``. A
        demoted key that is hit is worth writing back after all."""
        slots = self.host.pin_for_load(keys)
        by_group = self.stats.loaded_group_blocks
        loaded = self.stats.loaded_blocks
        grant: dict[tuple[str, int], int] = {}
        for key in keys:
            tier = self._jobs.take_origin(key)
            bump(loaded, tier)
            where = (tier, key_group(key))
            bump(by_group, where)
            bump(grant, where)
        return LoadGrant(slots, MappingProxyType(grant))

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        self.host.complete_load(keys)

    def hint(self, hints: TierHints) -> int:
        """Eviction hints go to host memory (``HostTier.hint``, which keeps demoted keys
        from write-back); then ``prefetch`` hints make every key a lower tier holds and
        host memory lacks *wanted*: the next step plan promotes it (``take_tier_work``),
        shielding the prefetched keys host memory holds from the evictions it causes. A
        prefetch (one request's hit) larger than host memory cannot come up whole: its
        keys do not wait for room (``take_tier_work``)."""
        cooled = self.host.hint(hints)
        if not self._fits_host(hints.prefetch):
            self._too_big.update(hints.prefetch)
        for key in hints.prefetch:
            self._interest.add(key)
            if key in self.host or key in self._want or key in self._no_room:
                continue
            for lower in self.lowers:
                answer = lower.status(key)
                if answer is LookupResult.HIT:
                    self._want[key] = lower
                if answer is not LookupResult.MISS:
                    break
        return cooled

    def _fits_host(self, keys: Sequence[OffloadKey]) -> bool:
        """Whether ``keys`` fit host memory together: its slots, and under byte
        accounting its byte budget."""
        space = self.host.space
        if len(keys) > self.host.capacity:
            return False
        return not space.charges_bytes or sum(map(space.key_bytes, keys)) <= space.budget

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Recency in host memory and in every lower tier that keeps an order. A touch
        undoes a demotion hint in host memory, so such a key is written back again."""
        self.host.touch(keys)
        for lower in self.lowers:
            lower.touch(keys)

    # -- writes -------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreResult | None:
        """``HostTier.prepare_store``; its victims are demoted to write-back tiers."""
        result = self.host.prepare_store(keys)
        if result is not None:
            self._jobs.write_back(result)
        return result

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """``HostTier.complete_store``; keys that became readable are written through."""
        if not (success and self._jobs.writes_through):
            self.host.complete_store(keys, success)
            return
        keys = list(keys)
        writing = [k for k in keys if self.host.ref_count(k) == WRITING]
        self.host.complete_store(keys, success)
        self._jobs.write_through(writing)

    # -- tier jobs ----------------------------------------------------------------------

    def take_tier_work(self) -> TierWork:
        """Promote the wanted keys, then hand out every queued tier job (see the module
        docstring). Call once per step plan, after the plan's stores were reserved."""
        wanted, self._want = self._want, {}
        no_room, promoted = self._jobs.promote(wanted, frozenset(self._interest))
        self._no_room = self._wait_for_room(no_room, self._too_big, promoted=promoted > 0)
        self._too_big = set()
        for key in self._no_room:
            bump(self.stats.promote_no_room_miss, wanted[key].name)
        self._jobs.collect_deletes()
        self._interest = set()
        return self._jobs.take_work()

    def _wait_for_room(self, no_room: Sequence[OffloadKey], too_big: AbstractSet[OffloadKey],
                       *, promoted: bool) -> set[OffloadKey]:
        """Of the keys a promote found no slot for, those whose next lookup answers MISS:
        all of them when no key in host memory is being written or pinned (nothing will
        free), else those of a prefetch larger than host memory (``too_big``), those that
        waited ``room_wait_s`` and those that waited ``room_stall_s`` since they began or
        since a promote last got a slot (``promoted``: one did in this plan), whichever is
        later; the rest wait on. A key no request asked for again in this plan is
        forgotten."""
        space = self.host.space
        if not no_room or space.num_writing + space.num_pinned == 0:
            self._awaiting_room = {}
            return set(no_room)
        now = self._clock()
        if promoted:
            self._promoted_at = now
        since = self._awaiting_room
        self._awaiting_room = {key: since.get(key, now) for key in no_room
                               if key not in too_big}
        missed = {key for key, t in self._awaiting_room.items()
                  if now - t >= self._room_wait_s
                  or now - max(t, self._promoted_at) >= self._room_stall_s}
        for key in missed:
            del self._awaiting_room[key]
        return set(no_room) - self._awaiting_room.keys()

    def update_from_tier_reports(self, reports: Sequence[WorkerReport]) -> None:
        """Count tier-job reports per rank; finish jobs every rank reported."""
        self._jobs.count_reports(reports)
        self._jobs.collect_deletes()

    def has_pending_work(self) -> bool:
        return self._jobs.has_pending or bool(self._want)

    def answer_wait_s(self, keys: Iterable[OffloadKey]) -> float:
        """The largest ``LowerTier.answer_wait_s`` of these keys over the lower tiers
        (0.0 when no lower tier is still asking about any of them); at least
        ``room_deferral_s`` where one of them waits for a host slot."""
        keys = list(keys)
        waits = [lt.answer_wait_s for lt in self.lowers
                 if type(lt).answer_wait_s is not LowerTier.answer_wait_s]
        answers = max((wait(key) for key in keys for wait in waits), default=0.0)
        if self._awaiting_room and any(key in self._awaiting_room for key in keys):
            return max(answers, self.room_deferral_s)
        return answers

    @property
    def num_tier_jobs(self) -> int:
        """Tier jobs handed out and not yet reported by every rank."""
        return len(self._jobs)

    # -- housekeeping -------------------------------------------------------------------

    def take_events(self) -> list[TierEvent]:
        return self.host.take_events()

    def reset(self) -> None:
        """Drop host memory and every tier job in flight (the next plan flushes them on
        the workers; their reports are ignored). Lower tiers forget their in-flight work;
        the disk tier is purged, the shared remote store keeps its blocks."""
        self.host.reset()
        self._want.clear()
        self._interest.clear()
        self._no_room.clear()
        self._awaiting_room.clear()
        self._too_big.clear()
        self._jobs.reset()

    def usage(self) -> TierUsage:
        """Host memory's occupancy (lower tiers: ``lower_usage``)."""
        return self.host.usage()

    def is_full(self) -> bool:
        return self.host.is_full()

    def check_integrity(self) -> None:
        """Host and lower tiers consistent (every key kept from write-back is in host
        memory); every promote in flight holds a host slot being written; every pinned
        demote is matched by a host pin."""
        self.host.check_integrity()
        for lower in self.lowers:
            lower.check_integrity()
        self._jobs.check_integrity()

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Block until no lower tier has an existence check in flight. For simulators and
        tests, whose steps take no wall time: a real step outlasts a check."""
        return all(lower.wait_idle(timeout) for lower in self.lowers)

    def close(self) -> None:
        """Stop the lower tiers' threads and connections."""
        for lower in self.lowers:
            lower.close()
