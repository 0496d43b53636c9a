"""``kvoffload sweep``: a grid of simulations (preset x policy x host capacity)."""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Callable, Sequence
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
    format_seconds,
    parse_sizes,
    progress_bar,
    simulation_config,
    workload_spec,
)
from kvoffload.engine.model_presets import PRESETS
from kvoffload.engine.simulation import Mode, SimulationConfig, run_one
from kvoffload.engine.summary import RunSummary

EPILOG = textwrap.dedent("""\
    examples:
      kvoffload sweep                                          # gpt-oss-20b, chat, lru vs arc
      kvoffload sweep --preset all --policy lru --host-capacity 8GiB,32GiB,128GiB \\
          --trace ../shared/traces/mooncake_conversation_trace.jsonl --limit 2000
      kvoffload sweep --preset llama3-8b,gemma3-27b --seeds 0,1,2 --plot sweep.png --json

    Every point runs in accounting mode (no tensors move). The run without offloading is
    done once per preset and seed and shared by its points. Figures are means over seeds.
    """)


@dataclass(frozen=True)
class SweepPoint:
    """One grid point, averaged over seeds."""

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
        return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def run_sweep(base: SimulationConfig, spec: WorkloadSpec, *, presets: Sequence[str],
              policies: Sequence[str], capacities: Sequence[int], seeds: Sequence[int],
              start: Callable[[str, int], Callable[[int], None]] | None = None
              ) -> list[SweepPoint]:
    """Run the grid; return one point per (preset, policy, capacity)."""
    points = []
    total = spec.count() if start is not None else 0
    for preset in presets:
        baselines: list[RunSummary] = []
        workloads = []
        for seed in seeds:
            workload = replace(spec, seed=seed).load()
            workloads.append(workload)
            config = replace(base, preset=preset, mode=Mode.ACCOUNTING, baseline=False)
            progress = start(f"{preset} no offload seed {seed}", total) if start else None
            baselines.append(run_one(config, workload, offload=False, progress=progress))
        for policy in policies:
            for capacity in capacities:
                runs = []
                for seed, workload in zip(seeds, workloads, strict=True):
                    config = replace(base, preset=preset, mode=Mode.ACCOUNTING, baseline=False,
                                     eviction_policy=policy, host_capacity_bytes=capacity)
                    label = f"{preset} {policy} {format_bytes(capacity)} seed {seed}"
                    runs.append(run_one(config, workload,
                                        progress=start(label, total) if start else None))
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
                    requests=runs[0].requests, wall_s=sum(r.wall_s for r in runs)))
    return points


def sweep_table(points: Sequence[SweepPoint]) -> list[list[str]]:
    """Rows of the sweep's table (header first); "offload hit" counts blocks loaded
    through host memory, "of which lower" those promoted from a disk or remote tier."""
    lower = any(p.lower_hit_rate for p in points)
    rows = [["preset", "policy", "host", "engine hit", "offload hit",
             *(["of which lower"] if lower else []), "prefill computed", "vs no offload",
             "TTFT mean", "no offload", "speed-up", "host peak"]]
    for p in points:
        saved = (p.prefill_tokens_computed / p.baseline_prefill_tokens_computed
                 if p.baseline_prefill_tokens_computed else 0.0)
        rows.append([p.preset, p.policy, format_bytes(p.host_capacity_bytes),
                     f"{100 * p.engine_hit_rate:.1f} %", f"{100 * p.host_hit_rate:.1f} %",
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
    parser.add_argument("--policy", default="lru,arc",
                        help="comma-separated eviction policies (default lru,arc)")
    parser.add_argument("--host-capacity", default="1GiB,4GiB,16GiB,64GiB", metavar="SIZES",
                        help="comma-separated host capacities (default 1GiB,4GiB,16GiB,64GiB)")
    parser.add_argument("--seeds", default="0", help="comma-separated workload seeds "
                        "(built-in workloads; default 0)")
    add_workload_options(parser, default_limit=None)
    add_engine_options(parser)
    add_output_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    presets = list(PRESETS) if args.preset == "all" else [
        check_preset(p.strip()) for p in args.preset.split(",") if p.strip()]
    policies = [check_policy(p.strip()) for p in args.policy.split(",") if p.strip()]
    capacities = sorted(parse_sizes(args.host_capacity, "--host-capacity"))
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds: give integers, e.g. 0,1,2 (got {args.seeds!r})") from None
    if not presets or not seeds or not policies:
        raise UsageError("--preset, --policy and --seeds need at least one value")
    spec = workload_spec(args, seeds[0])
    base = simulation_config(args, preset=presets[0], policy=policies[0],
                             host_capacity=capacities[0], mode=Mode.ACCOUNTING)
    with progress_bar(not (args.quiet or args.json)) as start:
        points = run_sweep(base, spec, presets=presets, policies=policies,
                           capacities=capacities, seeds=seeds,
                           start=start if not (args.quiet or args.json) else None)
    title = f"{spec.label}: {', '.join(presets)}"
    if args.plot is not None:
        from kvoffload.cli.plots import plot_sweep

        plot_sweep(points, args.plot, title)
    if args.json:
        print(json.dumps({"workload": spec.label, "seeds": seeds,
                          "points": [p.to_dict() for p in points]}, indent=2))
        return 0
    print(f"kvoffload sweep: {title} ({points[0].requests} requests per run, accounting mode)")
    print(format_rows(sweep_table(points)))
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return 0
