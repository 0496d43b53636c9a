"""The numbers one engine run produced, derived from its ``EngineMetrics``.

Time to first token is given two ways:

* **modelled** (``ttft_*``): the request's own prefill work, ``prefill FLOPs of the tokens
  it computed / accelerator FLOP/s + bytes it loaded / link bandwidth + bytes promoted for
  it from a lower tier / lower-tier bandwidth``, without queueing; this is the figure
  offloading is meant to cut;
* **clock** (``clock_ttft_*``): first-token time minus arrival on the engine's modelled
  clock, queueing and batching with other requests included.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvoffload.jobs import Direction
from kvoffload.refengine.metrics import EngineMetrics, GroupTraffic, Sample
from kvoffload.refengine.requests import RequestRecord
from kvoffload.refengine.timing import TimingModel

if TYPE_CHECKING:
    from kvoffload.refengine.engine import ReferenceEngine


@dataclass(frozen=True)
class GroupSummary:
    """One KV-cache group's traffic and host memory (real bytes)."""

    name: str
    kind: str
    stored_blocks: int
    loaded_blocks: int
    stored_bytes: int
    loaded_bytes: int
    host_bytes_peak: int
    host_bytes_final: int


@dataclass(frozen=True)
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Percentiles:
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0)
        ordered = sorted(values)

        def pick(q: float) -> float:
            return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

        return cls(sum(ordered) / len(ordered), pick(0.5), pick(0.9), pick(0.99))


@dataclass(frozen=True)
class RunSummary:
    """One run's results. Token counts are prompt tokens unless said otherwise.

    ``engine_hit_rate`` and ``host_hit_rate`` are shares of prompt tokens served by the
    engine's prefix cache and by offloading (loaded through host memory) when each request
    first started; ``tier_hit_rates`` splits the latter by the tier the blocks were in
    (``host``, ``disk``, ``remote``); ``lower_tier_blocks`` / ``lower_tier_bytes`` is
    what each lower tier holds at the end (bytes: real sizes in accounting mode, the moved
    scaled-down files with their headers in bytes mode);
    ``prefill_tokens_saved`` is their sum in tokens. ``host_reserved_bytes_peak`` is the
    host memory the tier's slots take (every slot is as large as the largest group's
    offloaded block); ``host_bytes_peak`` counts only the blocks' own bytes.
    ``cold_keys`` counts host blocks stored cold (the value policy's bimodal
    insertion, or requests whose ``continues`` hint says they end).
    """

    offload: bool
    requests: int
    prompt_tokens: int
    output_tokens: int
    engine_hit_tokens: int
    host_hit_tokens: int
    prefill_tokens_computed: int
    recomputed_tokens: int
    engine_hit_rate: float
    host_hit_rate: float
    tier_hit_rates: dict[str, float]
    lower_tier_bytes: dict[str, int]
    lower_tier_blocks: dict[str, int]
    groups: tuple[GroupSummary, ...]
    stored_bytes: int
    loaded_bytes: int
    host_bytes_peak: int
    host_reserved_bytes_peak: int
    host_capacity_bytes: int
    store_link_s: float
    load_link_s: float
    flush_stall_s: float
    cold_keys: int
    ttft: Percentiles
    clock_ttft: Percentiles
    makespan_s: float
    steps: int
    preemptions: int
    failed_loads: int
    corrupt_loads: int
    wrong_loaded_bytes: int
    wrong_cached_bytes: int
    wrong_host_bytes: int
    audited_host_blocks: int
    same_step_flushes: int
    misplaced_store_blocks: int
    verified_blocks: int
    verified_bytes: int
    moved_stored_bytes: int
    moved_loaded_bytes: int
    measured_transfer_s: float
    wall_s: float
    samples: tuple[Sample, ...]

    @property
    def prefill_tokens_saved(self) -> int:
        return self.engine_hit_tokens + self.host_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.engine_hit_rate + self.host_hit_rate

    @property
    def wrong_bytes(self) -> int:
        return self.wrong_loaded_bytes + self.wrong_cached_bytes + self.wrong_host_bytes

    def to_dict(self, *, samples: bool = False) -> dict[str, Any]:
        """Plain data for JSON; the time series only when ``samples`` is set."""
        out = asdict(self)
        out["prefill_tokens_saved"] = self.prefill_tokens_saved
        out["hit_rate"] = self.hit_rate
        out["wrong_bytes"] = self.wrong_bytes
        if not samples:
            del out["samples"]
        return out


