"""``kvoffload plan``: how much host memory (and disk) a model and its traffic need.

The question a deployment asks, answered by simulation on the user's own trace:

1. One store-everything run with unbounded host memory measures the *working set* (the
   most host memory the cache ever holds) and the *unbounded hit rate* (the share of prompt
   tokens host memory could serve if it never evicted).
2. For each cache policy, runs at host capacities that are shares of that working set give
   its hit-rate curve; the host memory per rank that reaches 50, 90 and 99 % of the
   unbounded hit rate is read off it (log-linear between grid points).
3. With ``--disk-capacity``, the same grid runs again with a disk tier of that size below
   host memory: what the disk adds at each host size.
4. Every point reports prefill tokens saved and modelled TTFT against no offloading.

The runs are independent and spread over ``--jobs`` processes (default: every core). The
answer ends with the ``--kv-transfer-config`` to paste into ``vllm serve``: the policy
that needs the least memory for 90 %, with that memory rounded up to a whole GiB per rank.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import textwrap
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvoffload.cli.common import (
    UsageError,
    WorkloadSpec,
    add_engine_options,
    add_output_options,
    add_workload_options,
    check_policy,
    check_preset,
    format_bytes,
    progress_bar,
    simulation_config,
    workload_spec,
)
from kvoffload.cli.sweep import UNBOUNDED_BYTES, format_rows, memory_to_reach
from kvoffload.cli.validate import check_common_args
from kvoffload.policies import cache_policy_names
from kvoffload.sim.simulation import (
    MAX_HOST_SLOTS,
    Mode,
    SimulationConfig,
    is_oracle,
    resolve,
    run_one,
)
from kvoffload.sim.summary import RunSummary

GiB = 1 << 30
TARGETS = (0.5, 0.9, 0.99)
"""Shares of the unbounded hit rate the plan sizes host memory for."""
DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
"""Host capacities tried, as shares of the working set."""
MAX_JOBS = 256

EPILOG = textwrap.dedent("""\
    examples:
      kvoffload plan                                        # gpt-oss-20b on the built-in chat
      kvoffload plan --preset llama3-8b --trace traffic.jsonl --limit 2000
      kvoffload plan --trace traffic.jsonl --disk-capacity 2TiB --plot plan.png --json

    Turn request logs into a trace first: kvoffload trace convert LOG -o traffic.jsonl.
    Every run is in accounting mode (no tensors move). Memory figures are per rank.
    """)


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
              jobs: int = 1, start: Callable[[str, int], Callable[[int], None]] | None = None,
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


def format_size(nbytes: int) -> str:
    """``nbytes`` in the size grammar (``kvoffload.sizes``): whole GiB, else MiB."""
    if nbytes % GiB == 0:
        return f"{nbytes // GiB}GiB"
    return f"{math.ceil(nbytes / (1 << 20))}MiB"


def plan_rows(plan: Plan) -> list[list[str]]:
    lower = any(p.disk for p in plan.points)
    rows = [["policy", "host per rank", "of working set", *(["disk"] if lower else []),
             "host hit", *(["disk hit"] if lower else []), "prefill saved", "TTFT",
             "speed-up"]]
    for p in sorted(plan.points, key=lambda p: (p.disk, p.policy, p.host_capacity_bytes)):
        rows.append([p.policy, format_bytes(p.host_capacity_bytes), f"{100 * p.fraction:g} %",
                     *(["yes" if p.disk else "-"] if lower else []),
                     f"{100 * p.host_hit_rate:.1f} %",
                     *([f"{100 * p.lower_hit_rate:.1f} %"] if lower else []),
                     f"{100 * p.prefill_saved:.1f} %", f"{1e3 * p.ttft_mean_s:.1f} ms",
                     f"{p.ttft_speedup:.2f}x"])
    return rows


def memory_rows(plan: Plan) -> list[list[str]]:
    rows = [["policy", *(f"{100 * t:g} % of unbounded" for t in TARGETS)]]
    top = max(p.host_capacity_bytes for p in plan.points)
    for policy, needs in plan.memory.items():
        rows.append([policy, *(format_bytes(v) if v is not None else f"> {format_bytes(top)}"
                               for v in needs.values())])
    return rows


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "plan", help="size host memory (and disk) for a model and its traffic",
        description="Simulate a model on a trace to find the host memory per rank each "
                    "cache policy needs for 50, 90 and 99 %% of the hit rate unbounded "
                    "memory would give, what a disk tier adds, and the resulting "
                    "--kv-transfer-config for vllm serve.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b",
                        help="model preset (see 'kvoffload presets'; default gpt-oss-20b)")
    parser.add_argument("--policy", default=",".join(cache_policy_names()),
                        help="comma-separated cache policies to compare (default: all a "
                             "deployment can use; add oracle, the simulator-only reference "
                             "that knows the workload's future, to see the limit)")
    parser.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                        metavar="SHARES",
                        help="host capacities tried, as shares of the working set "
                             "(default %(default)s)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="simulations run at once (default: every core)")
    add_workload_options(parser, default_limit=None)
    add_engine_options(parser)
    add_output_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_common_args(args)
    preset = check_preset(args.preset)
    policies = [check_policy(p.strip()) for p in args.policy.split(",") if p.strip()]
    if policies and all(is_oracle(p) for p in policies):
        raise UsageError("--policy: the oracle is a reference a deployment cannot run; "
                         "compare it with at least one other policy (e.g. value,oracle)")
    if not policies:
        raise UsageError("--policy: give at least one policy, e.g. lru,value")
    try:
        fractions = sorted({float(f) for f in args.fractions.split(",") if f.strip()})
    except ValueError:
        raise UsageError(f"--fractions: give shares such as 0.01,0.1,0.5 "
                         f"(got {args.fractions!r})") from None
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise UsageError("--fractions: every share must be in (0, 1]")
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    if not 1 <= jobs <= MAX_JOBS:
        raise UsageError(f"--jobs: must be between 1 and {MAX_JOBS}, got {jobs}")
    if args.remote_capacity is not None:
        raise UsageError("--remote-capacity: plan sizes host memory and a disk tier; a "
                         "shared remote tier is simulated by 'kvoffload simulate "
                         "--engines N' (docs/fleet.md)")
    spec = workload_spec(args, 0)
    base = simulation_config(args, preset=preset, policy=policies[0],
                             host_capacity=GiB, mode=Mode.ACCOUNTING)
    show = not (args.quiet or args.json)
    with progress_bar(show) as start:
        plan = make_plan(base, spec, policies=policies, fractions=fractions,
                         disk_bytes=base.disk_capacity_bytes, jobs=jobs,
                         start=start if show else None)
    if args.plot is not None:
        from kvoffload.cli.plots import plot_plan

        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    print(f"kvoffload plan: {plan.preset} on {plan.workload} ({plan.requests:,} requests, "
          "accounting mode, memory per rank)")
    print(f"  working set (store everything, never evict): "
          f"{format_bytes(plan.working_set_bytes)}; unbounded host hit rate "
          f"{100 * plan.unbounded_hit_rate:.1f} % of prompt tokens")
    print()
    print(format_rows(plan_rows(plan)))
    print()
    print("Host memory per rank to reach a share of the unbounded hit rate:")
    print(format_rows(memory_rows(plan)))
    print()
    print(f"Recommended: {plan.recommended_policy} with "
          f"{format_bytes(plan.recommended_host_bytes)} of host memory per rank "
          "(90 % of unbounded, rounded up). For vllm serve:")
    print(f"  --kv-transfer-config '{json.dumps(plan.kv_transfer_config)}'")
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return 0
