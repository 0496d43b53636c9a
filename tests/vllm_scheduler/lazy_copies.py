"""A copy engine that runs behind: stores are copied late, but never later than a wait.

``LazyStores`` wraps the worker's real backend. A submitted store is not handed to it at
once: it waits, as a store does on a busy copy engine, until the job is waited for
(``wait``, which the worker's flush and fence use), or until ``catch_up`` (the scripted
runner calls it once the next step's ``handle_preemptions`` has returned, when the copy
engine would have had the step's compute time to run). Loads go through unchanged. So a
store's copy happens as late as the connector lets it: whatever the engine writes into
its blocks before the connector waits for it ends up in the copy, and the store checks
(``stored_bytes``) see it.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvoffload.jobs import Direction, JobId, TransferJob, TransferStats
from kvoffload.worker.backend import TransferBackend
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import CacheLayout


class LazyStores(TransferBackend):
    """``inner`` with stores handed over late (module docstring)."""

    def __init__(self, inner: TransferBackend) -> None:
        self.inner = inner
        self.pending: list[TransferJob] = []
        self.late_copies = 0
        """Stores copied by ``catch_up`` rather than at once (none are while fenced)."""

    def bind(self, layout: CacheLayout, pool: HostPool) -> None:
        self.inner.bind(layout, pool)

    def submit(self, job: TransferJob) -> None:
        if job.direction is Direction.STORE:
            self.pending.append(job)
        else:
            self.inner.submit(job)

    def catch_up(self) -> None:
        """The copy engine starts every store it holds (in submission order)."""
        pending, self.pending = self.pending, []
        self.late_copies += len(pending)
        for job in pending:
            self.inner.submit(job)

    def poll(self) -> tuple[list[JobId], list[JobId]]:
        return self.inner.poll()

    def wait(self, job_ids: Iterable[JobId]) -> None:
        job_ids = list(job_ids)
        wanted = set(job_ids)
        if any(job.job_id in wanted for job in self.pending):
            pending, self.pending = self.pending, []
            for job in pending:  # a copy engine runs its queue in order
                self.inner.submit(job)
        self.inner.wait(job_ids)

    def take_stats(self) -> TransferStats:
        return self.inner.take_stats()

    def shutdown(self) -> None:
        self.catch_up()
        self.inner.shutdown()
