"""``kvoffload simulate``: one workload through the engine, with and without offloading."""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Iterable
from dataclasses import replace

from kvoffload.cli.common import (
    add_engine_options,
    add_hint_option,
    add_output_options,
    add_workload_options,
    check_policy,
    check_preset,
    progress_bar,
    real_number,
    simulation_config,
    whole_number,
    workload_spec,
)
from kvoffload.cli.plots import plot_simulation
from kvoffload.cli.report import fleet_dict, fleet_text, simulation_dict, simulation_text
from kvoffload.cli.validate import check_fleet_args, check_simulate_args, simulate_mac_key
from kvoffload.config import DEFAULT_POLICY
from kvoffload.sim.fleet import MAX_ENGINES, ROUTER_HELP, FleetConfig, Router, simulate_fleet
from kvoffload.sim.simulation import Mode, SimulationConfig, simulate
from kvoffload.sizes import parse_size
from kvoffload.workloads.request import WorkloadRequest
from kvoffload.workloads.spec import WorkloadSpec

EPILOG = textwrap.dedent("""\
    examples:
      kvoffload simulate                                   # defaults: gpt-oss-20b, chat, bytes mode
      kvoffload simulate --preset nemotron-h-8b --workload agentic
      kvoffload simulate --engine-tokens 16k --host-capacity 4GiB --policy arc
      kvoffload simulate --host-capacity 2GiB --disk-capacity 64GiB   # a disk tier below
      kvoffload simulate --host-capacity 64MiB --disk-capacity 1GiB --disk-path /tmp/kv
                                                           # a real one (run it twice)
      kvoffload simulate --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
          --limit 500 --mode accounting --plot run.png
      kvoffload simulate --json | jq .offload.host_hit_rate
      kvoffload simulate --faults 0.02                     # soak: faults, checks, figures
      kvoffload simulate --faults 0.05,fail,hang --load-deadline 2 --workload agentic
      kvoffload simulate --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
          --limit 2000 --engines 8 --router prefix --remote-capacity 1TiB
                                                           # a fleet with a shared tier

    What it does: the reference engine (a hybrid prefix-caching block pool, chunked prefill,
    decode, preemption) runs the workload twice: with kvoffload's planner, host tier and
    transfer worker, and without offloading. Bytes mode moves real (scaled-down) tensors and
    checks every loaded byte; accounting mode moves nothing and is much faster. Every figure
    uses the model's real page sizes. TTFT is modelled from prefill FLOPs at --flops and
    loaded bytes at --bandwidth.

    With --faults RATE[,KIND...] the run is a soak instead: that share of transfer jobs
    fail, hang past the load deadline, report twice, report after a cache reset, report
    out of order, or report on one of two ranks only (kinds: fail, hang, duplicate, late,
    reorder, partial; default all). Every loaded byte is verified (bytes mode), the
    bookkeeping is checked every modelled minute, and the soak figures are printed; the
    exit status is 1 unless the run is clean (docs/reliability.md).

    With --engines N the run is a fleet: N such engines, each with its own prefix cache,
    host tier (and --disk-capacity disk tier), behind one router (--router); with
    --remote-capacity SIZE they share one modelled remote tier that every engine writes
    through and promotes from. Fleets run in accounting mode. The summary gives the
    fleet's hits per tier and prefill tokens saved, then each engine's (docs/fleet.md).
    """)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "simulate", help="replay a workload with and without offloading",
        description="Replay a workload through the reference engine with and without "
                    "offloading, and compare hit rates, bytes moved and modelled TTFT.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b",
                        help="model preset (default gpt-oss-20b; see 'kvoffload presets')")
    parser.add_argument("--mode", choices=[m.value for m in Mode], default=None,
                        help="bytes (real tensors, verified) or accounting (default: bytes "
                             "for built-in workloads, accounting for traces and lower tiers)")
    parser.add_argument("--host-capacity", default="16GiB", metavar="SIZE",
                        help="host memory for offloaded blocks, real bytes (default 16GiB)")
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help=f"cache policy: {DEFAULT_POLICY} (default; docs/policy.md), lru, "
                             "arc, hybrid, or oracle (a reference that knows the workload's "
                             "future; simulator only)")
    parser.add_argument("--seed", type=whole_number, default=0, help="seed of a built-in workload")
    parser.add_argument("--scale-bytes", type=whole_number, default=64, metavar="B",
                        help="bytes mode: the smallest moved page, in bytes (default 64)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run without offloading")
    parser.add_argument("--disk-path", metavar="DIR",
                        help="bytes mode: a real disk tier in DIR (with --disk-capacity); "
                             "a second run on DIR hits what the first one stored")
    parser.add_argument("--remote-url", metavar="URL",
                        help="bytes mode: a real shared tier on a Redis/Valkey server, "
                             "e.g. redis://127.0.0.1:6379/0")
    parser.add_argument("--tier-mac-key-file", metavar="FILE", default=None,
                        help="with --disk-path / --remote-url: the file holding the secret "
                             "that MACs every block in those tiers (chmod 600; else "
                             "$KVOFFLOAD_TIER_MAC_KEY; docs/tiers.md)")
    parser.add_argument("--check", action="store_true",
                        help="check the pool's and planner's bookkeeping every step (slow)")
    faults = parser.add_argument_group("faults (soak)")
    faults.add_argument("--faults", metavar="RATE[,KIND...]", default=None,
                        help="inject faults into that share of transfer jobs and print the "
                             "soak figures instead of the comparison")
    faults.add_argument("--fault-seed", type=whole_number, default=0, metavar="N",
                        help="seed of the fault schedule (default 0)")
    faults.add_argument("--load-deadline", type=real_number, default=5.0, metavar="S",
                        help="modelled seconds a request waits for a load before it "
                             "recomputes (default 5)")
    faults.add_argument("--hang", type=real_number, default=30.0, metavar="S",
                        help="modelled seconds a hung transfer is late (default 30)")
    faults.add_argument("--tier-faults", type=real_number, default=0.0, metavar="RATE",
                        help="with real tiers (--disk-path, --remote-url): that share of "
                             "tier I/O calls fails, damages the block it wrote, or starts "
                             "an outage of the tier")
    fleet = parser.add_argument_group("fleet (several engines, one router, a shared tier)")
    fleet.add_argument("--engines", metavar="N", default=None,
                       help=f"simulate N engines (1 to {MAX_ENGINES}), each with its own "
                            "prefix cache and host tier, behind one router; "
                            "--remote-capacity SIZE becomes one tier they all share "
                            "(accounting mode)")
    fleet.add_argument("--router", metavar="NAME", default=None,
                       help="how --engines assigns requests: 'round-robin' (default): "
                            f"{ROUTER_HELP[Router.ROUND_ROBIN]}; 'prefix': "
                            f"{ROUTER_HELP[Router.PREFIX]}")
    add_workload_options(parser, default_limit=None)
    add_hint_option(parser)
    add_engine_options(parser)
    add_output_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    check_simulate_args(args)
    fleet = check_fleet_args(args)
    preset = check_preset(args.preset)
    policy = check_policy(args.policy)
    modelled = args.disk_capacity or args.remote_capacity
    real = args.disk_path or args.remote_url
    mode = Mode(args.mode) if args.mode else (
        Mode.BYTES if real else Mode.ACCOUNTING if args.trace or modelled else Mode.BYTES)
    if fleet is not None:
        mode = Mode.ACCOUNTING
    spec = workload_spec(args, args.seed)
    config = simulation_config(args, preset=preset, policy=policy, mode=mode,
                               host_capacity=parse_size(args.host_capacity, "--host-capacity"))
    config = replace(config, mac_key=simulate_mac_key(args))
    if args.no_baseline:
        config = replace(config, baseline=False)
    workload = spec.load()
    if fleet is not None:
        return run_fleet_command(args, FleetConfig(config, *fleet), spec, workload)
    if args.faults is not None:
        return run_soak_command(args, config, workload)
    show = not (args.quiet or args.json)
    with progress_bar(show) as start:
        total = spec.count() if show else 0
        result = simulate(config, workload,
                          progress=start(f"{preset} with offloading", total),
                          baseline_progress=(start(f"{preset} without offloading", total)
                                             if config.baseline else None))
    if args.plot is not None:
        plot_simulation(result, args.plot, f"{preset}, {spec.label}")
    if args.json:
        print(json.dumps(simulation_dict(result, spec.label), indent=2))
    else:
        print(simulation_text(result, spec.label))
        if args.plot is not None:
            print(f"  plot written to {args.plot}")
    return 0 if result.offload.wrong_bytes == 0 else 1


