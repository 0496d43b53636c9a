"""The soak test: a long replay with faults injected, every loaded byte verified, and the
planner's and tiers' bookkeeping checked at intervals.

``run_soak`` builds the reference engine exactly as ``kvoffload simulate`` does, wraps its
worker side in a ``FaultyExecutor`` (with ``num_workers`` ranks: the real worker is rank 0
and its reports stand for every rank), gives it a load deadline, and replays the workload.
After every step it samples what is held (pinned host keys, fenced engine blocks, jobs in
flight, parked blocks of abandoned loads) and resets the cache when a ``late`` fault asks
for it; every ``check_interval_s`` modelled seconds it checks the pool's, planner's and
tier's integrity and (bytes mode) audits every block the host tier can serve.

The ``SoakReport`` says whether the run is clean (``ok``): every request served, no wrong
byte, nothing left pinned, fenced or pending at the end, and no request waiting on the
offload path longer than ``wait_bound_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffload.errors import ConfigError
from kvoffload.faults.executor import FaultyExecutor, Garble
from kvoffload.faults.plan import FaultPlan
from kvoffload.faults.store import FaultyBlockStore, disk_tamper, redis_tamper
from kvoffload.jobs import Direction, TransferJob
from kvoffload.refengine.engine import ReferenceEngine
from kvoffload.refengine.executors import TransferExecutor
from kvoffload.sim.replay import replay
from kvoffload.sim.simulation import SimulationConfig, assemble, engine_parts
from kvoffload.sim.summary import summarize
from kvoffload.worker.block_store import BlockStore
from kvoffload.worker.remote_store import RemoteStore
from kvoffload.workloads.request import WorkloadRequest

if TYPE_CHECKING:  # bytes mode only: torch
    import torch

    from kvoffload.refengine.device import DeviceCaches, WorkerExecutor


@dataclass(frozen=True)
class SoakConfig:
    """A soak run.

    Attributes:
        simulation: engine, model, capacities and mode (bytes mode verifies every byte).
        faults: the fault schedule.
        load_deadline_s: modelled seconds a request waits for its load before it gives up
            and recomputes.
        num_workers: tensor-parallel ranks the planner waits for.
        check_interval_s: modelled seconds between integrity checks and host audits.
        tier_faults: bytes mode with real lower tiers (``disk_path``, ``remote_url``):
            the share of each rank's tier I/O calls that raise an I/O error, damage the
            block just written at rest, or start an outage of the tier.
    """

    simulation: SimulationConfig
    faults: FaultPlan
    load_deadline_s: float = 5.0
    num_workers: int = 2
    check_interval_s: float = 60.0
    tier_faults: float = 0.0



@dataclass
class Held:
    """Peak and final counts of what the system holds."""

    peak: int = 0
    final: int = 0

    def see(self, n: int) -> None:
        self.peak = max(self.peak, n)
        self.final = n


@dataclass
class SoakReport:
    """The figures of one soak run (see the module docstring)."""

    requests: int
    requests_served: int
    modelled_s: float
    wall_s: float
    mode: str
    transfer_jobs: int
    faults_injected: int
    faults: dict[str, int]
    wrong_bytes: int
    verified_blocks: int
    audited_host_blocks: int
    recomputed_requests: int
    failed_loads: int
    abandoned_loads: int
    failed_stores: int
    cache_resets: int
    stale_reports: int
    duplicate_reports: int
    deferral_timeouts: int
    integrity_checks: int
    host_hit_rate: float
    max_offload_wait_s: float
    load_deadline_s: float
    max_step_s: float
    deferral_give_ups: int
    pinned: Held = field(default_factory=Held)
    fenced: Held = field(default_factory=Held)
    pending: Held = field(default_factory=Held)
    parked: Held = field(default_factory=Held)

    @property
    def wait_bound_s(self) -> float:
        """The bound every offload wait must keep: the load deadline, plus the one step
        during which it expired (checked at step starts; a step lasts at most
        ``max_step_s``, flush stalls behind a hung job included)."""
        return self.load_deadline_s + self.max_step_s

    @property
    def ok(self) -> bool:
        return (self.requests_served == self.requests and self.wrong_bytes == 0
                and self.pinned.final == 0 and self.fenced.final == 0
                and self.pending.final == 0 and self.parked.final == 0
                and self.max_offload_wait_s <= self.wait_bound_s)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["wait_bound_s"] = self.wait_bound_s
        return out

    def figures(self) -> list[tuple[str, str]]:
        """Every figure of the run as (label, value), in reading order."""
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items())) or "none"
        return [
            ("requests served", f"{self.requests_served:,} of {self.requests:,}"),
            ("modelled time", f"{self.modelled_s:,.0f} s ({self.mode} mode, "
                              f"{self.wall_s:,.0f} s wall)"),
            ("transfer jobs", f"{self.transfer_jobs:,}"),
            ("faults injected", f"{self.faults_injected:,} ({kinds})"),
            ("wrong bytes", f"{self.wrong_bytes:,} ({self.verified_blocks:,} loaded or "
                            f"cached blocks verified, {self.audited_host_blocks:,} host "
                            "blocks audited)"),
            ("fell back to recompute", f"{self.recomputed_requests:,} requests "
                                       f"({self.failed_loads:,} failed loads, "
                                       f"{self.abandoned_loads:,} given up at the deadline)"),
            ("failed stores (slots freed)", f"{self.failed_stores:,}"),
            ("cache resets / stale reports ignored",
             f"{self.cache_resets:,} / {self.stale_reports:,}"),
            ("duplicate reports (detected, ignored)", f"{self.duplicate_reports:,}"),
            ("integrity checks passed", f"{self.integrity_checks:,}"),
            ("offload hit rate", f"{self.host_hit_rate:.1%}"),
            ("longest offload wait", f"{self.max_offload_wait_s:.2f} s (bound: deadline "
                                     f"{self.load_deadline_s:.1f} s + longest step "
                                     f"{self.max_step_s:.2f} s; {self.deferral_give_ups:,} "
                                     "lookups deferred past the deadline ran without)"),
            ("pinned host keys, peak / final", f"{self.pinned.peak:,} / {self.pinned.final}"),
            ("fenced engine blocks, peak / final",
             f"{self.fenced.peak:,} / {self.fenced.final}"),
            ("jobs pending, peak / final", f"{self.pending.peak:,} / {self.pending.final}"),
            ("parked blocks of abandoned loads, peak / final",
             f"{self.parked.peak:,} / {self.parked.final}"),
            ("verdict", "OK" if self.ok else "FAILED"),
        ]

    def text(self) -> str:
        return "soak:\n" + "\n".join(f"  {label:<47} {value}"
                                       for label, value in self.figures())


class Garbler:
    """Writes garbage where a failed job was to write (``faults.executor.Garble``):
    the engine blocks of a load, the host slots of a store (bytes mode)."""

    def __init__(self, device: DeviceCaches, arena: torch.Tensor) -> None:
        self.device = device
        self.arena = arena

    def __call__(self, job: TransferJob) -> None:
        for t in job.groups:
            if job.direction is Direction.LOAD:
                self.device.tensors[t.group][list(t.block_ids)] = 0xA5
            else:
                self.arena[list(t.slots)] = 0x5A


def build_soak_engine(config: SoakConfig,
                      ) -> tuple[ReferenceEngine, FaultyExecutor, list[FaultyBlockStore]]:
    """The engine of ``config.simulation`` with a load deadline and a faulty worker side;
    also the faulty lower-tier stores (``config.tier_faults``)."""
    sim = config.simulation
    parts = engine_parts(sim, num_workers=config.num_workers,
                         load_deadline_s=config.load_deadline_s)
    faulty_stores: list[FaultyBlockStore] = []

    def with_faults(inner: TransferExecutor, device: DeviceCaches | None,
                    worker: WorkerExecutor | None) -> TransferExecutor:
        garble: Garble | None = None
        mirror = 1
        if worker is not None and device is not None:  # bytes mode: the real worker
            garble, mirror = Garbler(device, worker.arena), config.num_workers
            tier_io = worker.worker.tier_io
            if config.tier_faults > 0 and tier_io is not None:
                for name, store in tier_io.stores.items():
                    tier_io.stores[name] = faulty = faulty_store(store, config.tier_faults,
                                                                 config.faults.seed)
                    faulty_stores.append(faulty)
        return FaultyExecutor(inner, config.faults, mirror_ranks=mirror, garble=garble)

    engine = assemble(parts.layout, parts.engine, parts.build_offload(), mode=sim.mode,
                      timing=sim.timing, tiers=parts.tiers, wrap_executor=with_faults)
    faulty = engine.executor
    assert isinstance(faulty, FaultyExecutor)
    faulty.clock = lambda: engine.clock
    if config.tier_faults and not faulty_stores:
        raise ConfigError("tier_faults", "lower-tier faults need real tiers",
                          "Use bytes mode with --disk-path/--disk-capacity or --remote-url.")
    return engine, faulty, faulty_stores


def faulty_store(store: BlockStore, rate: float, seed: int) -> FaultyBlockStore:
    """``store`` behind a ``FaultyBlockStore`` injecting every store fault kind."""
    if isinstance(store, RemoteStore):
        tamper = redis_tamper(store.client, store)
    else:
        tamper = disk_tamper(store)
    return FaultyBlockStore(store, rate=rate, seed=seed + store_rank(store), tamper=tamper)


def store_rank(store: BlockStore) -> int:
    rank = getattr(store, "rank", 0)
    return rank if isinstance(rank, int) else 0


class _Watch:
    """The per-step hook: samples held counts, resets on request, checks at intervals."""

    def __init__(self, engine: ReferenceEngine, faulty: FaultyExecutor,
                 interval: float) -> None:
        self.engine, self.faulty = engine, faulty
        self.interval = interval
        self.next_check = interval
        self.pinned, self.fenced, self.pending, self.parked = Held(), Held(), Held(), Held()
        self.integrity_checks = 0

    def __call__(self) -> None:
        engine = self.engine
        if self.faulty.reset_requested:
            engine.reset_cache()
            self.faulty.note_reset()
        self.sample()
        if engine.clock >= self.next_check:
            self.next_check = engine.clock + self.interval
            self.check()

    def sample(self) -> None:
        engine = self.engine
        planner, host = engine.planner, engine.host
        assert planner is not None and host is not None
        self.pinned.see(host.usage().pinned_slots)
        self.fenced.see(planner.fence_size)
        self.pending.see(planner.num_jobs + self.faulty.num_held)
        self.parked.see(engine.num_parked_loads)

    def check(self) -> None:
        self.engine.check_integrity()
        self.engine.audit_host()
        self.integrity_checks += 1


def run_soak(config: SoakConfig, workload: Iterable[WorkloadRequest], *,
             progress: Callable[[int], None] | None = None) -> SoakReport:
    """Replay ``workload`` with faults; raise whatever an integrity check raises."""
    engine, faulty, faulty_stores = build_soak_engine(config)
    counted = _Counted(workload)
    watch = _Watch(engine, faulty, config.check_interval_s)
    start = time.perf_counter()
    try:
        metrics = replay(engine, counted, arrival=config.simulation.arrival,
                         max_queued=config.simulation.max_queued, progress=progress,
                         after_step=watch)
        watch.sample()
        watch.check()
    finally:
        engine.executor.shutdown()
        if engine.tier is not None:
            engine.tier.close()
    summary = summarize(engine, metrics, wall_s=time.perf_counter() - start)
    planner = engine.planner
    assert planner is not None
    stats = planner.stats
    faults = dict(faulty.log.injected)
    for store in faulty_stores:
        for kind, n in store.injected.items():
            label = f"{store.name} {kind}"
            faults[label] = faults.get(label, 0) + n
    return SoakReport(
        requests=counted.count, requests_served=len(metrics.records),
        modelled_s=engine.clock, wall_s=summary.wall_s, mode=config.simulation.mode.value,
        transfer_jobs=faulty.log.jobs,
        faults_injected=faulty.log.total + sum(sum(s.injected.values()) for s in faulty_stores),
        faults=faults, wrong_bytes=metrics.wrong_bytes,
        verified_blocks=metrics.verified_blocks,
        audited_host_blocks=metrics.audited_host_blocks,
        recomputed_requests=sum(1 for r in metrics.records
                                if r.failed_loads or r.corrupt_loads),
        failed_loads=stats.failed_loads, abandoned_loads=metrics.abandoned_loads,
        failed_stores=stats.failed_stores, cache_resets=metrics.cache_resets,
        stale_reports=stats.stale_reports, duplicate_reports=stats.duplicate_reports,
        deferral_timeouts=stats.deferral_timeouts, integrity_checks=watch.integrity_checks,
        host_hit_rate=summary.host_hit_rate, max_offload_wait_s=metrics.max_offload_wait_s,
        load_deadline_s=config.load_deadline_s, max_step_s=metrics.max_step_s,
        deferral_give_ups=metrics.deferral_give_ups, pinned=watch.pinned,
        fenced=watch.fenced, pending=watch.pending, parked=watch.parked)


class _Counted:
    """Counts the requests a workload yields (a trace is streamed, not held)."""

    def __init__(self, workload: Iterable[WorkloadRequest]) -> None:
        self.workload = workload
        self.count = 0

    def __iter__(self) -> Iterator[WorkloadRequest]:
        for request in self.workload:
            self.count += 1
            yield request
