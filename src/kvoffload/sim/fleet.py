"""A simulated fleet: N engines behind one router, sharing one remote tier.

``kvoffload simulate --engines N --router R`` asks what a shared tier is worth. Every
engine is the one-engine simulation's engine (``simulation.engine_parts``: its own
device prefix cache, planner, host tier and, with ``--disk-capacity``, its own disk
tier); with ``--remote-capacity`` all of them share one remote tier
(``kvoffload.sim.shared_store.SharedStore``: a modelled store that every engine's cascade
writes through and promotes from). The run is always modelled (accounting mode).

Routing. The router assigns each request of the workload, in workload order, to an engine:

* ``round-robin``: request ``i`` goes to engine ``i mod N``.
* ``prefix``: prefix affinity. The route key is the request's session id when the
  workload names one (the built-in chat and agentic workloads: a conversation's turns),
  else its cache salt and first ``PREFIX_ROUTE_TOKENS`` (1024) prompt tokens, or its
  whole prompt when shorter; the engine is ``blake2b-64(key) mod N``. Requests that share
  those tokens land on the same engine. 1024 tokens are two 512-token blocks of a
  Mooncake trace: every request of the shared conversation trace starts with the same
  first block (a system prompt), so that block alone would send every request to one
  engine; the second names the conversation.

Time. Each engine keeps its own modelled clock; the fleet always advances the engine whose
clock is earliest by one step (``replay.ReplayLoop``), so what one engine stores is seen
by the others in modelled-time order, to within one engine step. A request whose parent
(the previous chat turn) runs on another engine still waits for it to finish, as a
client would; an engine holding such a request does not run its clock past the others'.

Figures. Each engine's run is summarized as a one-engine run is (``summary.RunSummary``);
``FleetTotals`` adds them up over the fleet. With one engine and either router the run
is exactly ``simulation.run_one``'s.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import time
from collections import ChainMap, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.models.layout import ModelLayout
from kvoffload.offload import disk_index
from kvoffload.refengine.engine import ReferenceEngine
from kvoffload.refengine.requests import RequestRecord
from kvoffload.refengine.timing import TimingModel
from kvoffload.sim.replay import Feeder, Lineage, Progress, ReplayLoop
from kvoffload.sim.shared_store import SharedStore
from kvoffload.sim.simulation import (
    Capacities,
    Mode,
    SimulationConfig,
    assemble,
    engine_parts,
    lower_tier_config,
    resolve,
)
from kvoffload.sim.summary import Percentiles, RunSummary, modelled_ttft_s, summarize
from kvoffload.tiers.lower import LowerTier
from kvoffload.tiers.naming import namespace
from kvoffload.workloads.request import WorkloadRequest

MAX_ENGINES = 64
"""The most engines a simulated fleet runs (each keeps its own block pool and host tier
in this process)."""

PREFIX_ROUTE_TOKENS = 1024
"""Prompt tokens the prefix router hashes when a request names no session."""


class Router(str, Enum):
    ROUND_ROBIN = "round-robin"
    """Request ``i`` to engine ``i mod N``."""
    PREFIX = "prefix"
    """Prefix affinity: a hash of the session id, else of the first 1024 prompt tokens."""


ROUTER_HELP = {
    Router.ROUND_ROBIN: "request i of the workload goes to engine i mod N",
    Router.PREFIX: (f"requests go to engine blake2b(key) mod N, the key being the "
                    f"request's session id where the workload names one (built-in chat "
                    f"and agentic workloads), else its first {PREFIX_ROUTE_TOKENS} prompt "
                    f"tokens (with its cache salt), so requests sharing that prefix land "
                    f"on the same engine"),
}
"""One sentence per router (``--help``, reports)."""


def route_key(request: WorkloadRequest) -> bytes:
    """What the prefix router hashes (module docstring)."""
    if request.session_id is not None:
        return b"session\0" + request.session_id.encode()
    salt = (request.cache_salt or "").encode()
    return b"prefix\0" + salt + b"\0" + request.prompt[:PREFIX_ROUTE_TOKENS].tobytes()


def route(router: Router, index: int, request: WorkloadRequest, engines: int) -> int:
    """The engine request number ``index`` (0-based, in workload order) goes to."""
    if router is Router.ROUND_ROBIN:
        return index % engines
    digest = hashlib.blake2b(route_key(request), digest_size=8).digest()
    return int.from_bytes(digest, "little") % engines


@dataclass(frozen=True)
class FleetConfig:
    """A fleet: ``engines`` engines of ``simulation``'s configuration behind ``router``.

    ``simulation.remote_capacity_bytes`` is the shared tier's capacity (None: no shared
    tier); ``simulation.disk_capacity_bytes`` gives every engine a disk tier of its own.
    The fleet runs in accounting mode; real tiers (``disk_path``, ``remote_url``) are
    refused.
    """

    simulation: SimulationConfig
    engines: int = 1
    router: Router = Router.ROUND_ROBIN

    def __post_init__(self) -> None:
        if not 1 <= self.engines <= MAX_ENGINES:
            raise ConfigError("engines", f"must be from 1 to {MAX_ENGINES}, got "
                              f"{self.engines}", "Give the number of engines, e.g. 4.")
        sim = self.simulation
        if sim.mode is not Mode.ACCOUNTING:
            raise ConfigError("mode", "a fleet is simulated in accounting mode only",
                              "Use --mode accounting (the default with --engines).")
        if sim.disk_path or sim.remote_url:
            raise ConfigError("disk_path" if sim.disk_path else "remote_url",
                              "a fleet models its tiers; it does not use real ones",
                              "Give --disk-capacity / --remote-capacity instead.")

    @property
    def shared_tier(self) -> bool:
        return bool(self.simulation.remote_capacity_bytes)


@dataclass(frozen=True)
class FleetTotals:
    """The fleet's figures, over every engine's requests (prompt tokens unless said
    otherwise; see ``RunSummary``). ``tier_hit_tokens`` splits ``host_hit_tokens`` by
    the tier the blocks were in (``host``, ``disk``, ``remote``: the shared tier)."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    engine_hit_tokens: int
    host_hit_tokens: int
    tier_hit_tokens: dict[str, int]
    prefill_tokens_computed: int
    recomputed_tokens: int
    preemptions: int
    ttft: Percentiles
    clock_ttft: Percentiles
    makespan_s: float

    @classmethod
    def of(cls, summaries: Sequence[RunSummary], records: Iterable[RequestRecord],
           timing: TimingModel) -> FleetTotals:
        records = list(records)
        return cls(
            requests=len(records),
            prompt_tokens=sum(r.prompt_tokens for r in records),
            output_tokens=sum(r.output_tokens for r in records),
            engine_hit_tokens=sum(r.engine_hit_tokens for r in records),
            host_hit_tokens=sum(r.host_hit_tokens for r in records),
            tier_hit_tokens=tier_tokens(records),
            prefill_tokens_computed=sum(r.prefill_tokens for r in records),
            recomputed_tokens=sum(r.recomputed_tokens for r in records),
            preemptions=sum(s.preemptions for s in summaries),
            ttft=Percentiles.of([modelled_ttft_s(r, timing) for r in records]),
            clock_ttft=Percentiles.of([r.first_token_s - r.arrival_s for r in records
                                       if r.first_token_s is not None]),
            makespan_s=max((s.makespan_s for s in summaries), default=0.0))

    def _rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def engine_hit_rate(self) -> float:
        """Share of prompt tokens the engines' own prefix caches served (device)."""
        return self._rate(self.engine_hit_tokens)

    @property
    def host_hit_rate(self) -> float:
        """Share loaded through host memory, from whichever tier."""
        return self._rate(self.host_hit_tokens)

    @property
    def tier_hit_rates(self) -> dict[str, float]:
        return {tier: self._rate(n) for tier, n in self.tier_hit_tokens.items()}

    @property
    def prefill_tokens_saved(self) -> int:
        """Prompt tokens not computed because a cache served them (device or offload)."""
        return self.engine_hit_tokens + self.host_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self._rate(self.prefill_tokens_saved)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(engine_hit_rate=self.engine_hit_rate, host_hit_rate=self.host_hit_rate,
                   tier_hit_rates=self.tier_hit_rates, hit_rate=self.hit_rate,
                   prefill_tokens_saved=self.prefill_tokens_saved)
        return out


