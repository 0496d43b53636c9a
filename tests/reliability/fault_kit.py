"""Helpers for the reliability tests: tiny engines with a faulty worker side."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.config import OffloadConfig
from kvoffload.faults.executor import Chooser, FaultyExecutor
from kvoffload.faults.plan import FaultKind, FaultPlan
from kvoffload.faults.soak import Garbler
from kvoffload.jobs import Direction, TransferJob
from kvoffload.models.preset import ModelPreset
from kvoffload.refengine.context import EngineConfig
from kvoffload.refengine.device import DeviceCaches, HostAuditor, WorkerExecutor
from kvoffload.refengine.engine import ReferenceEngine, offload_for
from kvoffload.refengine.executors import AccountingExecutor, TransferExecutor
from kvoffload.sim.replay import Arrival, replay
from kvoffload.workloads import WorkloadRequest
from refengine.engine_kit import BS, req, tiny_preset, toks

__all__ = ["BS", "faulty_engine", "nth", "req", "run", "tiny_preset", "toks"]


def faulty_engine(preset: ModelPreset, plan: FaultPlan, *, num_blocks: int = 64,
                  host_slots: int = 256, bytes_mode: bool = True, num_workers: int = 1,
                  mirror_ranks: int = 1, deadline: float | None = None,
                  choose: Chooser | None = None, budget: int = 64,
                  max_seqs: int = 8) -> tuple[ReferenceEngine, FaultyExecutor]:
    """A tiny engine whose worker side is a ``FaultyExecutor`` (the real worker on real
    tensors in bytes mode, with garbage written by failed jobs)."""
    layout = preset.layout(BS)
    probe = OffloadConfig(groups=layout.specs, hash_block_size=BS, host_capacity_bytes=1 << 40)
    offload = OffloadConfig(groups=layout.specs, hash_block_size=BS,
                            host_capacity_bytes=host_slots * probe.slot_bytes,
                            num_workers=num_workers, max_deferred_steps=8, eviction_policy="lru")
    config = EngineConfig(num_blocks=num_blocks, max_num_batched_tokens=budget,
                          max_num_seqs=max_seqs, check_integrity=True,
                          load_deadline_s=deadline)
    inner: TransferExecutor
    device = auditor = garble = None
    if bytes_mode:
        device = DeviceCaches(layout.specs, num_blocks)
        worker = WorkerExecutor(offload, device)
        auditor = HostAuditor(worker.worker.host_pool, layout.specs, 1)
        garble = Garbler(device, worker.arena)
        inner = worker
    else:
        inner = AccountingExecutor(num_workers)
    faulty = FaultyExecutor(inner, plan, mirror_ranks=mirror_ranks, garble=garble,
                            choose=choose)
    engine = ReferenceEngine(layout, config, offload=offload_for(layout, offload),
                             executor=faulty, device=device, auditor=auditor)
    faulty.clock = lambda: engine.clock
    return engine, faulty


def run(engine: ReferenceEngine, faulty: FaultyExecutor,
        workload: Sequence[WorkloadRequest]) -> None:
    """Replay ``workload`` at its arrival times, resetting the cache when asked."""

    def after_step() -> None:
        if faulty.reset_requested:
            engine.reset_cache()
            faulty.note_reset()

    replay(engine, workload, arrival=Arrival.TRACE, after_step=after_step)
    engine.check_integrity()


def nth(kind: FaultKind, direction: Direction, n: int = 0) -> Chooser:
    """A chooser giving ``kind`` to the ``n``-th job of ``direction`` (0-based)."""
    seen = [0]

    def choose(job: TransferJob) -> FaultKind | None:
        if job.direction is not direction:
            return None
        seen[0] += 1
        return kind if seen[0] == n + 1 else None

    return choose


def where(predicate: Callable[[TransferJob], bool], kind: FaultKind) -> Chooser:
    """A chooser giving ``kind`` to every job ``predicate`` selects."""
    return lambda job: kind if predicate(job) else None