def run_soak_command(args: argparse.Namespace, config: SimulationConfig,
                     workload: Iterable[WorkloadRequest]) -> int:
    """``--faults``: a soak run (``kvoffload.faults.soak``); prints its figures."""
    import logging

    from kvoffload.faults.plan import FaultPlan
    from kvoffload.faults.soak import SoakConfig, run_soak

    parsed = FaultPlan.parse(args.faults, seed=args.fault_seed)  # seconds: check_simulate_args
    plan = replace(parsed, hang_s=args.hang)
    # Faults are injected on purpose: their warnings would drown the figures.
    log = logging.getLogger("kvoffload")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        report = run_soak(SoakConfig(replace(config, baseline=False), plan,
                                     load_deadline_s=args.load_deadline,
                                     tier_faults=args.tier_faults), workload)
    finally:
        log.setLevel(level)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.text())
    return 0 if report.ok else 1


def run_fleet_command(args: argparse.Namespace, fleet: FleetConfig, spec: WorkloadSpec,
                      workload: Iterable[WorkloadRequest]) -> int:
    """``--engines N``: the fleet with and without offloading; prints its figures."""
    show = not (args.quiet or args.json)
    what = f"{fleet.simulation.preset}, {fleet.engines} engines ({fleet.router.value})"
    with progress_bar(show) as start:
        total = spec.count() if show else 0
        result = simulate_fleet(fleet, workload,
                                progress=start(f"{what} with offloading", total),
                                baseline_progress=(start(f"{what} without offloading", total)
                                                   if fleet.simulation.baseline else None))
    if args.json:
        print(json.dumps(fleet_dict(result, spec.label), indent=2))
    else:
        print(fleet_text(result, spec.label))
    return 0
