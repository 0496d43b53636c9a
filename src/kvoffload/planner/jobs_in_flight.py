"""The planner's jobs in flight: one ledger, the engine blocks they use, and what the next
step plan and the next report outcome must say about them.

``JobsInFlight`` keeps rules 3 and 4 of ``docs/architecture.md`` for the planner:

* every job completes exactly once, counted over all ranks (``JobLedger``);
* the engine blocks a job uses are fenced: a store's window and Mamba blocks from its
  creation, its other blocks (and a load's) once its request ends or the load is abandoned;
  a fenced block the engine allocates again puts its jobs in the next plan's ``flush``;
* a job's keys are completed in the tier when it retires (stores ready or dropped, loads
  unpinned).

Outcomes decided without a worker (a load that cannot be issued, loads dropped by a reset,
abandoned loads never handed out) wait here for the next ``take_outcomes``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvoffload.errors import InvariantError
from kvoffload.jobs import Direction, JobId, TransferJob
from kvoffload.ledger import JobLedger
from kvoffload.metrics import PlannerStats
from kvoffload.planner.contract import LoadFailure
from kvoffload.planner.fence import Fence
from kvoffload.planner.state import JobState, RequestState
from kvoffload.tiers.base import Tier


@dataclass(frozen=True)
class EarlyOutcomes:
    """Load outcomes decided without a worker since the last ``take_outcomes``; the
    planner adds what the workers' reports say (``ReportOutcome``'s fields of the same
    names).

    Attributes:
        finished_loads: requests whose load is over (a load that could not be issued,
            had nothing to move, or was dropped by a reset).
        failed_loads: the subset of those that failed (the engine recomputes).
        released_loads: abandoned loads released (never handed out, or dropped by a
            reset).
    """

    finished_loads: tuple[str, ...] = ()
    failed_loads: tuple[LoadFailure, ...] = ()
    released_loads: tuple[JobId, ...] = ()


@dataclass(frozen=True)
class PlannedJobs:
    """What a step plan says about jobs planned before it (``take_plan``).

    Attributes:
        flush: jobs the workers must finish before anything else, in id order.
        loads: loads planned since the last plan, to submit now.
    """

    flush: tuple[JobId, ...] = ()
    loads: tuple[TransferJob, ...] = ()


class JobsInFlight:
    """The jobs of one planner (module docstring)."""

    def __init__(self, num_workers: int, tier: Tier, stats: PlannerStats) -> None:
        self.tier = tier
        self.stats = stats
        self.ledger: JobLedger[JobId, JobState] = JobLedger(JobId, num_workers, stats)
        self.fence = Fence()
        self.flush: set[JobId] = set()
        """Jobs the next plan makes the workers finish before anything else."""
        self.loads: list[TransferJob] = []
        """Loads planned since the last plan (not handed to the workers yet)."""
        self.abandoned: set[JobId] = set()
        """Loads the engine gave up on, in flight until every worker reports them."""
        self._finished: list[str] = []
        self._failed: list[LoadFailure] = []
        self._released: list[JobId] = []

    def __getitem__(self, job_id: JobId) -> JobState:
        return self.ledger[job_id]

    def __len__(self) -> int:
        return len(self.ledger)

    def issue(self, make: Callable[[JobId], JobState]) -> JobState:
        """A new job ``make(job_id)``, in flight from now on."""
        return self.ledger.issue(make)

    def allocated(self, block_ids: Sequence[int]) -> None:
        """The engine handed out ``block_ids``: jobs still using them are flushed first."""
        if block_ids:
            self.flush |= self.fence.jobs_using(block_ids)

    def fence_all(self, js: JobState) -> None:
        """Fence the rest of the job's engine blocks (its request ended, or it was
        abandoned): nothing may write them until the job retires."""
        if not js.fenced_other:
            self.fence.add(js.job_id, js.other_block_ids)
            js.fenced_other = True

    def retire(self, js: JobState) -> bool:
        """Retire a job every rank reported (or never handed out): unfence its blocks and
        complete its keys in the tier. True if it was an abandoned load."""
        self.ledger.retire(js.job_id)
        self.fence.remove(js.job_id, js.windowed_block_ids)
        if js.fenced_other:
            self.fence.remove(js.job_id, js.other_block_ids)
        if js.direction is Direction.STORE:
            self.tier.complete_store(js.keys, success=not js.failed)
        else:
            self.tier.complete_load(js.keys)
        if js.job_id in self.abandoned:
            self.abandoned.discard(js.job_id)
            return True
        return False

    def abandon(self, js: JobState) -> None:
        """The engine gave up on load ``js``: it stays in flight, all its blocks fenced,
        until every worker reports it; one never handed out is released at once."""
        self.abandoned.add(js.job_id)
        self.stats.abandoned_loads += 1
        self.fence_all(js)
        pending = [job for job in self.loads if job.job_id == js.job_id]
        if pending:  # never handed to the workers: nothing can write its blocks
            self.loads.remove(pending[0])
            self.retire(js)
            self._released.append(js.job_id)

    def load_failed_early(self, request_id: str, num_local_tokens: int) -> None:
        """A load that cannot be issued: the engine recomputes from its own prefix."""
        self._finished.append(request_id)
        self._failed.append(LoadFailure(request_id, num_local_tokens))

    def load_done_early(self, request_id: str) -> None:
        """A load with nothing to move: done without a worker."""
        self._finished.append(request_id)

    def take_outcomes(self) -> EarlyOutcomes:
        """The outcomes decided without a worker since the last call (``EarlyOutcomes``);
        each is handed out once."""
        outcomes = EarlyOutcomes(tuple(self._finished), tuple(self._failed),
                                 tuple(self._released))
        self._finished, self._failed, self._released = [], [], []
        return outcomes

    def take_plan(self, new_stores: Sequence[TransferJob]) -> PlannedJobs:
        """The jobs to flush and the loads to submit in this step's plan. A store created
        this step is never flushed: a fence hit on it is another request adopting a
        shared prefix block, which only reads it, and the store must run after the
        forward pass writes its blocks."""
        self.flush.difference_update(job.job_id for job in new_stores)
        plan = PlannedJobs(tuple(sorted(self.flush)), tuple(self.loads))
        self.flush = set()
        self.loads = []
        return plan

    def reset(self) -> None:
        """Drop every job (the tier was reset): flushed in the next plan, their reports
        stale; loads in flight fail (recompute), abandoned ones are released."""
        for js in self.ledger.values():
            if js.job_id in self.abandoned:
                self._released.append(js.job_id)
            elif js.direction is Direction.LOAD:
                self.load_failed_early(js.request_id, js.num_local_tokens)
        self.flush.update(self.ledger.reset())
        self.loads = []
        self.abandoned.clear()
        self.fence.clear()

    def has_pending_work(self) -> bool:
        """Jobs in flight, or not handed to the workers yet."""
        return bool(self.ledger or self.loads or self.flush)

    def check_integrity(self, requests: Mapping[str, RequestState]) -> None:
        """Raise ``InvariantError`` unless every job in flight is held by its live request
        (or abandoned and fenced), every request holds only jobs in flight and at most one
        load and nothing else, and the fence names only jobs in flight."""
        ledger = self.ledger
        ledger.check_integrity()
        stray_abandoned = self.abandoned - ledger.keys()
        if stray_abandoned:
            raise InvariantError(f"abandoned loads {sorted(stray_abandoned)} not in flight")
        for job_id, js in ledger.items():
            if job_id in self.abandoned:
                if not js.fenced_other:
                    raise InvariantError(f"abandoned load {job_id} not fenced")
                continue
            st = requests.get(js.request_id)
            if st is None or job_id not in st.jobs:
                raise InvariantError(f"job {job_id} has no live request holding it")
        for rid, st in requests.items():
            missing = st.jobs - ledger.keys()
            if missing:
                raise InvariantError(f"request {rid} holds unknown jobs {sorted(missing)}")
            loads = [j for j in st.jobs if ledger[j].direction is Direction.LOAD]
            if loads and len(st.jobs) != 1:
                raise InvariantError(f"request {rid} has a load and other jobs in flight")
            if st.finished and not st.jobs:
                raise InvariantError(f"finished request {rid} kept without jobs")
        stray = self.fence.all_jobs() - ledger.keys()
        if stray:
            raise InvariantError(f"fence holds finished jobs {sorted(stray)}")