def tier_tokens(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Prompt tokens loaded through host memory, by the tier they were in."""
    out: dict[str, int] = {}
    for r in records:
        for tier, n in r.tier_hit_tokens.items():
            out[tier] = out.get(tier, 0) + n
    return out


@dataclass(frozen=True)
class FleetRun:
    """One run of a fleet, with or without offloading.

    Attributes:
        engines: each engine's summary, in engine order.
        engine_tier_tokens: each engine's ``host_hit_tokens`` by tier (exact counts).
        routed: requests the router sent to each engine.
        deferral_timeouts: per engine, lookups that stopped waiting for blocks still
            being promoted or written (``PlannerStats.deferral_timeouts``: after
            ``max_deferred_steps`` engine steps the request runs with what is readable).
        totals: the fleet's figures.
        shared_blocks / shared_bytes: what the shared tier holds at the end (0 without).
        wall_s: wall time of the whole run.
    """

    engines: tuple[RunSummary, ...]
    engine_tier_tokens: tuple[dict[str, int], ...]
    routed: tuple[int, ...]
    deferral_timeouts: tuple[int, ...]
    totals: FleetTotals
    shared_blocks: int
    shared_bytes: int
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: the totals' fields, the shared tier and ``engines``, one
        object per engine (its ``RunSummary`` fields plus ``engine``, ``routed``,
        ``tier_hit_tokens`` and ``deferral_timeouts``)."""
        out = self.totals.to_dict()
        out.update(shared_blocks=self.shared_blocks, shared_bytes=self.shared_bytes,
                   wall_s=self.wall_s)
        out["deferral_timeouts"] = sum(self.deferral_timeouts)
        out["engines"] = [{"engine": i, "routed": n, **summary.to_dict(),
                           "tier_hit_tokens": tokens, "deferral_timeouts": timeouts}
                          for i, (summary, tokens, n, timeouts) in enumerate(zip(
                              self.engines, self.engine_tier_tokens, self.routed,
                              self.deferral_timeouts, strict=True))]
        return out


@dataclass(frozen=True)
class FleetResult:
    """Both runs of a fleet simulation (the one without offloading: same engines and
    router, each engine with its own prefix cache only)."""

    config: FleetConfig
    layout: ModelLayout
    capacities: Capacities
    offload: FleetRun
    baseline: FleetRun | None


class _Split:
    """Routes one workload stream among the engines, lazily: engine ``i`` reads
    ``stream(i)``, which reads the workload as far as its next request (the others'
    wait in their queues)."""

    def __init__(self, workload: Iterable[WorkloadRequest], router: Router, engines: int,
                 lineage: Lineage) -> None:
        self._source = iter(workload)
        self._router = router
        self._queues: list[deque[WorkloadRequest]] = [deque() for _ in range(engines)]
        self._lineage = lineage
        self._index = 0
        self.routed = [0] * engines

    def stream(self, engine: int) -> Iterator[WorkloadRequest]:
        queue = self._queues[engine]
        while True:
            while not queue:
                request = next(self._source, None)
                if request is None:
                    return
                target = route(self._router, self._index, request, len(self._queues))
                self._index += 1
                self.routed[target] += 1
                # Seen fleet-wide once routed: a child on another engine waits for it.
                self._lineage.seen.add(request.request_id)
                self._queues[target].append(request)
            yield queue.popleft()


def build_fleet(config: FleetConfig, *, offload: bool = True
                ) -> tuple[list[ReferenceEngine], SharedStore | None]:
    """The fleet's engines (``offload=False``: without offloading) and its shared store
    (None without a shared tier or offloading)."""
    sim = config.simulation
    parts = engine_parts(sim, offload=offload, lower_tiers=False)
    tiers = None
    if offload and (sim.disk_capacity_bytes or sim.remote_capacity_bytes):
        tiers = lower_tier_config(sim)  # accounting mode: modelled tiers, checked
    store = None
    if tiers is not None and tiers.remote is not None and sim.remote_capacity_bytes:
        store = SharedStore(parts.offload, sim.remote_capacity_bytes,
                            write_mode=tiers.remote.write_mode)
    ns = namespace(parts.offload, tiers) if tiers is not None else ""
    engines = []
    for _ in range(config.engines):
        lowers: list[LowerTier] = []
        for name in tiers.enabled if tiers is not None else ():
            if name == "disk":
                assert tiers is not None and tiers.disk is not None
                lowers.append(disk_index(parts.offload, tiers.disk, ns, scan=False))
            else:
                assert store is not None
                lowers.append(store.view())
        engines.append(assemble(parts.layout, parts.engine,
                                parts.build_offload(lowers) if offload else None,
                                mode=Mode.ACCOUNTING, timing=sim.timing))
    return engines, store


def run_fleet(config: FleetConfig, workload: Iterable[WorkloadRequest], *,
              offload: bool = True, progress: Progress | None = None) -> FleetRun:
    """Run ``workload`` once through the fleet (module docstring); ``progress`` gets the
    number of requests finished fleet-wide."""
    sim = config.simulation
    engines, store = build_fleet(config, offload=offload)
    lineage = Lineage(ChainMap(*(e.finished_ids for e in engines)))
    split = _Split(workload, config.router, len(engines), lineage)
    feeders = [Feeder(split.stream(i), sim.arrival, sim.max_queued, lineage=lineage)
               for i in range(len(engines))]
    finished = itertools.count(1)

    def released(request_id: str, at: float) -> None:
        for feeder in feeders:
            feeder.finished(request_id, at)
        done = next(finished)
        if progress is not None:
            progress(done)

    loops: list[ReplayLoop] = []

    def others_clock(i: int) -> Callable[[], float | None]:
        return lambda: min((loop.engine.clock for j, loop in enumerate(loops)
                            if j != i and not loop.done), default=None)

    loops.extend(ReplayLoop(engine, feeder, on_finished=released, wake=others_clock(i))
                 for i, (engine, feeder) in enumerate(zip(engines, feeders, strict=True)))
    start = time.perf_counter()
    try:
        order = itertools.count()
        heap = [(engine.clock, next(order), i) for i, engine in enumerate(engines)]
        while heap:
            # The earliest clock steps next; among equal clocks, the one waiting longest.
            _, _, i = heapq.heappop(heap)
            if loops[i].advance():
                heapq.heappush(heap, (engines[i].clock, next(order), i))
        metrics = [loop.finish() for loop in loops]
    finally:
        for engine in engines:
            engine.executor.shutdown()
            if engine.tier is not None:
                engine.tier.close()
    if sim.check_integrity:
        for engine in engines:
            engine.check_integrity()
        if store is not None:
            store.check_integrity()
    wall = time.perf_counter() - start
    summaries = tuple(summarize(e, m, wall_s=wall)
                      for e, m in zip(engines, metrics, strict=True))
    held_bytes, held_blocks = store.held() if store is not None else (0, 0)
    return FleetRun(
        engines=summaries,
        engine_tier_tokens=tuple(tier_tokens(m.records) for m in metrics),
        routed=tuple(split.routed),
        deferral_timeouts=tuple(e.planner.stats.deferral_timeouts if e.planner else 0
                                for e in engines),
        totals=FleetTotals.of(summaries, (r for m in metrics for r in m.records), sim.timing),
        shared_blocks=held_blocks, shared_bytes=held_bytes, wall_s=wall)


def simulate_fleet(config: FleetConfig, workload: Iterable[WorkloadRequest], *,
                   progress: Progress | None = None,
                   baseline_progress: Progress | None = None) -> FleetResult:
    """Run the fleet with offloading and (``simulation.baseline``) without; ``workload``
    is iterated once per run (a list, or a re-iterable object)."""
    sim = config.simulation
    layout = sim.layout()
    caps, _ = resolve(sim, layout)
    result = run_fleet(config, workload, progress=progress)
    base = None
    if sim.baseline:
        base = run_fleet(config, workload, offload=False, progress=baseline_progress)
    return FleetResult(config, layout, caps, result, base)
