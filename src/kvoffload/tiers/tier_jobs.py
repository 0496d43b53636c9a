"""The cascade's tier jobs (``TierJobQueue``): write-back, write-through, promotes, deletes.

``CascadeTier`` decides *what* moves between host memory and the lower tiers; this queue
turns each decision into a ``TierJob``, hands the jobs out with the next step plan,
counts the workers' reports in a ``JobLedger`` and, when every rank reported a job,
applies its outcome to host memory and to the lower tier:

* ``PROMOTE`` (``promote``): the host slot was reserved by the cascade; on success the key
  becomes readable in host memory (and is remembered as promoted from that lower tier,
  ``take_origin``) and is written through; on failure the slot is freed and the lower
  tier drops the key.
* ``DEMOTE``: write-back of host victims (``write_back``, a snapshot of the slot) and
  write-through of keys that became readable (``write_through``, the host key pinned
  until the job reports).
* ``DELETE`` / ``PURGE``: deletions the lower tiers decide (``collect_deletes``) and the
  purge of a tier that forgets everything on ``reset``.

Exact-once accounting follows ``kvoffload.ledger``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TypeVar

from kvoffload.errors import InvariantError
from kvoffload.jobs import TierJob, TierJobId, TierOp, TierWork, WorkerReport
from kvoffload.keys import OffloadKey, key_group
from kvoffload.ledger import JobLedger
from kvoffload.tiers.base import HOST, PrepareStoreResult
from kvoffload.tiers.config import WriteMode
from kvoffload.tiers.eviction import WRITING
from kvoffload.tiers.host import HostTier
from kvoffload.tiers.lower import LowerTier


@dataclass
class CascadeStats:
    """Cumulative counters of a cascade (plain data; ``reset`` keeps them).

    Attributes:
        loaded_blocks: blocks handed to the engine by ``prepare_load``, by the tier each
            was in when a request asked for it ("host", or the lower tier it was promoted
            from for that request). Their shares are the tiers' hit shares.
        loaded_group_blocks: the same, by (tier, group index).
        promoted / promote_failed: promotes that completed, by source tier.
        promote_no_room: promotes of wanted keys host memory had no slot for.
        promote_no_room_miss: of them, the keys whose lookup then answered MISS (nothing
            in host memory would free, or they waited ``room_wait_s``), by the tier that
            held them: their requests recomputed what those keys held.
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
    promote_no_room_miss: dict[str, int] = field(default_factory=dict)
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


_Name = TypeVar("_Name")


def bump(table: dict[_Name, int], name: _Name, n: int = 1) -> None:
    """``table[name] += n``, from 0."""
    table[name] = table.get(name, 0) + n


@dataclass(slots=True)
class _Job:
    job: TierJob
    lower: LowerTier
    pinned: bool = False
    reported_ranks: int = 0
    failed: bool = False


