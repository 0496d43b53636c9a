"""``kvoffload plan``: how much host memory (and disk) a model and its traffic need.

Parses and checks the options, runs ``kvoffload.sim.plan.make_plan`` (what the plan
simulates and how it reads the answer: that module's docstring) on ``--jobs`` processes
(default: every core), and prints the plan: a report ending with the
``--kv-transfer-config`` to paste into ``vllm serve``, or one JSON object with ``--json``;
``--plot`` writes its curves.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap

from kvoffload.cli.common import (
    UsageError,
    add_engine_options,
    add_output_options,
    add_workload_options,
    check_policy,
    check_preset,
    parse_shares,
    progress_bar,
    simulation_config,
    whole_number,
    workload_spec,
)
from kvoffload.cli.plots import plot_plan
from kvoffload.cli.tables import format_rows, memory_rows, plan_rows
from kvoffload.cli.validate import check_common_args
from kvoffload.policies import cache_policy_names
from kvoffload.sim.plan import DEFAULT_FRACTIONS, make_plan
from kvoffload.sim.simulation import Mode, is_oracle
from kvoffload.sizes import GiB, format_bytes

MAX_JOBS = 256
"""The most ``--jobs`` accepted."""

EPILOG = textwrap.dedent("""\
    examples:
      kvoffload plan                                        # gpt-oss-20b on the built-in chat
      kvoffload plan --preset llama3-8b --trace traffic.jsonl --limit 2000
      kvoffload plan --trace traffic.jsonl --disk-capacity 2TiB --plot plan.png --json

    Turn request logs into a trace first: kvoffload trace convert LOG -o traffic.jsonl.
    Every run is in accounting mode (no tensors move). Memory figures are per rank.
    """)


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
    parser.add_argument("--jobs", type=whole_number, default=None, metavar="N",
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
    fractions = parse_shares(args.fractions, "--fractions")
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
