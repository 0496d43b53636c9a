"""``kvoffload sweep``: a grid of simulations (preset x policy x host capacity)."""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from kvoffload.cli.common import (
    UsageError,
    WorkloadSpec,
    add_engine_options,
    add_hint_option,
    add_output_options,
    add_workload_options,
    check_policy,
    check_preset,
    format_bytes,
    format_seconds,
    parse_sizes,
    progress_bar,
    simulation_config,
    workload_spec,
)
from kvoffload.cli.validate import check_common_args
from kvoffload.models.presets import PRESETS
from kvoffload.sim.simulation import Mode, SimulationConfig, resolve, run_one
from kvoffload.sim.summary import RunSummary

EPILOG = textwrap.dedent("""\
    examples:
      kvoffload sweep                                          # gpt-oss-20b, chat, value vs lru
      kvoffload sweep --preset all --policy lru --host-capacity 8GiB,32GiB,128GiB \\
          --trace ../shared/traces/mooncake_conversation_trace.jsonl --limit 2000
      kvoffload sweep --preset llama3-8b,gemma3-27b --seeds 0,1,2 --plot sweep.png --json
      kvoffload sweep --preset nemotron-h-8b --workload agentic --policy lru,value,oracle \
          --capacity-fraction 0.05,0.1,0.2,0.5

    Every point runs in accounting mode (no tensors move). The run without offloading is
    done once per preset and seed and shared by its points. Figures are means over seeds.
    """)


UNBOUNDED_BYTES = 1 << 50
"""Host capacity of the store-everything reference run (1 PiB: nothing is evicted)."""


@dataclass(frozen=True)
class SweepPoint:
    """One grid point, averaged over seeds.

    ``capacity_fraction`` is the host capacity as a share of the preset's store-everything
    working set when the grid was given that way (``--capacity-fraction``), else 0.
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
              start: Callable[[str, int], Callable[[int], None]] | None = None,
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


def goal_table(points: Sequence[SweepPoint], references: dict[str, Reference],
               share: float = 0.9) -> list[list[str]]:
    """Per (preset, policy): the host memory to reach ``share`` of the unbounded host hit
    rate, and its ratio to store-everything LRU's (header first)."""
    rows = [["preset", "policy", "unbounded hit", f"target ({100 * share:.0f} %)",
             "memory to reach", "vs lru"]]
    curves: dict[tuple[str, str], list[SweepPoint]] = {}
    for p in points:
        curves.setdefault((p.preset, p.policy), []).append(p)
    for (preset, policy), curve in curves.items():
        ref = references.get(preset)
        if ref is None:
            continue
        target = share * ref.host_hit_rate
        memory = memory_to_reach(curve, target)
        lru = curves.get((preset, "lru"))
        lru_memory = memory_to_reach(lru, target) if lru else None
        ratio = (f"{memory / lru_memory:.2f}" if memory is not None and lru_memory
                 else "n/a")
        rows.append([preset, policy, f"{100 * ref.host_hit_rate:.2f} %",
                     f"{100 * target:.2f} %",
                     format_bytes(memory) if memory is not None else
                     f"> {format_bytes(max(p.host_capacity_bytes for p in curve))}", ratio])
    return rows


def sweep_table(points: Sequence[SweepPoint]) -> list[list[str]]:
    """Rows of the sweep's table (header first); "offload hit" counts blocks loaded
    through host memory, "of which lower" those promoted from a disk or remote tier."""
    lower = any(p.lower_hit_rate for p in points)
    fractions = any(p.capacity_fraction for p in points)
    rows = [["preset", "policy", "host", *(["of working set"] if fractions else []),
             "engine hit", "offload hit",
             *(["of which lower"] if lower else []), "prefill computed", "vs no offload",
             "TTFT mean", "no offload", "speed-up", "host peak"]]
    for p in points:
        saved = (p.prefill_tokens_computed / p.baseline_prefill_tokens_computed
                 if p.baseline_prefill_tokens_computed else 0.0)
        rows.append([p.preset, p.policy, format_bytes(p.host_capacity_bytes),
                     *([f"{100 * p.capacity_fraction:g} %"] if fractions else []),
                     f"{100 * p.engine_hit_rate:.1f} %", f"{100 * p.host_hit_rate:.2f} %",
                     *([f"{100 * p.lower_hit_rate:.1f} %"] if lower else []),
                     f"{p.prefill_tokens_computed:,.0f}", f"{100 * saved:.0f} %",
                     format_seconds(p.ttft_mean_s), format_seconds(p.baseline_ttft_mean_s),
                     f"{p.ttft_speedup:.2f}x", format_bytes(p.host_bytes_peak)])
    return rows


