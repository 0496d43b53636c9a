"""Capacity planning: how much host memory (and disk) a model and its traffic need.

The question a deployment asks, answered by simulation on the user's own requests.
``make_plan(base, spec, policies=...)`` does, in accounting mode (no tensors move):

1. One store-everything run with unbounded host memory measures the *working set* (the
   most host memory the cache ever holds) and the *unbounded hit rate* (the share of prompt
   tokens host memory could serve if it never evicted); one run without offloading is the
   baseline.
2. For each cache policy, runs at host capacities that are ``fractions`` of that working
   set give its hit-rate curve; the host memory per rank that reaches each of ``TARGETS``
   (50, 90 and 99 % of the unbounded hit rate) is read off it (log-linear between grid
   points, ``kvoffload.sim.sweep.memory_to_reach``).
3. With ``disk_bytes``, the same grid runs again with a disk tier of that size below host
   memory: what the disk adds at each host size.
4. Every point reports prefill tokens saved and modelled TTFT against no offloading.

The runs are independent and spread over ``jobs`` processes; the plan is the same for any
``jobs``. The returned ``Plan`` recommends the deployable policy (never the oracle, a
reference that knows the future) that needs the least memory for 90 %, with that memory
rounded up to a whole GiB per rank, and carries the ``--kv-transfer-config`` for
``vllm serve`` that deploys it (``kv_transfer_config``). Nothing here prints.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvoffload.sim.simulation import (
    MAX_HOST_SLOTS,
    Mode,
    SimulationConfig,
    is_oracle,
    resolve,
    run_one,
)
from kvoffload.sim.summary import RunSummary
from kvoffload.sim.sweep import UNBOUNDED_BYTES, ProgressStart, memory_to_reach
from kvoffload.sizes import GiB, format_size
from kvoffload.workloads.spec import WorkloadSpec

TARGETS = (0.5, 0.9, 0.99)
"""Shares of the unbounded hit rate the plan sizes host memory for."""
DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
"""Host capacities tried, as shares of the working set."""


@dataclass(frozen=True)
class PlanPoint:
    """One simulated host capacity (with or without the disk tier) for one policy."""

    policy: str
    host_capacity_bytes: int
    fraction: float
    disk: bool
    host_hit_rate: float
    lower_hit_rate: float
    prefill_saved: float
    """Share of the no-offload prefill tokens this run did not compute."""
    ttft_mean_s: float
    ttft_speedup: float


@dataclass(frozen=True)
class Plan:
    """The plan: the working set, every point, the memory per target and policy, and the
    recommendation with its ``--kv-transfer-config``."""

    preset: str
    workload: str
    requests: int
    working_set_bytes: float
    unbounded_hit_rate: float
    baseline_ttft_mean_s: float
    points: tuple[PlanPoint, ...]
    memory: dict[str, dict[str, float | None]]
    """Per policy, per target (``"50%"``...): host memory per rank to reach it (None: the
    grid never did)."""
    recommended_policy: str
    recommended_host_bytes: int
    kv_transfer_config: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["points"] = [asdict(p) for p in self.points]
        return out


@functools.lru_cache(maxsize=2)
def _workload(spec: WorkloadSpec) -> Any:
    """The requests of ``spec``, loaded once per process."""
    loaded = spec.load()
    return loaded if isinstance(loaded, Sequence) else list(loaded)


def _run(config: SimulationConfig, spec: WorkloadSpec, offload: bool = True) -> RunSummary:
    """One run (module level, so a process pool can call it)."""
    return run_one(config, _workload(spec), offload=offload)


def _point(grid_point: tuple[str, int, float, bool], run: RunSummary,
           baseline: RunSummary) -> PlanPoint:
    policy, capacity, fraction, disk = grid_point
    base_prefill = baseline.prefill_tokens_computed
    return PlanPoint(
        policy=policy, host_capacity_bytes=capacity, fraction=fraction, disk=disk,
        host_hit_rate=run.host_hit_rate,
        lower_hit_rate=sum(v for t, v in run.tier_hit_rates.items() if t != "host"),
        prefill_saved=(1 - run.prefill_tokens_computed / base_prefill) if base_prefill else 0.0,
        ttft_mean_s=run.ttft.mean,
        ttft_speedup=baseline.ttft.mean / run.ttft.mean if run.ttft.mean else 0.0)


def make_plan(base: SimulationConfig, spec: WorkloadSpec, *, policies: Sequence[str],
              fractions: Sequence[float] = DEFAULT_FRACTIONS, disk_bytes: int | None = None,
              jobs: int = 1, start: ProgressStart | None = None,
              ) -> Plan:
    """Run the plan's simulations (module docstring) and read the answer off them."""
    base = replace(base, mode=Mode.ACCOUNTING, baseline=False, disk_capacity_bytes=None,
                   remote_capacity_bytes=None)
    pool = ProcessPoolExecutor(jobs) if jobs > 1 else None
    try:
        def run_all(configs: list[tuple[SimulationConfig, bool]], label: str,
                    ) -> list[RunSummary]:
            update = start(label, len(configs)) if start is not None else None
            if pool is None:
                out = []
                for i, (config, offload) in enumerate(configs):
                    out.append(_run(config, spec, offload))
                    if update is not None:
                        update(i + 1)
                return out
            futures = {pool.submit(_run, config, spec, offload): i
                       for i, (config, offload) in enumerate(configs)}
            results: list[RunSummary | None] = [None] * len(configs)
            for done, future in enumerate(as_completed(futures), 1):
                results[futures[future]] = future.result()
                if update is not None:
                    update(done)
            return [r for r in results if r is not None]

        slot_bytes = resolve(base, base.layout())[0].host_slot_bytes
        # Unbounded: nothing is ever evicted (1 PiB, or the most slots a simulation keeps
        # for a model with tiny blocks).
        unbounded = replace(base, eviction_policy="lru", host_capacity_bytes=min(
            UNBOUNDED_BYTES, MAX_HOST_SLOTS * slot_bytes))
        reference, baseline = run_all([(unbounded, True), (base, False)],
                                      "working set and no-offload runs")
        charged = base.host_accounting == "bytes"
        working_set = (reference.host_bytes_peak if charged
                       else reference.host_reserved_bytes_peak)
        grid = [(policy, max(slot_bytes, int(f * working_set)), f, disk)
                for disk in ((False, True) if disk_bytes else (False,))
                for policy in policies for f in fractions]
        configs = [(replace(base, eviction_policy=policy, host_capacity_bytes=capacity,
                            disk_capacity_bytes=disk_bytes if disk else None), True)
                   for policy, capacity, _, disk in grid]
        runs = run_all(configs, f"{len(configs)} plan runs")
    finally:
        if pool is not None:
            pool.shutdown()
    points = tuple(_point(g, run, baseline) for g, run in zip(grid, runs, strict=True))
    memory = {policy: {f"{100 * t:g}%": _memory(points, policy, t * reference.host_hit_rate)
                       for t in TARGETS} for policy in policies}
    # The oracle is a reference (it knows the workload's future): never the recommendation.
    deployable = [p for p in policies if not is_oracle(p)] or list(policies)
    best = min(deployable, key=lambda p: (math.inf if memory[p]["90%"] is None
                                          else memory[p]["90%"], policies.index(p)))
    need = memory[best]["90%"]
    host = max(GiB, math.ceil((need if need is not None else working_set) / GiB) * GiB)
    return Plan(preset=base.preset, workload=spec.label_for([spec.seed]),
                requests=reference.requests, working_set_bytes=working_set,
                unbounded_hit_rate=reference.host_hit_rate,
                baseline_ttft_mean_s=baseline.ttft.mean, points=points, memory=memory,
                recommended_policy=best, recommended_host_bytes=host,
                kv_transfer_config=kv_transfer_config(best, host, disk_bytes))


def _memory(points: Sequence[PlanPoint], policy: str, target: float) -> float | None:
    """Host memory at which ``policy`` (without the disk tier) reaches ``target``."""
    return memory_to_reach([p for p in points if p.policy == policy and not p.disk], target)


def kv_transfer_config(policy: str, host_bytes: int, disk_bytes: int | None) -> dict[str, Any]:
    """What ``vllm serve --kv-transfer-config`` takes for this plan (``docs/vllm.md``)."""
    extra: dict[str, Any] = {"host_memory_bytes": f"{host_bytes // GiB}GiB",
                             "eviction_policy": policy}
    if disk_bytes:
        extra |= {"tiers": ["host", "disk"], "disk_path": "/path/to/nvme/kvoffload",
                  "disk_capacity": format_size(disk_bytes)}
    return {"kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
