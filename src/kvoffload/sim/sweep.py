"""A grid of simulations: preset x cache policy x host capacity, averaged over seeds.

``run_sweep(base, spec, presets=..., policies=..., capacities=..., seeds=...)`` runs every
point of the grid in accounting mode (no tensors move) on the requests ``spec`` gives (each
seed's loaded once and shared by every run) and returns one ``SweepPoint`` per (preset,
policy, capacity), in that order, its figures the mean over the seeds. The run without
offloading is made once per preset and seed and shared by that preset's points.

With ``fractions``, each preset's capacities are shares of its *working set*: a first
store-everything run with unbounded host memory (``UNBOUNDED_BYTES``, LRU, nothing evicted)
measures it and the unbounded hit rate (a ``Reference``); a capacity is never below one host
slot of the preset's largest group.

``memory_to_reach(curve, target)`` reads the host capacity at which one (preset, policy)
curve first reaches a host hit rate, log-linearly between grid points; ``kvoffload.sim.plan``
uses it too. The optional ``start(label, total) -> update(done)`` callback reports each
run's progress; nothing here prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from kvoffload.sim.simulation import Mode, SimulationConfig, resolve, run_one
from kvoffload.sim.summary import RunSummary
from kvoffload.sizes import format_bytes
from kvoffload.workloads.spec import WorkloadSpec

UNBOUNDED_BYTES = 1 << 50
"""Host capacity of the store-everything reference run (1 PiB: nothing is evicted)."""

ProgressStart = Callable[[str, int], Callable[[int], None]]
"""``start(label, total)`` announces a run of ``total`` requests and returns its
``update(done)``."""


@dataclass(frozen=True)
class SweepPoint:
    """One grid point, averaged over seeds.

    ``capacity_fraction`` is the host capacity as a share of the preset's store-everything
    working set when the grid was given that way (``run_sweep``'s ``fractions``), else 0.
    ``requests`` is the mean number of requests of one run (seeds may differ in it).
    """

    preset: str
    policy: str
    host_capacity_bytes: int
    engine_hit_rate: float
    host_hit_rate: float
    lower_hit_rate: float
    prefill_tokens_computed: float
    baseline_prefill_tokens_computed: float
    ttft_mean_s: float
    baseline_ttft_mean_s: float
    host_bytes_peak: float
    stored_bytes: float
    loaded_bytes: float
    requests: int
    wall_s: float
    capacity_fraction: float = 0.0

    @property
    def prefill_tokens_saved(self) -> float:
        return self.baseline_prefill_tokens_computed - self.prefill_tokens_computed

    @property
    def hit_rate(self) -> float:
        return self.engine_hit_rate + self.host_hit_rate

    @property
    def ttft_speedup(self) -> float:
        return self.baseline_ttft_mean_s / self.ttft_mean_s if self.ttft_mean_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        out["ttft_speedup"] = self.ttft_speedup
        out["prefill_tokens_saved"] = self.prefill_tokens_saved
        return out


@dataclass(frozen=True)
class Reference:
    """A preset's store-everything run with unbounded host memory (LRU, nothing evicted).

    Attributes:
        working_set_bytes: the most host memory it held (under the run's accounting).
        host_hit_rate: the share of prompt tokens it served from host memory: the
            unbounded-cache hit rate every policy is measured against.
    """

    preset: str
    working_set_bytes: float
    host_hit_rate: float
    hit_rate: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CurvePoint(Protocol):
    """One point of a hit-rate curve (a ``SweepPoint``, a plan's point)."""

    @property
    def host_capacity_bytes(self) -> int: ...

    @property
    def host_hit_rate(self) -> float: ...


def memory_to_reach(points: Sequence[CurvePoint], target: float) -> float | None:
    """The host capacity at which the host hit rate first reaches ``target``, linearly
    interpolated between grid points (in log capacity); ``None`` if no point reaches it.

    ``points`` are one (preset, policy) curve.
    """
    pts = sorted(points, key=lambda p: p.host_capacity_bytes)
    previous: CurvePoint | None = None
    for p in pts:
        if p.host_hit_rate >= target:
            if previous is None or p.host_hit_rate == previous.host_hit_rate:
                return float(p.host_capacity_bytes)
            share = (target - previous.host_hit_rate) / (p.host_hit_rate
                                                         - previous.host_hit_rate)
            lo, hi = math.log(previous.host_capacity_bytes), math.log(p.host_capacity_bytes)
            return math.exp(lo + share * (hi - lo))
        previous = p
    return None


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def run_sweep(base: SimulationConfig, spec: WorkloadSpec, *, presets: Sequence[str],
              policies: Sequence[str], capacities: Sequence[int], seeds: Sequence[int],
              start: ProgressStart | None = None,
              fractions: Sequence[float] = (),
              references: dict[str, Reference] | None = None,
              ) -> list[SweepPoint]:
    """Run the grid; return one point per (preset, policy, capacity).

    With ``fractions``, each preset's capacities are those shares of its store-everything
    working set, measured first by an unbounded LRU run (stored in ``references`` when a
    dict is given); ``capacities`` is then ignored. A dict given as ``references`` is
    filled whenever such a run is made.
    """
    points = []
    # The requests do not depend on the preset: load each seed's once for every run.
    workloads = [replace(spec, seed=seed).load() for seed in seeds]
    # Progress totals: a built-in workload is a list already; a trace is counted once.
    totals = dict.fromkeys(seeds, 0)
    if start is not None:
        streamed = spec.count() if spec.trace is not None else 0
        totals = {seed: len(w) if isinstance(w, Sequence) else streamed
                  for seed, w in zip(seeds, workloads, strict=True)}
    for preset in presets:
        preset_base = replace(base, preset=preset, mode=Mode.ACCOUNTING, baseline=False)
        preset_caps: list[tuple[int, float]] = [(c, 0.0) for c in capacities]
        if fractions:
            runs = []
            for seed, workload in zip(seeds, workloads, strict=True):
                config = replace(preset_base, eviction_policy="lru",
                                 host_capacity_bytes=UNBOUNDED_BYTES)
                label = f"{preset} store everything, unbounded, seed {seed}"
                runs.append(run_one(config, workload,
                                    progress=start(label, totals[seed]) if start else None))
            charged = base.host_accounting == "bytes"
            ref = Reference(
                preset=preset,
                working_set_bytes=_mean([r.host_bytes_peak if charged
                                         else r.host_reserved_bytes_peak for r in runs]),
                host_hit_rate=_mean([r.host_hit_rate for r in runs]),
                hit_rate=_mean([r.hit_rate for r in runs]))
            if references is not None:
                references[preset] = ref
            # A capacity holds at least one block of the largest group.
            floor = resolve(preset_base, preset_base.layout())[0].host_slot_bytes
            preset_caps = [(max(floor, int(f * ref.working_set_bytes)), f) for f in fractions]
        baselines: list[RunSummary] = []
        for seed, workload in zip(seeds, workloads, strict=True):
            progress = (start(f"{preset} no offload seed {seed}", totals[seed]) if start
                        else None)
            baselines.append(run_one(preset_base, workload, offload=False,
                                     progress=progress))
        for policy in policies:
            for capacity, fraction in preset_caps:
                runs = []
                for seed, workload in zip(seeds, workloads, strict=True):
                    config = replace(preset_base, eviction_policy=policy,
                                     host_capacity_bytes=capacity)
                    label = f"{preset} {policy} {format_bytes(capacity)} seed {seed}"
                    runs.append(run_one(config, workload,
                                        progress=start(label, totals[seed]) if start
                                        else None))
                points.append(SweepPoint(
                    preset=preset, policy=policy, host_capacity_bytes=capacity,
                    engine_hit_rate=_mean([r.engine_hit_rate for r in runs]),
                    host_hit_rate=_mean([r.host_hit_rate for r in runs]),
                    lower_hit_rate=_mean([sum(v for t, v in r.tier_hit_rates.items()
                                              if t != "host") for r in runs]),
                    prefill_tokens_computed=_mean([r.prefill_tokens_computed for r in runs]),
                    baseline_prefill_tokens_computed=_mean(
                        [r.prefill_tokens_computed for r in baselines]),
                    ttft_mean_s=_mean([r.ttft.mean for r in runs]),
                    baseline_ttft_mean_s=_mean([r.ttft.mean for r in baselines]),
                    host_bytes_peak=_mean([r.host_bytes_peak for r in runs]),
                    stored_bytes=_mean([r.stored_bytes for r in runs]),
                    loaded_bytes=_mean([r.loaded_bytes for r in runs]),
                    requests=round(_mean([r.requests for r in runs])),
                    wall_s=sum(r.wall_s for r in runs),
                    capacity_fraction=fraction))
    return points
