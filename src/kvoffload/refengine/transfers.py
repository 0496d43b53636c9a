"""Transfers in flight, as the reference engine tracks them.

``TransferTracker`` knows every job the engine handed the worker and what the engine still
waits for from it:

* **Submitted jobs.** Each transfer job (``submitted``) and tier job (``tier_submitted``)
  gets a modelled completion time on its link (``timing.TransferClock``: the host link for
  transfers, the lower tiers' bandwidth for promotes and demotes).
* **Flushes.** ``step_start`` is when a step can start: after every job its plan flushes
  (a job whose report the executor holds counts until then, ``done_at``).
* **Delivery.** ``deliver`` polls the executor, keeps each report until its job's
  modelled completion time has passed, accounts due transfers in the per-group traffic
  (``EngineMetrics.traffic``), and hands the due reports to
  ``Planner.update_from_worker_reports``; the engine acts on the outcome's finished loads.
* **Loads requests wait for.** ``loading`` maps each request waiting for its load to the
  request; ``since`` each request on the offload path (deferred by "ask again later", or
  loading) to when its wait started, which fixes its deadline
  (``EngineConfig.load_deadline_s``).
* **Late loads.** ``give_up_late_loads`` abandons loads past the deadline
  (``Planner.abandon_load``). A transfer cannot be cancelled, so the blocks a late load
  still writes stay *parked* under an owner of their own in the pool until
  ``released_loads`` names the job; ``deliver`` frees them then.
* **Fences.** ``used_by_overdue_job`` is the pool's ``avoid`` rule: a block a job still
  uses after its modelled completion is handed out last.

Times are modelled seconds; "now" is the engine's clock, read live (``context.Clocked``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvoffload.jobs import (
    Direction,
    JobId,
    StepPlan,
    TierJob,
    TierJobId,
    TierOp,
    TransferJob,
    WorkerReport,
)
from kvoffload.planner.contract import ReportOutcome
from kvoffload.refengine.context import EngineContext
from kvoffload.refengine.executors import HoldsReports, TransferExecutor
from kvoffload.refengine.requests import EngineRequest
from kvoffload.refengine.timing import TimingModel, TransferClock


@dataclass
class _Job:
    direction: Direction
    request_id: str
    blocks: tuple[tuple[int, int], ...]  # (group, engine blocks)


_Id = TypeVar("_Id", JobId, TierJobId)


def _split_due(entries: list[tuple[_Id, int, bool]], transfers: TransferClock, now: float,
               on_rank0: Callable[[_Id, bool], None],
               ) -> tuple[dict[int, tuple[list[_Id], list[_Id]]], list[tuple[_Id, int, bool]]]:
    """Split ``(job, rank, failed)`` reports into those due by ``now``, as rank -> (ok,
    failed), and those still in flight; ``on_rank0`` sees each due report of rank 0."""
    due: dict[int, tuple[list[_Id], list[_Id]]] = {}
    later: list[tuple[_Id, int, bool]] = []
    for job_id, rank, failed in entries:
        if transfers.done_at(job_id) > now:
            later.append((job_id, rank, failed))
            continue
        ok, bad = due.setdefault(rank, ([], []))
        (bad if failed else ok).append(job_id)
        if rank == 0:
            on_rank0(job_id, failed)
    return due, later


class TransferTracker:
    """Jobs in flight, their reports, and the loads requests wait for (module docstring).

    Args:
        clock: the engine, whose ``clock`` is now.
        timing: the modelled link.
        executor: the worker side, polled for reports.
        planner: the planner the reports go to; None without offloading.
        pool: the engine's block pool (parked blocks live there).
        metrics: where traffic, stalls and give-ups are counted.
        real_block_bytes: real bytes of one engine block, per group.
        real_offloaded_bytes: real bytes of one offloaded block, per group.
        load_deadline_s: ``EngineConfig.load_deadline_s``.
    """

    def __init__(self, context: EngineContext, timing: TimingModel, *,
                 executor: TransferExecutor) -> None:
        self._clock = context.clock
        self._executor = executor
        self._planner = context.planner
        self._pool = context.pool
        self._metrics = context.metrics
        self._real_block_bytes = context.block_bytes.real
        self._real_offloaded_bytes = context.block_bytes.real_offloaded
        self._deadline = context.config.load_deadline_s
        self.transfers = TransferClock(timing)
        """Modelled time of transfer jobs on the host link."""
        self.tier_transfers = TransferClock(timing, timing.lower_bytes_per_s)
        """Modelled time of tier jobs (promotes read, demotes write a lower tier)."""
        self.loading: dict[str, EngineRequest] = {}
        """Requests waiting for their load, by id."""
        self.since: dict[str, float] = {}
        """When each request went onto the offload path (deferred, or loading: for a
        request in ``loading``, when its load started)."""
        self._jobs: dict[JobId, _Job] = {}
        self._load_jobs: dict[str, TransferJob] = {}
        self._reports: list[tuple[JobId, int, bool]] = []
        self._tier_reports: list[tuple[TierJobId, int, bool]] = []
        self._holder = executor if isinstance(executor, HoldsReports) else None
        self._parked: dict[JobId, str] = {}
        """Abandoned load -> the pool owner holding its request's blocks until it reports."""

    # ------------------------------------------------------------------ queries

    @property
    def num_parked(self) -> int:
        """Abandoned loads whose blocks are still parked (their job has not reported)."""
        return len(self._parked)

    def has_pending(self) -> bool:
        """Whether a job, a report or a parked load is still outstanding."""
        return (bool(self._jobs or self._tier_reports or len(self.tier_transfers)
                     or self._parked)
                or (self._holder is not None and self._holder.next_release() is not None)
                or (self._planner is not None and self._planner.has_pending_work()))

    def next_completion(self, retry: float | None) -> float | None:
        """The next time something completes: a job, a held report's release, a load's
        deadline, or ``retry`` (a deferred lookup asked again)."""
        times = [t for t in (self.transfers.next_completion(),
                             self.tier_transfers.next_completion(), retry,
                             self._holder.next_release() if self._holder else None,
                             self._next_deadline()) if t is not None]
        # A job held past its modelled completion leaves a time in the past: look beyond.
        future = [t for t in times if t > self._clock.clock]
        return min(future, default=min(times, default=None))

    def _next_deadline(self) -> float | None:
        deadline = self._deadline
        if deadline is None or not self.loading:
            return None
        return min(self.since[rid] for rid in self.loading) + deadline

    def done_at(self, job_id: JobId) -> float:
        """When ``job_id`` reports: its modelled transfer, or later if its report is held."""
        done = self.transfers.done_at(job_id)
        if self._holder is not None:
            done = max(done, self._holder.held_until(job_id))
        return done

    def used_by_overdue_job(self, block: int) -> bool:
        """Whether a job that should have reported by now still uses ``block``: reusing
        it would make the next plan flush that job, stalling the step behind it."""
        assert self._planner is not None
        clock = self._clock.clock
        return any(self.transfers.done_at(j) < clock
                   for j in self._planner.jobs_fencing((block,)))

    # ------------------------------------------------------------ offload path

    def may_defer(self, rid: str) -> bool:
        """A lookup of ``rid`` answered "ask again later": whether it may wait (its wait
        starts now if it was not waiting); False once it waited past the deadline."""
        now = self._clock.clock
        since = self.since.setdefault(rid, now)
        return self._deadline is None or now - since < self._deadline

    def off_offload_path(self, rid: str) -> None:
        """``rid`` no longer waits for the offload path; its wait counts towards
        ``EngineMetrics.max_offload_wait_s``."""
        since = self.since.pop(rid, None)
        if since is not None:
            self._metrics.max_offload_wait_s = max(self._metrics.max_offload_wait_s,
                                                   self._clock.clock - since)

    def start_load(self, req: EngineRequest) -> None:
        """``req`` waits for its load from now."""
        rid = req.request_id
        self.loading[rid] = req
        self.since[rid] = self._clock.clock  # the load's own wait starts

    def load_finished(self, rid: str) -> tuple[EngineRequest, TransferJob | None] | None:
        """The load of ``rid`` reported: the request and its load job (None if no job
        was seen), or None if ``rid`` no longer waits for a load."""
        req = self.loading.pop(rid, None)
        if req is None:
            return None
        self.off_offload_path(rid)
        return req, self._load_jobs.pop(rid, None)

    def give_up_late_loads(self) -> list[EngineRequest]:
        """Abandon loads older than the deadline; return their requests, in order, to be
        queued again to recompute (their blocks freed, or parked until the job reports)."""
        deadline = self._deadline
        if deadline is None or self._planner is None:
            return []
        clock = self._clock.clock
        late = [rid for rid in self.loading if clock - self.since[rid] >= deadline]
        out = []
        for rid in late:
            req = self.loading.pop(rid)
            self._load_jobs.pop(rid, None)
            self.off_offload_path(rid)
            job_id = self._planner.abandon_load(req)  # offers it no load again
            req.record.failed_loads += 1
            self._metrics.abandoned_loads += 1
            if job_id is None:
                self._pool.free(rid)
            else:
                self._park(rid, job_id)
            out.append(req)
        return out

    def _park(self, rid: str, job_id: JobId) -> None:
        pool = self._pool
        owner = f"{rid}\x00parked-load-{job_id}"
        pool.rename(rid, owner)
        self._parked[job_id] = owner
        parked = sum(len(t) for o in self._parked.values() for t in pool.block_table(o))
        self._metrics.parked_blocks_peak = max(self._metrics.parked_blocks_peak, parked)

    # ---------------------------------------------------------------- jobs

    def step_start(self, plan: StepPlan, start: float) -> float:
        """When a step planned at ``start`` can run: after the jobs its plan flushes."""
        if plan.tier_flush:
            start = max(start, *(self.tier_transfers.done_at(j) for j in plan.tier_flush))
        if plan.flush:
            stores = {j.job_id for j in plan.stores}
            # A store planned this step reads blocks this step's forward pass writes; a
            # flush makes the worker run it before that pass (a planner bug: counted, and
            # in bytes mode the verification shows what it stored).
            self._metrics.same_step_flushes += len(stores.intersection(plan.flush))
            done = max(self.done_at(j) for j in plan.flush)
            if done > start:
                self._metrics.flush_stall_s += done - start
                start = done
        return start

    def submitted(self, job: TransferJob, now: float) -> None:
        """The worker took ``job`` at ``now``."""
        blocks = tuple((t.group, len(t.block_ids)) for t in job.groups)
        nbytes = sum(n * self._real_block_bytes[g] for g, n in blocks)
        self._jobs[job.job_id] = _Job(job.direction, job.request_id, blocks)
        self.transfers.submit(job.job_id, job.direction, nbytes, now)
        if job.direction is Direction.LOAD:
            self._load_jobs[job.request_id] = job

    def tier_submitted(self, job: TierJob, now: float) -> None:
        """The worker took tier job ``job`` at ``now``."""
        moves = job.op in (TierOp.PROMOTE, TierOp.DEMOTE)
        nbytes = self._real_offloaded_bytes[job.group] if moves else 0
        direction = Direction.LOAD if job.op is TierOp.PROMOTE else Direction.STORE
        self.tier_transfers.submit(job.job_id, direction, nbytes, now)

    def deliver(self) -> tuple[bool, ReportOutcome | None]:
        """Hand the planner every report whose modelled completion time has passed.

        Returns whether anything was delivered, and the planner's outcome (None without a
        planner); the blocks of parked loads the outcome releases are freed already.
        """
        metrics = self._metrics
        for report in self._executor.poll():
            self._reports.extend((j, report.rank, False) for j in report.finished)
            self._reports.extend((j, report.rank, True) for j in report.failed)
            self._tier_reports.extend((j, report.rank, False) for j in report.tier_finished)
            self._tier_reports.extend((j, report.rank, True) for j in report.tier_failed)
            s = report.stats
            metrics.moved_stored_bytes += s.stored_bytes
            metrics.moved_loaded_bytes += s.loaded_bytes
            metrics.measured_store_s += s.store_seconds
            metrics.measured_load_s += s.load_seconds
        now = self._clock.clock
        due, self._reports = _split_due(self._reports, self.transfers, now, self._account)
        tier_due, self._tier_reports = _split_due(
            self._tier_reports, self.tier_transfers, now,
            lambda tier_id, _failed: self.tier_transfers.forget(tier_id))
        if self._planner is None:
            return bool(due), None
        reports = []
        for rank in sorted(due.keys() | tier_due.keys()):
            ok, bad = due.get(rank, ([], []))
            ok_t, bad_t = tier_due.get(rank, ([], []))
            reports.append(WorkerReport(rank, tuple(ok), tuple(bad), tier_finished=tuple(ok_t),
                                        tier_failed=tuple(bad_t)))
        outcome = self._planner.update_from_worker_reports(reports)
        for job_id in outcome.released_loads:
            owner = self._parked.pop(job_id, None)
            if owner is not None:
                self._pool.free(owner)
        return bool(due or tier_due or outcome.finished_loads), outcome

    def _account(self, job_id: JobId, failed: bool) -> None:
        job = self._jobs.pop(job_id, None)
        self.transfers.forget(job_id)
        if job is None:
            return  # a second report of the job: the planner counts (or rejects) it
        for g, n in job.blocks:
            traffic = self._metrics.traffic[g]
            if failed:
                traffic.failed_jobs += 1
            elif job.direction is Direction.STORE:
                traffic.stored_blocks += n
                traffic.stored_bytes += n * self._real_block_bytes[g]
            else:
                traffic.loaded_blocks += n
                traffic.loaded_bytes += n * self._real_block_bytes[g]
