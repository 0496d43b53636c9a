"""The tier cascade (``CascadeTier``): host memory first, then disk, then a remote store.

The planner keeps talking to one ``Tier``. The cascade wraps the ``HostTier`` -- the only
tier the engine loads from -- and the lower tiers' bookkeeping (``LowerTier``: disk,
remote), and turns what happens in host memory into *tier jobs* for the workers:

* **Promote.** A lookup of a key host memory lacks asks each lower tier in order. Where
  one holds it (or is still writing it, or is still asking a server), the lookup answers
  PENDING; the planner then defers the request (bounded by ``max_deferred_steps``) and
  ``prefetch``-es the keys its hit would read, which are *wanted* if a lower tier holds
  them -- only those, not every key the lookup looked at (a Mamba group looks at many
  states to use one). When the step plan is built
  (``take_tier_work``) every wanted key gets a host slot (``prepare_store``, evicting idle
  keys but never one a prefetch of this step named) and a ``PROMOTE`` job reads it from the
  lower tier into that slot. When every rank reported it the key becomes readable in host
  memory (HIT at the next lookup); if any rank failed (missing, truncated, corrupt or
  foreign block, I/O error) the slot is freed, the lower tier drops the key, and the
  lookup after answers MISS -- the engine recomputes, it never gets wrong bytes.
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

Accounting follows the planner's rules for transfer jobs: a tier job is done when every
rank has reported it, exactly once; reports of jobs from before ``reset`` are ignored (and
the next plan flushes those jobs on the workers); a report of a job never issued raises
``InvariantError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvoffload.completion import count_rank_report
from kvoffload.errors import InvariantError
from kvoffload.jobs import TierJob, TierJobId, TierOp, TierWork, WorkerReport
from kvoffload.keys import OffloadKey, key_group
from kvoffload.tiers.base import (
    LookupResult,
    PrepareStoreResult,
    Tier,
    TierEvent,
    TierUsage,
)
from kvoffload.tiers.config import WriteMode
from kvoffload.tiers.cpu import HostTier
from kvoffload.tiers.eviction import WRITING, ValueHint
from kvoffload.tiers.lower import LowerTier, Presence

HOST = "host"


@dataclass
class CascadeStats:
    """Cumulative counters of a cascade (plain data; ``reset`` keeps them).

    Attributes:
        loaded_blocks: blocks handed to the engine by ``prepare_load``, by the tier each
            was in when a request asked for it ("host", or the lower tier it was promoted
            from for that request). Their shares are the tiers' hit shares.
        loaded_group_blocks: the same, by (tier, group index).
        promoted / promote_failed: promotes that completed, by source tier.
        promote_no_room: wanted keys host memory had no slot for (answered MISS once).
        demoted / demote_failed: demotes that completed, by destination tier.
        worthless_not_demoted: host evictions not written back because the planner had
            demoted the key (no likely hit uses it).
        deleted: delete and purge jobs that completed, by tier.
        stale_reports / duplicate_reports: ignored tier-job reports.
    """

    loaded_blocks: dict[str, int] = field(default_factory=dict)
    loaded_group_blocks: dict[tuple[str, int], int] = field(default_factory=dict)
    promoted: dict[str, int] = field(default_factory=dict)
    promote_failed: dict[str, int] = field(default_factory=dict)
    promote_no_room: int = 0
    demoted: dict[str, int] = field(default_factory=dict)
    demote_failed: dict[str, int] = field(default_factory=dict)
    worthless_not_demoted: int = 0
    deleted: dict[str, int] = field(default_factory=dict)
    stale_reports: int = 0
    duplicate_reports: int = 0

    def hit_shares(self) -> dict[str, float]:
        """Share of loaded blocks per tier (sums to 1 when anything was loaded)."""
        total = sum(self.loaded_blocks.values())
        return {t: n / total for t, n in self.loaded_blocks.items()} if total else {}


def _bump(table: dict[str, int], name: str, n: int = 1) -> None:
    table[name] = table.get(name, 0) + n


@dataclass(slots=True)
class _Job:
    job: TierJob
    lower: LowerTier
    pinned: bool = False
    reported_ranks: int = 0
    failed: bool = False


class CascadeTier(Tier):
    """Host memory plus lower tiers behind the one ``Tier`` the planner uses.

    Everything ``HostTier`` promises holds for the keys of host memory. ``lookup`` answers
    PENDING for a key only a lower tier holds; ``prefetch`` of such keys makes the next
    step plan bring them up.
    """

    name = "cascade"

    def __init__(self, host: HostTier, lowers: Sequence[LowerTier]) -> None:
        names = [lt.name for lt in lowers]
        if len(set(names)) != len(names) or HOST in names:
            raise ValueError(f"lower tier names must be unique and not {HOST!r}: {names}")
        self.host = host
        self.lowers = tuple(lowers)
        self.stats = CascadeStats()
        self._by_name = {lt.name: lt for lt in self.lowers}
        self._write_back = tuple(lt for lt in self.lowers
                                 if lt.write_mode is WriteMode.WRITE_BACK)
        self._write_thru = tuple(lt for lt in self.lowers
                                 if lt.write_mode is WriteMode.WRITE_THROUGH)
        self._num_workers = host.config.num_workers
        self._all_ranks = (1 << self._num_workers) - 1
        self._jobs: dict[TierJobId, _Job] = {}
        self._next_id = 0
        self._stale_below = 0
        self._queued: list[TierJob] = []
        self._flush: list[TierJobId] = []
        self._want: dict[OffloadKey, LowerTier] = {}
        self._interest: set[OffloadKey] = set()
        self._no_room: set[OffloadKey] = set()
        self._no_room_next: set[OffloadKey] = set()
        self._origin: dict[OffloadKey, str] = {}
        self._worthless: set[OffloadKey] = set()
        """Host keys demoted (no likely hit uses them): never written back on eviction."""
        self._collect_deletes()

    # -- host delegation ----------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.host)

    def __contains__(self, key: object) -> bool:
        return key in self.host

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self.host)

    def lower(self, name: str) -> LowerTier:
        """The lower tier called ``name``."""
        return self._by_name[name]

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
            if lower.status(key) is not Presence.ABSENT:
                return LookupResult.PENDING
        return LookupResult.MISS

    def prefetch(self, keys: Sequence[OffloadKey]) -> None:
        """Want every key a lower tier holds and host memory lacks: the next step plan
        promotes them (``take_tier_work``). Keys host memory holds are shielded from the
        evictions those promotes cause."""
        for key in keys:
            self._interest.add(key)
            if key in self.host or key in self._want or key in self._no_room:
                continue
            for lower in self.lowers:
                presence = lower.status(key)
                if presence is Presence.PRESENT:
                    self._want[key] = lower
                if presence is not Presence.ABSENT:
                    break

    def prepare_load(self, keys: Sequence[OffloadKey]) -> tuple[int, ...]:
        """``HostTier.prepare_load``; also counts each key's hit to the tier it came from.
        A demoted key that is hit is worth writing back after all."""
        slots = self.host.prepare_load(keys)
        self._worthless.difference_update(keys)
        by_group = self.stats.loaded_group_blocks
        for key in keys:
            tier = self._origin.pop(key, HOST)
            _bump(self.stats.loaded_blocks, tier)
            where = (tier, key_group(key))
            by_group[where] = by_group.get(where, 0) + 1
        return slots

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        self.host.complete_load(keys)

    def set_values(self, values: Sequence[ValueHint]) -> None:
        """Value hints go to host memory's policy."""
        self.host.set_values(values)

    def demote(self, keys: Sequence[OffloadKey]) -> None:
        """Demotion hints go to host memory's policy; a demoted key serves no likely hit,
        so it is not written back when host memory evicts it."""
        self.host.demote(keys)
        self._worthless.update(key for key in keys if key in self.host)

    def cool(self, keys: Sequence[OffloadKey]) -> int:
        """Cold-insertion hints go to host memory's policy."""
        return self.host.cool(keys)

    def warm(self, keys: Sequence[OffloadKey]) -> None:
        """So do the hints that cold keys are about to be used."""
        self.host.warm(keys)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Recency in host memory and in every lower tier that keeps an order. A touch
        undoes a demotion hint in host memory, so such a key is written back again."""
        self.host.touch(keys)
        self._worthless.difference_update(keys)
        for lower in self.lowers:
            lower.touch(keys)

    # -- writes -------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreResult | None:
        """``HostTier.prepare_store``; its victims are demoted to write-back tiers."""
        result = self.host.prepare_store(keys)
        if result is not None:
            self._evicted(result)
            self._worthless.difference_update(result.keys_to_store)
        return result

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        """``HostTier.complete_store``; keys that became readable are written through."""
        if not success:
            keys = list(keys)
            self._worthless.difference_update(keys)  # gone from host memory
        if not (success and self._write_thru):
            self.host.complete_store(keys, success)
            return
        keys = list(keys)
        writing = [k for k in keys if self.host.ref_count(k) == WRITING]
        self.host.complete_store(keys, success)
        self._write_through(writing)

    # -- tier jobs ----------------------------------------------------------------------

    def take_tier_work(self) -> TierWork:
        """Promote the wanted keys, then hand out every queued tier job (see the module
        docstring). Call once per step plan, after the plan's stores were reserved."""
        self._promote_wanted()
        self._collect_deletes()
        flush, self._flush = tuple(self._flush), []
        jobs, self._queued = tuple(self._queued), []
        self._interest = set()
        self._no_room, self._no_room_next = self._no_room_next, set()
        return TierWork(flush=flush, jobs=jobs)

    def update_from_tier_reports(self, reports: Sequence[WorkerReport]) -> None:
        """Count tier-job reports per rank; finish jobs every rank reported."""
        for report in reports:
            if not 0 <= report.rank < self._num_workers:
                raise InvariantError(f"tier report from rank {report.rank}; num_workers is "
                                     f"{self._num_workers}")
            for name in report.tier_unreachable:
                lower = self._by_name.get(name)
                if lower is not None:
                    lower.mark_unreachable()
            for failed, ids in ((False, report.tier_finished), (True, report.tier_failed)):
                for job_id in ids:
                    js = self._count(job_id, report.rank, failed)
                    if js is not None:
                        self._finish(js)
        self._collect_deletes()

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._queued or self._flush or self._want)

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
        self._worthless.clear()
        self._flush.extend(self._jobs)
        self._stale_below = self._next_id
        self._jobs.clear()
        self._queued = []
        self._want.clear()
        self._interest.clear()
        self._no_room.clear()
        self._no_room_next.clear()
        self._origin.clear()
        for lower in self.lowers:
            if lower.reset():
                self._queue(TierOp.PURGE, lower, OffloadKey(b""))

    def usage(self) -> TierUsage:
        """Host memory's occupancy (lower tiers report through their own stats)."""
        return self.host.usage()

    def is_full(self) -> bool:
        return self.host.is_full()

    def check_integrity(self) -> None:
        """Host and lower tiers consistent; every promote in flight holds a host slot
        being written; every pinned demote is matched by a host pin; every key kept from
        write-back is in host memory."""
        self.host.check_integrity()
        for lower in self.lowers:
            lower.check_integrity()
        if any(key not in self.host for key in self._worthless):
            raise InvariantError("cascade: a key kept from write-back left host memory")
        pins: dict[OffloadKey, int] = {}
        for job_id, js in self._jobs.items():
            key = OffloadKey(js.job.key)
            if js.job.op is TierOp.PROMOTE and self.host.ref_count(key) != WRITING:
                raise InvariantError(f"cascade: promote {job_id} of a key host memory is "
                                     "not writing")
            if js.pinned:
                pins[key] = pins.get(key, 0) + 1
        for key, n in pins.items():
            ref = self.host.ref_count(key)
            if ref is None or ref < n:
                raise InvariantError(f"cascade: {n} demotes pin a key with host ref {ref}")

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Block until no lower tier has an existence check in flight. For simulators and
        tests, whose steps take no wall time: a real step outlasts a check."""
        return all(lower.wait_idle(timeout) for lower in self.lowers)

    def close(self) -> None:
        """Stop the lower tiers' threads and connections."""
        for lower in self.lowers:
            lower.close()

    # -- internals ----------------------------------------------------------------------

    def _queue(self, op: TierOp, lower: LowerTier, key: OffloadKey, slot: int = -1, *,
               snapshot: bool = False, pinned: bool = False) -> None:
        job_id = TierJobId(self._next_id)
        self._next_id += 1
        group = key_group(key) if key else 0
        job = TierJob(job_id, op, lower.name, bytes(key), group, slot, snapshot)
        self._jobs[job_id] = _Job(job, lower, pinned)
        self._queued.append(job)

    def _promote_wanted(self) -> None:
        wanted, self._want = self._want, {}
        protect = frozenset(self._interest)
        for key, lower in wanted.items():
            if key in self.host:
                continue
            result = self.host.prepare_store([key], protected=protect)
            if result is None:
                self._no_room_next.add(key)
                self.stats.promote_no_room += 1
                continue
            self._evicted(result)
            if not lower.begin_read(key):
                self.host.complete_store([key], success=False)
                continue
            self._queue(TierOp.PROMOTE, lower, key, result.slots[0])

    def _evicted(self, result: PrepareStoreResult) -> None:
        """Host memory evicted these keys: demote them to the write-back tiers."""
        for key, slot in zip(result.evicted, result.evicted_slots, strict=True):
            self._origin.pop(key, None)
            if key in self._worthless:
                self._worthless.discard(key)
                self.stats.worthless_not_demoted += 1
                continue
            for lower in self._write_back:
                if lower.begin_write(key):
                    self._queue(TierOp.DEMOTE, lower, key, slot, snapshot=True)

    def _write_through(self, keys: Sequence[OffloadKey]) -> None:
        """These keys just became readable in host memory: copy them to write-through
        tiers, pinning each host key until its demote reports."""
        for lower in self._write_thru:
            for key in keys:
                if not lower.begin_write(key):
                    continue
                (slot,) = self.host.pin([key])
                self._queue(TierOp.DEMOTE, lower, key, slot, pinned=True)

    def _collect_deletes(self) -> None:
        for lower in self.lowers:
            for key in lower.take_deletes():
                self._queue(TierOp.DELETE, lower, key)

    def _count(self, job_id: TierJobId, rank: int, failed: bool) -> _Job | None:
        return count_rank_report(self._jobs, job_id, rank, failed, next_id=self._next_id,
                                 stale_below=self._stale_below, all_ranks=self._all_ranks,
                                 counters=self.stats, what="tier job")

    def _finish(self, js: _Job) -> None:
        del self._jobs[js.job.job_id]
        job, lower, ok = js.job, js.lower, not js.failed
        key = OffloadKey(job.key)
        if job.op is TierOp.PROMOTE:
            self.host.complete_store([key], success=ok)
            lower.end_read(key, ok)
            if ok:
                _bump(self.stats.promoted, lower.name)
                self._origin[key] = lower.name
                self._write_through([key])
            else:
                _bump(self.stats.promote_failed, lower.name)
        elif job.op is TierOp.DEMOTE:
            if js.pinned:
                self.host.complete_load([key])
            lower.end_write(key, ok)
            _bump(self.stats.demoted if ok else self.stats.demote_failed, lower.name)
        else:
            _bump(self.stats.deleted, lower.name)