class TierJobQueue:
    """Tier jobs of one cascade: queued, handed out, counted, finished (module docstring).

    Pins: a write-through ``DEMOTE`` pins its host key (``HostTier.pin``) until the job
    reports; a ``PROMOTE`` holds a host slot being written until it reports.
    """

    def __init__(self, host: HostTier, lowers: Sequence[LowerTier], stats: CascadeStats) -> None:
        self.host = host
        self.lowers = tuple(lowers)
        self.stats = stats
        self._by_name = {lt.name: lt for lt in self.lowers}
        self._write_back = tuple(lt for lt in self.lowers
                                 if lt.write_mode is WriteMode.WRITE_BACK)
        self._write_thru = tuple(lt for lt in self.lowers
                                 if lt.write_mode is WriteMode.WRITE_THROUGH)
        self.writes_through = bool(self._write_thru)
        """Some lower tier is write-through (``write_through`` has work)."""
        self._ledger: JobLedger[TierJobId, _Job] = JobLedger(
            TierJobId, host.config.num_workers, stats, what="tier job")
        self._queued: list[TierJob] = []
        self._flush: list[TierJobId] = []
        self._origin: dict[OffloadKey, str] = {}

    def __len__(self) -> int:
        """Tier jobs handed out or queued and not yet reported by every rank."""
        return len(self._ledger)

    @property
    def has_pending(self) -> bool:
        """Jobs in flight or queued, or ids still to flush."""
        return bool(self._ledger or self._queued or self._flush)

    def take_origin(self, key: OffloadKey) -> str:
        """The tier ``key`` was promoted from since it was last loaded (forgotten now), or
        ``"host"``."""
        return self._origin.pop(key, HOST)

    # -- new jobs -----------------------------------------------------------------------

    def queue(self, op: TierOp, lower: LowerTier, key: OffloadKey, slot: int = -1, *,
              snapshot: bool = False, pinned: bool = False) -> None:
        """Issue a job; it goes out with the next ``take_work``."""
        group = key_group(key) if key else 0
        js = self._ledger.issue(lambda job_id: _Job(
            TierJob(job_id, op, lower.name, bytes(key), group, slot, snapshot), lower, pinned))
        self._queued.append(js.job)

    def promote(self, wanted: Mapping[OffloadKey, LowerTier],
                protect: AbstractSet[OffloadKey]) -> tuple[list[OffloadKey], int]:
        """Give every wanted key host memory lacks a host slot (``prepare_store``, evicting
        idle keys but none in ``protect``; the victims are written back) and queue a
        ``PROMOTE`` from its lower tier into it. Returns the keys host memory had no room
        for (counted in ``stats.promote_no_room``) and how many promotes were queued. A
        key its lower tier can no longer read gets its slot back."""
        no_room: list[OffloadKey] = []
        queued = 0
        for key, lower in wanted.items():
            if key in self.host:
                continue
            result = self.host.prepare_store([key], protected=protect)
            if result is None:
                no_room.append(key)
                self.stats.promote_no_room += 1
                continue
            self.write_back(result)
            if not lower.begin_read(key):
                self.host.complete_store([key], success=False)
                continue
            self.queue(TierOp.PROMOTE, lower, key, result.slots[0])
            queued += 1
        return no_room, queued

    def write_back(self, result: PrepareStoreResult) -> None:
        """Host memory evicted ``result.evicted``: demote them to the write-back tiers, but
        not the keys under a demotion hint (``result.evicted_demoted``)."""
        worthless = frozenset(result.evicted_demoted)
        for key, slot in zip(result.evicted, result.evicted_slots, strict=True):
            self._origin.pop(key, None)
            if worthless and key in worthless:
                self.stats.worthless_not_demoted += 1
                continue
            for lower in self._write_back:
                if lower.begin_write(key):
                    self.queue(TierOp.DEMOTE, lower, key, slot, snapshot=True)

    def write_through(self, keys: Sequence[OffloadKey]) -> None:
        """These keys just became readable in host memory: copy them to write-through
        tiers, pinning each host key until its demote reports."""
        for lower in self._write_thru:
            for key in keys:
                if not lower.begin_write(key):
                    continue
                (slot,) = self.host.pin([key])
                self.queue(TierOp.DEMOTE, lower, key, slot, pinned=True)

    def collect_deletes(self) -> None:
        """Queue a ``DELETE`` for every deletion a lower tier decided."""
        for lower in self.lowers:
            for key in lower.take_deletes():
                self.queue(TierOp.DELETE, lower, key)

    # -- hand out, count, finish --------------------------------------------------------

    def take_work(self) -> TierWork:
        """The queued jobs and the ids the workers must flush first; both emptied."""
        flush, self._flush = tuple(self._flush), []
        jobs, self._queued = tuple(self._queued), []
        return TierWork(flush=flush, jobs=jobs)

    def count_reports(self, reports: Sequence[WorkerReport]) -> None:
        """Count tier-job reports per rank; finish the jobs every rank reported."""
        for report in reports:
            self._ledger.check_rank(report.rank)
            for name in report.tier_unreachable:
                lower = self._by_name.get(name)
                if lower is not None:
                    lower.mark_unreachable()
            for failed, ids in ((False, report.tier_finished), (True, report.tier_failed)):
                for job_id in ids:
                    js = self._ledger.count(job_id, report.rank, failed)
                    if js is not None:
                        self._finish(js)

    def reset(self) -> None:
        """Drop every job in flight (the next ``take_work`` flushes them; their reports are
        ignored) and what was promoted; lower tiers forget their in-flight work, and a
        tier that must be purged gets a ``PURGE``."""
        self._flush.extend(self._ledger.reset())
        self._queued = []
        self._origin.clear()
        for lower in self.lowers:
            if lower.reset():
                self.queue(TierOp.PURGE, lower, OffloadKey(b""))

    def check_integrity(self) -> None:
        """Every promote in flight holds a host slot being written; every pinned demote is
        matched by a host pin."""
        self._ledger.check_integrity()
        pins: dict[OffloadKey, int] = {}
        for job_id, js in self._ledger.items():
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

    def _finish(self, js: _Job) -> None:
        self._ledger.retire(js.job.job_id)
        job, lower, ok = js.job, js.lower, not js.failed
        key = OffloadKey(job.key)
        if job.op is TierOp.PROMOTE:
            self.host.complete_store([key], success=ok)
            lower.end_read(key, ok)
            if ok:
                bump(self.stats.promoted, lower.name)
                self._origin[key] = lower.name
                self.write_through([key])
            else:
                bump(self.stats.promote_failed, lower.name)
        elif job.op is TierOp.DEMOTE:
            if js.pinned:
                self.host.complete_load([key])
            lower.end_write(key, ok)
            bump(self.stats.demoted if ok else self.stats.demote_failed, lower.name)
        else:
            bump(self.stats.deleted, lower.name)
