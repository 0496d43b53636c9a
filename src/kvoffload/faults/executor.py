"""``FaultyExecutor``: faults injected between the engine and its workers, in modelled time.

It wraps any ``TransferExecutor`` (the accounting executor, or the real worker on real
tensors) and, per the ``FaultPlan``, changes *when* a job reaches the workers and *how*
its reports come back:

* ``hang`` and ``late`` jobs are withheld from the wrapped executor and submitted later
  (``hang_s`` later, or when a plan flushes them): the copy itself happens late, as a stuck
  DMA would, so with real tensors a block reused too early would be overwritten and the
  byte checks would see it;
* ``fail`` jobs run, then report failed, after ``garble`` (if given) wrote garbage into
  their destination: nothing of a failed transfer may be used;
* ``duplicate``, ``reorder`` and ``partial`` only change the reports: a second report one
  poll later, a report held ``reorder_s``, ranks other than 0 reporting ``hang_s`` late.

With ``mirror_ranks > 1`` the wrapped executor is a single rank and its reports stand for
every rank (as if each rank moved its own shard identically); ``partial`` faults need it,
or a wrapped executor that reports several ranks.

``choose`` (tests) picks the fault of each job instead of the plan's schedule.

Time comes from ``clock`` (the engine's modelled clock; set it after building the engine).
``held_until`` and ``next_release`` let the engine wait for withheld jobs
(``refengine.executors.HoldsReports``). ``reset_requested`` asks the driver to reset the cache
while a ``late`` job is in flight; the driver calls ``note_reset`` afterwards.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import replace

from kvoffload.faults.plan import FaultKind, FaultLog, FaultPlan
from kvoffload.jobs import (
    Direction,
    JobId,
    StepPlan,
    TierJobId,
    TransferJob,
    TransferStats,
    WorkerReport,
)
from kvoffload.refengine.executors import TransferExecutor

Chooser = Callable[[TransferJob], FaultKind | None]
"""Picks a job's fault (or None) instead of the plan's random schedule."""

Garble = Callable[[TransferJob], None]
"""Writes garbage where a failed job was to write (engine blocks of a load, slots of a
store)."""

_Entry = tuple[JobId, int, bool]  # (job, rank, failed)


class FaultyExecutor:
    """See the module docstring."""

    def __init__(self, inner: TransferExecutor, plan: FaultPlan, *, mirror_ranks: int = 1,
                 garble: Garble | None = None, choose: Chooser | None = None) -> None:
        if mirror_ranks < 1:
            raise ValueError(f"mirror_ranks must be >= 1, got {mirror_ranks}")
        self.inner = inner
        self.plan = plan
        self.mirror_ranks = mirror_ranks
        self.garble = garble
        self.choose = choose
        self.clock: Callable[[], float] = lambda: 0.0
        self.log = FaultLog()
        self.reset_requested = False
        self._schedule = plan.schedule()
        self._kind: dict[JobId, FaultKind] = {}
        self._failing: dict[JobId, TransferJob] = {}
        self._withheld: dict[JobId, tuple[float, TransferJob]] = {}
        self._held: list[tuple[float, int, _Entry]] = []
        self._until: dict[JobId, float] = {}
        self._seq = itertools.count()
        self._last_reset = -math.inf
        self._ranks_seen = 1

    # ------------------------------------------------------------------ steps

    def begin_step(self, plan: StepPlan) -> None:
        now = self.clock()
        withheld: set[JobId] = set()
        for job in (*plan.loads, *plan.stores):
            kind = self.choose(job) if self.choose is not None else self._decide(now)
            self.log.jobs += 1
            if kind is None:
                continue
            self.log.add(kind, job.direction.value)
            self._kind[job.job_id] = kind
            if kind is FaultKind.FAIL:
                self._failing[job.job_id] = job
            elif kind in (FaultKind.HANG, FaultKind.LATE):
                # A late job lands when the reset's flush waits for it (no extra
                # modelled delay); without a reset it behaves as a hang.
                release = now + self.plan.hang_s
                self._withheld[job.job_id] = (release, job)
                withheld.add(job.job_id)
                if kind is FaultKind.LATE:
                    self.reset_requested = True
                else:
                    self._until[job.job_id] = release
        flush = set(plan.flush)
        due = [job for at, job in self._withheld.values() if at <= now or job.job_id in flush]
        for job in due:
            del self._withheld[job.job_id]
        late_stores = tuple(j for j in due if j.direction is Direction.STORE)
        late_loads = tuple(j for j in due if j.direction is Direction.LOAD)
        if late_loads:
            # The stuck copies land now; the plan below waits for them (its flush) before
            # anything else of the step, as a flush waits for a stuck transfer.
            self.inner.begin_step(StepPlan(loads=late_loads))
            self.inner.end_step()
        late = {j.job_id for j in due}
        self.inner.begin_step(replace(
            plan, flush=tuple(sorted(flush | late)),
            stores=late_stores + tuple(j for j in plan.stores if j.job_id not in withheld),
            loads=tuple(j for j in plan.loads if j.job_id not in withheld)))

    def _decide(self, now: float) -> FaultKind | None:
        allowed = set(FaultKind)
        if max(self.mirror_ranks, self._ranks_seen) < 2:
            allowed.discard(FaultKind.PARTIAL)
        if self.reset_requested or now - self._last_reset < self.plan.min_reset_interval_s:
            allowed.discard(FaultKind.LATE)
        return self._schedule.decide(allowed=tuple(allowed))

    def end_step(self) -> None:
        self.inner.end_step()

    def note_reset(self) -> None:
        """The driver reset the cache (``ReferenceEngine.reset_cache``) as requested."""
        self.reset_requested = False
        self._last_reset = self.clock()
        self.log.resets += 1

    # ---------------------------------------------------------------- reports

    def poll(self) -> list[WorkerReport]:
        now = self.clock()
        out: list[_Entry] = []
        while self._held and self._held[0][0] <= now:
            out.append(heapq.heappop(self._held)[2])
        stats = TransferStats()
        tier_ok: dict[int, tuple[TierJobId, ...]] = {}
        tier_bad: dict[int, tuple[TierJobId, ...]] = {}
        for report in self.inner.poll():
            ranks = range(self.mirror_ranks) if self.mirror_ranks > 1 else (report.rank,)
            self._ranks_seen = max(self._ranks_seen, report.rank + 1)
            if report.rank == 0:
                stats = report.stats
            for rank in ranks:
                tier_ok[rank] = tier_ok.get(rank, ()) + report.tier_finished
                tier_bad[rank] = tier_bad.get(rank, ()) + report.tier_failed
                for failed, ids in ((False, report.finished), (True, report.failed)):
                    for job_id in ids:
                        self._entry(job_id, rank, failed, now, out)
        if not out and not tier_ok:
            return []
        ranks_out = sorted({r for _, r, _ in out} | tier_ok.keys())
        return [WorkerReport(
            rank,
            finished=tuple(j for j, r, f in out if r == rank and not f),
            failed=tuple(j for j, r, f in out if r == rank and f),
            stats=stats if rank == 0 else TransferStats(),
            tier_finished=tier_ok.get(rank, ()), tier_failed=tier_bad.get(rank, ()))
            for rank in ranks_out]

    def _entry(self, job_id: JobId, rank: int, failed: bool, now: float,
               out: list[_Entry]) -> None:
        kind = self._kind.get(job_id)
        if kind is FaultKind.FAIL:
            job = self._failing.pop(job_id, None)
            if job is not None and self.garble is not None:
                self.garble(job)
            out.append((job_id, rank, True))
        elif kind is FaultKind.DUPLICATE:
            out.append((job_id, rank, failed))
            self._hold(now, (job_id, rank, failed))  # again, at the next poll
        elif kind is FaultKind.REORDER:
            self._hold(now + self.plan.reorder_s, (job_id, rank, failed))
        elif kind is FaultKind.PARTIAL and rank != 0:
            self._hold(now + self.plan.hang_s, (job_id, rank, failed))
        else:
            out.append((job_id, rank, failed))

    def _hold(self, release: float, entry: _Entry) -> None:
        heapq.heappush(self._held, (release, next(self._seq), entry))
        self._until[entry[0]] = max(self._until.get(entry[0], 0.0), release)

    # ------------------------------------------------------- HoldsReports

    def held_until(self, job_id: JobId) -> float:
        return self._until.get(job_id, 0.0)

    def next_release(self) -> float | None:
        times = [at for at, _ in self._withheld.values()]
        if self._held:
            times.append(self._held[0][0])
        return min(times, default=None)

    @property
    def num_held(self) -> int:
        """Jobs withheld from the workers plus reports held back, now."""
        return len(self._withheld) + len(self._held)

    def shutdown(self) -> None:
        self.inner.shutdown()
