"""``FaultyBackend``: faults inside one rank's copy backend (``TransferBackend``).

It wraps a real backend and, per the ``FaultPlan`` (kinds ``fail``, ``hang``,
``duplicate`` and ``reorder``; others are not drawn here):

* ``fail``: the copy runs, then garbage is written where it wrote (the engine blocks of a
  load, the host slots of a store) and the job is reported failed;
* ``hang``: the job is not handed to the wrapped backend: it is stuck until ``release_hung``
  (the stall ends) or until a ``wait`` names it (a flush waits for a stuck copy, which then
  lands at the latest possible moment);
* ``duplicate``: the job is reported again by the next ``poll`` (a backend bug the worker
  must detect: ``TransferWorker.backend_errors``);
* ``reorder``: the job's report is held back one ``poll``, behind later jobs.

``choose`` (tests) picks each job's fault instead of the plan's schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvoffload.faults.plan import FaultKind, FaultLog, FaultPlan
from kvoffload.jobs import Direction, JobId, TransferJob, TransferStats
from kvoffload.worker.backend import TransferBackend
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import CacheLayout

BACKEND_KINDS = (FaultKind.FAIL, FaultKind.HANG, FaultKind.DUPLICATE, FaultKind.REORDER)


class FaultyBackend(TransferBackend):
    """See the module docstring."""

    def __init__(self, inner: TransferBackend, plan: FaultPlan, *,
                 choose: Callable[[TransferJob], FaultKind | None] | None = None) -> None:
        self.inner = inner
        self.choose = choose
        self.plan = plan
        self.log = FaultLog()
        self._schedule = plan.schedule()
        self._layout: CacheLayout | None = None
        self._pool: HostPool | None = None
        self._kind: dict[JobId, FaultKind] = {}
        self._failing: dict[JobId, TransferJob] = {}
        self._hung: dict[JobId, TransferJob] = {}
        self._again: list[tuple[JobId, bool]] = []
        self._held: list[tuple[JobId, bool]] = []

    @property
    def hung(self) -> set[JobId]:
        """Jobs stuck now (not yet handed to the wrapped backend)."""
        return set(self._hung)

    def bind(self, layout: CacheLayout, pool: HostPool) -> None:
        self.inner.bind(layout, pool)
        self._layout, self._pool = layout, pool

    def submit(self, job: TransferJob) -> None:
        kind = (self.choose(job) if self.choose is not None
                else self._schedule.decide(allowed=BACKEND_KINDS))
        self.log.jobs += 1
        if kind is None:
            self.inner.submit(job)
            return
        self.log.add(kind, job.direction.value)
        self._kind[job.job_id] = kind
        if kind is FaultKind.HANG:
            self._hung[job.job_id] = job
            return
        if kind is FaultKind.FAIL:
            self._failing[job.job_id] = job
        self.inner.submit(job)

    def release_hung(self) -> None:
        """The stall ends: every stuck job is handed to the wrapped backend now."""
        for job in list(self._hung.values()):
            del self._hung[job.job_id]
            self.inner.submit(job)

    def poll(self) -> tuple[list[JobId], list[JobId]]:
        finished: list[JobId] = []
        failed: list[JobId] = []
        for job_id, bad in (*self._held, *self._again):
            (failed if bad else finished).append(job_id)
        self._held, self._again = [], []
        done, broken = self.inner.poll()
        for bad, ids in ((False, done), (True, broken)):
            for job_id in ids:
                kind = self._kind.pop(job_id, None)
                if kind is FaultKind.FAIL:
                    self._garble(self._failing.pop(job_id))
                    failed.append(job_id)
                elif kind is FaultKind.REORDER:
                    self._held.append((job_id, bad))
                else:
                    (failed if bad else finished).append(job_id)
                    if kind is FaultKind.DUPLICATE:
                        self._again.append((job_id, bad))
        return finished, failed

    def _garble(self, job: TransferJob) -> None:
        assert self._layout is not None and self._pool is not None
        for t in job.groups:
            group = self._layout.groups[t.group]
            for block_id, slot, _ in t.pairs(self._layout.factor):
                if job.direction is Direction.LOAD:
                    for seg in group.segments:
                        seg.pages[block_id].fill_(0xA5)
                else:
                    self._pool.slot_view(slot, t.group).fill_(0x5A)

    def wait(self, job_ids: Iterable[JobId]) -> None:
        ids = list(job_ids)
        for job_id in ids:  # waiting for a stuck copy: it lands now, at the latest moment
            job = self._hung.pop(job_id, None)
            if job is not None:
                self.inner.submit(job)
        self.inner.wait(ids)

    def take_stats(self) -> TransferStats:
        return self.inner.take_stats()

    def shutdown(self) -> None:
        self.release_hung()
        self.inner.shutdown()
