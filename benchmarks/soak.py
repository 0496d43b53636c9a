"""Soak: an hour of the shared Mooncake trace with faults injected, every byte verified.

Replays the trace (3,537 s of arrivals, 12,031 requests) through the reference engine with
the real planner, host tier and transfer worker on real (scaled) tensors, while a
``FaultyExecutor`` makes 1 % of transfer jobs fail (writing garbage), hang 30 s past the
5 s load deadline, report twice, report after a cache reset, report out of order, or
report on one of two tensor-parallel ranks only. Every block loaded or adopted from the
prefix cache is compared byte for byte, the host arena is audited and the planner's, pool's
and tier's bookkeeping is checked every modelled minute. Prints the soak figures; exits 1
unless the run is clean (``SoakReport.ok``).

    .venv/bin/python benchmarks/soak.py                       # one hour, bytes mode
    .venv/bin/python benchmarks/soak.py --limit 500 --faults 0.05,fail,hang
    .venv/bin/python benchmarks/soak.py --mode accounting --markdown table.md

``--markdown FILE`` writes the fault table of ``docs/reliability.md``. The trace is looked
up at ``$KVOFFLOAD_TRACE`` or in ``shared/traces/`` beside the checkout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

from kvoffload.faults.plan import FaultKind, FaultPlan
from kvoffload.faults.soak import SoakConfig, SoakReport, run_soak
from kvoffload.sim.simulation import Mode, SimulationConfig
from kvoffload.sizes import parse_size
from kvoffload.workloads import read_mooncake_trace

ROOT = Path(__file__).resolve().parents[1]
NAME = Path("shared") / "traces" / "mooncake_conversation_trace.jsonl"
CANDIDATES = [ROOT.parent / NAME, ROOT.parent.parent / NAME]
TRACE = Path(os.environ["KVOFFLOAD_TRACE"]) if "KVOFFLOAD_TRACE" in os.environ else next(
    (p for p in CANDIDATES if p.is_file()), CANDIDATES[0])

EXPECTED = {
    FaultKind.FAIL: "failed load: recompute, bytes never used; failed store: slots freed",
    FaultKind.HANG: "load: give up at the deadline, recompute elsewhere, blocks parked "
                    "until the late copy reports; store: keys stay unreadable until it does",
    FaultKind.DUPLICATE: "second report counted and ignored",
    FaultKind.LATE: "cache reset while in flight; the reset's flush waits for the copy; "
                    "the stale report is ignored",
    FaultKind.REORDER: "served as usual (completion is counted per job)",
    FaultKind.PARTIAL: "job completes only when the last rank reports",
}


def markdown(report: SoakReport, command: str) -> str:
    """The fault table and the soak figures, as Markdown."""
    rows = ["| fault | injected on loads | on stores | what kvoffload does (the figures below "
            "show it held) |", "|---|---|---|---|"]
    for kind in FaultKind:
        loads = report.faults.get(f"{kind.value}/load", 0)
        stores = report.faults.get(f"{kind.value}/store", 0)
        rows.append(f"| {kind.value} | {loads:,} | {stores:,} | {EXPECTED[kind]} |")
    figures = ["| figure | value |", "|---|---|",
               *(f"| {label} | {value} |" for label, value in report.figures())]
    return (f"Produced by `{command}`.\n\n" + "\n".join(rows) + "\n\n" + "\n".join(figures)
            + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--mode", choices=[m.value for m in Mode], default="bytes")
    parser.add_argument("--faults", default="0.01", help="RATE[,KIND...] (default 0.01, "
                        "every kind: " + ", ".join(k.value for k in FaultKind) + ")")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hang", type=float, default=30.0, help="seconds a hang lasts")
    parser.add_argument("--deadline", type=float, default=5.0, help="load deadline, s")
    parser.add_argument("--engine-capacity", default="16GiB")
    parser.add_argument("--host-capacity", default="64GiB")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    if not args.trace.is_file():
        print(f"no trace at {args.trace}; set KVOFFLOAD_TRACE", file=sys.stderr)
        return 2
    # Faults are injected on purpose: their warnings would drown the figures.
    logging.getLogger("kvoffload").setLevel(logging.ERROR)
    plan = replace(FaultPlan.parse(args.faults, seed=args.seed), hang_s=args.hang)
    sim = SimulationConfig(
        preset=args.preset, mode=Mode(args.mode), block_size=64, block_size_factor=4,
        engine_capacity_bytes=parse_size(args.engine_capacity, "--engine-capacity"),
        host_capacity_bytes=parse_size(args.host_capacity, "--host-capacity"),
        decode_tokens_per_step=16, baseline=False, eviction_policy="lru")
    config = SoakConfig(sim, plan, load_deadline_s=args.deadline)
    report = run_soak(config, read_mooncake_trace(args.trace, limit=args.limit))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.text())
    if args.markdown is not None:
        argv = sys.argv[1:]
        if "--markdown" in argv:  # the command that produces the figures, not the file
            i = argv.index("--markdown")
            del argv[i:i + 2]
        command = " ".join(["python benchmarks/soak.py", *argv])
        args.markdown.write_text(markdown(report, command), encoding="utf-8")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