def summarize(engine: ReferenceEngine, metrics: EngineMetrics, *, wall_s: float) -> RunSummary:
    """Derive a ``RunSummary`` from a finished run."""
    records = metrics.records
    timing = engine.timing
    prompt = sum(r.prompt_tokens for r in records)
    engine_hits = sum(r.engine_hit_tokens for r in records)
    host_hits = sum(r.host_hit_tokens for r in records)
    final = engine.host_bytes_by_group()
    groups = tuple(_group(spec.name or spec.kind.value, spec.kind.value, traffic,
                          metrics.peak_host_bytes_by_group[g], final[g])
                   for g, (spec, traffic) in enumerate(zip(engine.specs, metrics.traffic,
                                                           strict=True)))
    slot_bytes = engine.real_slot_bytes
    peak_slots = max((s.host_used_slots for s in metrics.samples), default=0)
    capacity = 0
    if engine.host is not None:
        capacity = engine.host.capacity * slot_bytes
    by_tier: dict[str, int] = {}
    for r in records:
        for tier, n in r.tier_hit_tokens.items():
            by_tier[tier] = by_tier.get(tier, 0) + n
    lower: dict[str, int] = {}
    lower_blocks: dict[str, int] = {}
    if engine.tier is not None:
        for usage in engine.tier.lower_usage():
            lower[usage.name] = usage.used_bytes
            lower_blocks[usage.name] = usage.blocks
    ttft = [modelled_ttft_s(r, timing) for r in records]
    clock = [r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None]
    return RunSummary(
        offload=engine.planner is not None,
        requests=len(records), prompt_tokens=prompt,
        output_tokens=sum(r.output_tokens for r in records),
        engine_hit_tokens=engine_hits, host_hit_tokens=host_hits,
        prefill_tokens_computed=sum(r.prefill_tokens for r in records),
        recomputed_tokens=sum(r.recomputed_tokens for r in records),
        engine_hit_rate=engine_hits / prompt if prompt else 0.0,
        host_hit_rate=host_hits / prompt if prompt else 0.0,
        tier_hit_rates={t: n / prompt for t, n in by_tier.items()} if prompt else {},
        lower_tier_bytes=lower, lower_tier_blocks=lower_blocks,
        groups=groups,
        stored_bytes=sum(g.stored_bytes for g in groups),
        loaded_bytes=sum(g.loaded_bytes for g in groups),
        host_bytes_peak=max((sum(s.host_bytes_by_group) for s in metrics.samples), default=0),
        host_reserved_bytes_peak=peak_slots * slot_bytes,
        host_capacity_bytes=capacity,
        store_link_s=engine.transfers.busy_seconds[Direction.STORE],
        load_link_s=engine.transfers.busy_seconds[Direction.LOAD],
        flush_stall_s=metrics.flush_stall_s,
        cold_keys=engine.planner.stats.cold_stored_keys if engine.planner is not None else 0,
        ttft=Percentiles.of(ttft), clock_ttft=Percentiles.of(clock),
        makespan_s=max((r.finish_s or 0.0 for r in records), default=0.0),
        steps=metrics.steps, preemptions=metrics.preemptions,
        failed_loads=sum(r.failed_loads for r in records),
        corrupt_loads=sum(r.corrupt_loads for r in records),
        wrong_loaded_bytes=metrics.wrong_loaded_bytes,
        wrong_cached_bytes=metrics.wrong_cached_bytes,
        wrong_host_bytes=metrics.wrong_host_bytes,
        audited_host_blocks=metrics.audited_host_blocks,
        same_step_flushes=metrics.same_step_flushes,
        misplaced_store_blocks=metrics.misplaced_store_blocks,
        verified_blocks=metrics.verified_blocks, verified_bytes=metrics.verified_bytes,
        moved_stored_bytes=metrics.moved_stored_bytes,
        moved_loaded_bytes=metrics.moved_loaded_bytes,
        measured_transfer_s=metrics.measured_store_s + metrics.measured_load_s,
        wall_s=wall_s, samples=tuple(metrics.samples))


def modelled_ttft_s(record: RequestRecord, timing: TimingModel) -> float:
    """A request's modelled TTFT (module docstring): its prefill FLOPs, loaded bytes and
    promoted bytes at the modelled rates, without queueing."""
    return (timing.compute_seconds(record.prefill_flops)
            + timing.transfer_seconds(record.loaded_bytes)
            + record.promoted_bytes / timing.lower_bytes_per_s)


def _group(name: str, kind: str, traffic: GroupTraffic, peak: int, final: int) -> GroupSummary:
    return GroupSummary(name=name, kind=kind, stored_blocks=traffic.stored_blocks,
                        loaded_blocks=traffic.loaded_blocks, stored_bytes=traffic.stored_bytes,
                        loaded_bytes=traffic.loaded_bytes, host_bytes_peak=peak,
                        host_bytes_final=final)
