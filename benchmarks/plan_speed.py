"""What ``kvoffload plan --jobs N`` buys: the same plan with one process and with N, timed
side by side in one run, as a ratio (and the two plans compared: they must be equal).

    python benchmarks/plan_speed.py                      # 2,000 trace requests, --jobs 2
    python benchmarks/plan_speed.py --limit 500 --fractions 0.1,0.5,1 --policy value
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from kvoffload.sim.plan import DEFAULT_FRACTIONS, make_plan
from kvoffload.sim.simulation import Mode, SimulationConfig
from kvoffload.workloads.spec import WorkloadSpec

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / \
    "mooncake_conversation_trace.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=Path(os.environ.get("KVOFFLOAD_TRACE",
                                                                          TRACE)))
    parser.add_argument("--limit", type=int, default=2000)
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--policy", default="value,lru")
    parser.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    if not args.trace.exists():
        sys.exit(f"no trace at {args.trace}: pass --trace FILE (a Mooncake-format trace)")
    spec = WorkloadSpec(name="trace", trace=args.trace, limit=args.limit, seed=0)
    base = SimulationConfig(preset=args.preset, mode=Mode.ACCOUNTING, engine_tokens=1 << 20,
                            decode_tokens_per_step=16, eviction_policy="lru")
    policies = [p for p in args.policy.split(",") if p]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    times = {}
    plans = {}
    for jobs in (1, args.jobs):
        start = time.perf_counter()
        plans[jobs] = make_plan(base, spec, policies=policies, fractions=fractions, jobs=jobs)
        times[jobs] = time.perf_counter() - start
    runs = 2 + len(policies) * len(fractions)
    print(f"kvoffload plan: {args.preset}, first {args.limit} requests of {args.trace.name}, "
          f"{len(policies)} policies x {len(fractions)} capacities ({runs} simulations)")
    for jobs, seconds in times.items():
        print(f"  --jobs {jobs}: {seconds:7.1f} s")
    print(f"  speed-up --jobs {args.jobs} / --jobs 1: {times[1] / times[args.jobs]:.2f}x "
          f"on {os.cpu_count()} cores; same plan: {plans[1] == plans[args.jobs]}")
    return 0 if plans[1] == plans[args.jobs] else 1


if __name__ == "__main__":
    sys.exit(main())
