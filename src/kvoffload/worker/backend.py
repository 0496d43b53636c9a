"""The transfer backend contract, and the job arithmetic every backend shares.

A backend moves the bytes of ``TransferJob`` values between the registered engine pages
(``CacheLayout``) and the host arena (``HostPool``). The ``TransferWorker`` owns one and
has already validated every job it submits (groups registered, block ids and slots in
range, slot count consistent with ``block_size_factor``).

Contract, for every implementation:

- ``submit(job)`` returns at once; the copy runs asynchronously. A copy that fails (an
  exception, a device error, an injected fault) never propagates out of ``submit`` or out
  of a background thread: the job is reported in ``poll()``'s *failed* list instead, and
  the failure is logged.
- Completion is in submission order within one direction (stores among stores, loads
  among loads): ``poll()`` never reports a job before an earlier job of the same direction.
- ``poll()`` does not block; it reports each submitted job exactly once.
- ``wait(job_ids)`` blocks until the listed jobs are done (finished or failed); ids that are
  unknown or were already reported are ignored. It does not report them: ``poll()`` does.
- ``take_stats()`` returns the bytes and transfer seconds of jobs completed successfully
  since its previous call.
- ``shutdown()`` waits for submitted jobs, releases threads and streams; it is idempotent.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvoffload.jobs import Direction, JobId, TransferJob, TransferStats
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import CacheLayout, GroupLayout

FaultHook = Callable[[TransferJob], bool]
"""Test hook: returns True for jobs whose copy must fail (raises ``InjectedFaultError``)."""


class InjectedFaultError(RuntimeError):
    """The failure a ``FaultHook`` provokes inside a backend's copy."""


class FailJobs:
    """A ``FaultHook`` failing a fixed set of job ids (and counting how often it fired)."""

    def __init__(self, job_ids: Iterable[int]) -> None:
        self.job_ids = {int(j) for j in job_ids}
        self.fired: list[JobId] = []

    def __call__(self, job: TransferJob) -> bool:
        if int(job.job_id) in self.job_ids:
            self.fired.append(job.job_id)
            return True
        return False


class TransferBackend(ABC):
    """Moves job bytes between engine pages and the host arena (see module docstring)."""

    @abstractmethod
    def bind(self, layout: CacheLayout, pool: HostPool) -> None:
        """Attach the registered caches and the arena; called once before any submit.

        Raises ``LayoutError`` when the tensors live where this backend cannot copy them.
        """

    @abstractmethod
    def submit(self, job: TransferJob) -> None:
        """Start ``job`` asynchronously. Raises only on misuse (not bound, shut down)."""

    @abstractmethod
    def poll(self) -> tuple[list[JobId], list[JobId]]:
        """``(finished, failed)`` jobs completed since the previous poll; never blocks."""

    @abstractmethod
    def wait(self, job_ids: Iterable[JobId]) -> None:
        """Block until every listed job that is still in flight is done."""

    def fence_engine_reads(self, job_ids: Iterable[JobId]) -> None:
        """Order every later use of the engine cache after the engine-side reads of the
        listed store jobs: whatever the engine does next to those blocks (zero them,
        copy into them, run a kernel writing them) cannot change what the stores copy.

        This default waits for the jobs (the host blocks until they are done); a backend
        whose stores read the engine cache in a step of their own (the CUDA backend's
        device gather) orders only that step before the engine's later work."""
        self.wait(job_ids)

    @abstractmethod
    def take_stats(self) -> TransferStats:
        """Bytes and seconds of successful transfers since the previous call."""

    @abstractmethod
    def shutdown(self) -> None:
        """Finish in-flight work and release resources; idempotent."""


@dataclass(frozen=True)
class GroupCopy:
    """One ``GroupTransfer`` resolved against its group's layout."""

    layout: GroupLayout
    pairs: tuple[tuple[int, int, int], ...]
    """``(engine block id, slot, sub-block)`` for every engine block, in order."""

    @property
    def nbytes(self) -> int:
        return len(self.pairs) * self.layout.page_bytes


def plan_job(job: TransferJob, layout: CacheLayout) -> list[GroupCopy]:
    """Resolve every group of a (validated) job into its page pairs."""
    out = []
    for transfer in job.groups:
        group = layout.groups[transfer.group]
        pairs = tuple(transfer.pairs(layout.factor))
        out.append(GroupCopy(layout=group, pairs=pairs))
    return out


def job_bytes(job: TransferJob, layout: CacheLayout) -> int:
    """Bytes one rank moves for ``job``."""
    return sum(len(t.block_ids) * layout.groups[t.group].page_bytes for t in job.groups)


class StatsAccumulator:
    """Thread-safe running totals behind ``TransferBackend.take_stats``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = {Direction.STORE: 0, Direction.LOAD: 0}
        self._seconds = {Direction.STORE: 0.0, Direction.LOAD: 0.0}

    def add(self, direction: Direction, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bytes[direction] += nbytes
            self._seconds[direction] += seconds

    def take(self) -> TransferStats:
        with self._lock:
            stats = TransferStats(
                stored_bytes=self._bytes[Direction.STORE],
                loaded_bytes=self._bytes[Direction.LOAD],
                store_seconds=self._seconds[Direction.STORE],
                load_seconds=self._seconds[Direction.LOAD])
            self._bytes = {Direction.STORE: 0, Direction.LOAD: 0}
            self._seconds = {Direction.STORE: 0.0, Direction.LOAD: 0.0}
        return stats
