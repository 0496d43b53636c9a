"""How the reference engine hands the planner's plans to workers.

It mirrors ``TransferWorker``'s step API. ``StepPlan`` stores read blocks that the step's
own forward pass writes (the planner plans them from ``num_computed_tokens +
num_scheduled_tokens``), while flushes must finish and loads must start before it:

1. ``begin_step(plan)``: wait for the plan's flushes, submit its loads, keep its stores;
2. the forward pass writes the scheduled tokens' KV;
3. ``end_step()``: submit the kept stores.

``poll`` returns what the workers finished; the engine holds each report back until the
modelled clock reaches the job's completion time (``timing.TransferClock``).

Two executors: ``AccountingExecutor`` here (no tensors: every job completes at once, for
long traces) and ``refengine.device.WorkerExecutor`` (the real ``TransferWorker`` on real
tensors, with every loaded byte verified).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvoffload.jobs import (
    JobId,
    StepPlan,
    TierJobId,
    TransferJob,
    TransferStats,
    WorkerReport,
)


class TransferExecutor(Protocol):
    """The worker side as the engine drives it (see the module docstring)."""

    def begin_step(self, plan: StepPlan) -> None:
        """Wait for ``plan.flush``, submit ``plan.loads``, keep ``plan.stores``."""

    def end_step(self) -> None:
        """Submit the stores ``begin_step`` kept (their blocks now hold this step's KV)."""

    def poll(self) -> list[WorkerReport]:
        """One report per rank with the jobs finished since the last poll (maybe empty)."""

    def shutdown(self) -> None:
        """Release threads and memory; no call follows."""


@runtime_checkable
class HoldsReports(Protocol):
    """An executor that may hold reports back in modelled time (``kvoffload.faults``).

    The engine asks it when a held job reports (a flush of that job waits until then),
    and keeps running while anything is held, so a run never ends with a job in flight.
    """

    def held_until(self, job_id: JobId) -> float:
        """Modelled time at which ``job_id``'s last held report is released; 0 if none."""

    def next_release(self) -> float | None:
        """The earliest release time of a held report, or None when nothing is held."""


JobFilter = Callable[[TransferJob], bool]


class AccountingExecutor:
    """Moves nothing: every submitted job is finished (or failed) at the next ``poll``.

    ``fail`` selects transfer jobs to report as failed (tests of the recompute path).
    Tier jobs (promotes and demotes of a tier cascade) are all reported finished. With
    ``num_workers`` ranks, every rank reports every job.
    """

    def __init__(self, num_workers: int = 1, fail: JobFilter | None = None) -> None:
        self.num_workers = num_workers
        self.fail = fail
        self._finished: list[JobId] = []
        self._failed: list[JobId] = []
        self._stores: tuple[TransferJob, ...] = ()
        self._tier: list[TierJobId] = []

    def begin_step(self, plan: StepPlan) -> None:
        self._tier.extend(j.job_id for j in plan.tier_jobs)
        self._take(plan.loads)
        self._stores = plan.stores

    def end_step(self) -> None:
        stores, self._stores = self._stores, ()
        self._take(stores)

    def _take(self, jobs: Sequence[TransferJob]) -> None:
        for job in jobs:
            if self.fail is not None and self.fail(job):
                self._failed.append(job.job_id)
            else:
                self._finished.append(job.job_id)

    def poll(self) -> list[WorkerReport]:
        if not self._finished and not self._failed and not self._tier:
            return []
        finished, failed, tier = tuple(self._finished), tuple(self._failed), tuple(self._tier)
        self._finished, self._failed, self._tier = [], [], []
        return [WorkerReport(rank, finished, failed, TransferStats(), tier_finished=tier)
                for rank in range(self.num_workers)]

    def shutdown(self) -> None:
        self._finished, self._failed, self._tier = [], [], []
