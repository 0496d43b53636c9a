"""``kvoffload sweep``: a grid of simulations (preset x policy x host capacity).

Parses and checks the options, runs ``kvoffload.sim.sweep.run_sweep`` and prints its points
(a table, or one JSON object with ``--json``) and, with ``--plot``, writes the curves.
"""

from __future__ import annotations

import argparse
import json
import textwrap

from kvoffload.cli.common import (
    UsageError,
    add_engine_options,
    add_hint_option,
    add_output_options,
    add_workload_options,
    check_policy,
    check_preset,
    parse_items,
    parse_shares,
    parse_sizes,
    progress_bar,
    simulation_config,
    whole_number,
    workload_spec,
)
from kvoffload.cli.plots import plot_sweep
from kvoffload.cli.tables import format_rows, goal_table, sweep_table
from kvoffload.cli.validate import check_common_args
from kvoffload.config import DEFAULT_POLICY
from kvoffload.errors import shown
from kvoffload.models.presets import PRESETS
from kvoffload.sim.simulation import Mode
from kvoffload.sim.sweep import Reference, run_sweep

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


def parse_seed(text: str) -> int:
    """One ``--seeds`` item: a whole number in ASCII digits."""
    try:
        return whole_number(text)
    except argparse.ArgumentTypeError:
        raise UsageError(f"--seeds: give integers in ASCII digits, e.g. 0,1,2 (got "
                         f"{shown(text)})") from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "sweep", help="run a grid of presets x policies x host capacities",
        description="Run a grid of simulations (accounting mode) and tabulate and plot hit "
                    "rate and modelled TTFT against host capacity.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b",
                        help="comma-separated presets, or 'all' (default gpt-oss-20b)")
    parser.add_argument("--policy", default=f"{DEFAULT_POLICY},lru",
                        help=f"comma-separated cache policies (default {DEFAULT_POLICY},lru); "
                             "oracle is the reference that knows the workload's future "
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


MAX_SEEDS = 64
"""The most workload seeds one ``sweep --seeds`` runs: every seed runs the whole grid
again, so 64 already multiplies its time by 64 (``docs/cli.md``)."""


def run(args: argparse.Namespace) -> int:
    check_common_args(args)
    presets = list(PRESETS) if args.preset == "all" else [
        check_preset(p) for p in parse_items(args.preset, "--preset", "gpt-oss-20b,llama3-8b")]
    policies = [check_policy(p) for p in parse_items(args.policy, "--policy", "value,lru")]
    capacities = sorted(parse_sizes(args.host_capacity, "--host-capacity"))
    fractions: list[float] = []
    if args.capacity_fraction is not None:
        fractions = parse_shares(args.capacity_fraction, "--capacity-fraction")
    seeds = [parse_seed(s) for s in parse_items(args.seeds, "--seeds", "0,1,2")]
    if len(seeds) > MAX_SEEDS:
        raise UsageError(f"--seeds: at most {MAX_SEEDS} seeds (got {len(seeds):,}); every "
                         "seed runs the whole grid again")
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
