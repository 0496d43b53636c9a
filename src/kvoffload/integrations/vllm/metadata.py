"""What crosses vLLM's scheduler <-> worker boundary for this connector.

Both classes are plain picklable dataclasses of kvoffload's own contract types, so they
travel between vLLM's engine-core and worker processes unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvoffload.jobs import JobId, StepPlan, WorkerReport


@dataclass
class KVOffloadMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per engine step.

    Attributes:
        plan: the planner's step plan (flushes, stores, loads).
        resolved_loads: ``(request id, failed)`` for requests vLLM holds in
            WAITING_FOR_REMOTE_KVS whose load ended without a transfer job (the blocks
            were evicted between lookup and allocation, or a cache reset dropped the job
            before it reached the workers). Every worker reports them as finished
            receiving (and, if failed, as failed receiving) in this step. Loads given up
            at their deadline are announced here too, as failed.
        abandoned_loads: load jobs given up at their deadline (``load_deadline_s``).
            Their requests are in ``resolved_loads`` now; when such a job's copy ends
            later, the worker reports it to the scheduler side (which releases its
            blocks) but never to vLLM again.
    """

    plan: StepPlan = field(default_factory=StepPlan)
    resolved_loads: tuple[tuple[str, bool], ...] = ()
    abandoned_loads: tuple[JobId, ...] = ()


@dataclass
class KVOffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: every rank's reports since its previous step.

    vLLM aggregates the metadata of all ranks with ``aggregate`` before handing it to the
    scheduler side, which sums job completions over ranks (``Planner``).
    """

    reports: list[WorkerReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVOffloadWorkerMetadata:
        if not isinstance(other, KVOffloadWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into "
                            "KVOffloadWorkerMetadata")
        return KVOffloadWorkerMetadata(self.reports + other.reports)