def format_rows(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1])]
                               + [c.rjust(w) for c, w in zip(r[2:], widths[2:], strict=True)])
                     for r in rows)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "sweep", help="run a grid of presets x policies x host capacities",
        description="Run a grid of simulations (accounting mode) and tabulate and plot hit "
                    "rate and modelled TTFT against host capacity.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b",
                        help="comma-separated presets, or 'all' (default gpt-oss-20b)")
    parser.add_argument("--policy", default="value,lru",
                        help="comma-separated cache policies (default value,lru); oracle "
                             "is the reference that knows the workload's future "
                             "(docs/policy.md)")
    parser.add_argument("--host-capacity", default="1GiB,4GiB,16GiB,64GiB", metavar="SIZES",
                        help="comma-separated host capacities (default 1GiB,4GiB,16GiB,64GiB)")
    parser.add_argument("--capacity-fraction", metavar="SHARES",
                        help="comma-separated host capacities as shares of each preset's "
                             "store-everything working set (e.g. 0.01,0.02,0.05,0.5); an "
                             "unbounded LRU run measures it first and gives the unbounded hit "
                             "rate; replaces --host-capacity")
    parser.add_argument("--seeds", default="0", help="comma-separated workload seeds "
                        "(built-in workloads; default 0)")
    add_workload_options(parser, default_limit=None)
    add_hint_option(parser)
    add_engine_options(parser)
    add_output_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_common_args(args)
    presets = list(PRESETS) if args.preset == "all" else [
        check_preset(p.strip()) for p in args.preset.split(",") if p.strip()]
    policies = [check_policy(p.strip()) for p in args.policy.split(",") if p.strip()]
    capacities = sorted(parse_sizes(args.host_capacity, "--host-capacity"))
    fractions: list[float] = []
    if args.capacity_fraction:
        try:
            fractions = sorted(float(f) for f in args.capacity_fraction.split(",")
                               if f.strip())
        except ValueError:
            raise UsageError("--capacity-fraction: give shares such as 0.01,0.1,0.5 "
                             f"(got {args.capacity_fraction!r})") from None
        if not fractions or any(not 0 < f <= 1 for f in fractions):
            raise UsageError("--capacity-fraction: every share must be in (0, 1]")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds: give integers, e.g. 0,1,2 (got {args.seeds!r})") from None
    if not presets or not seeds or not policies:
        raise UsageError("--preset, --policy and --seeds need at least one value")
    spec = workload_spec(args, seeds[0])
    base = simulation_config(args, preset=presets[0], policy=policies[0],
                             host_capacity=capacities[0], mode=Mode.ACCOUNTING)
    references: dict[str, Reference] = {}
    with progress_bar(not (args.quiet or args.json)) as start:
        points = run_sweep(base, spec, presets=presets, policies=policies,
                           capacities=capacities, seeds=seeds,
                           start=start if not (args.quiet or args.json) else None,
                           fractions=fractions, references=references)
    title = f"{spec.label_for(seeds)}: {', '.join(presets)}"
    if args.plot is not None:
        from kvoffload.cli.plots import plot_sweep

        plot_sweep(points, args.plot, title)
    if args.json:
        print(json.dumps({"workload": spec.label_for(seeds), "seeds": seeds,
                          "sessions": spec.sessions,
                          "host_accounting": base.host_accounting,
                          "references": {k: r.to_dict() for k, r in references.items()},
                          "points": [p.to_dict() for p in points]}, indent=2))
        return 0
    per_run = "requests per run" + (" on average" if len(seeds) > 1 else "")
    print(f"kvoffload sweep: {title} ({points[0].requests} {per_run}, accounting mode)")
    print(format_rows(sweep_table(points)))
    if references:
        print()
        print("Host memory to reach 90 % of the unbounded store-everything host hit rate:")
        print(format_rows(goal_table(points, references)))
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return 0
