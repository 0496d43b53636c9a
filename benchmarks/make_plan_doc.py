"""Regenerate docs/plan.md and its plots: ``kvoffload plan`` for three real models (dense,
sliding window, Mamba hybrid) on the shared Mooncake conversation trace.

    python benchmarks/make_plan_doc.py [--limit 500] [--jobs 2]

Each model's plan is exactly what ``kvoffload plan --preset NAME --trace TRACE --limit N
--policy value,lru`` computes (the command is printed in the document).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from kvoffload.cli.plots import plot_plan
from kvoffload.cli.tables import format_rows, memory_rows, plan_rows
from kvoffload.sim.plan import DEFAULT_FRACTIONS, make_plan
from kvoffload.sim.simulation import Mode, SimulationConfig
from kvoffload.sizes import format_bytes
from kvoffload.workloads.spec import WorkloadSpec

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MODELS = (("llama3-8b", "dense, full attention"),
          ("gemma3-27b", "sliding window (5 of 6 layers) + full attention"),
          ("nemotron-h-8b", "Mamba2 hybrid"))
POLICIES = ("value", "lru")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=Path(os.environ.get("KVOFFLOAD_TRACE",
                                                                          TRACE)))
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    if not args.trace.exists():
        sys.exit(f"no trace at {args.trace}: pass --trace FILE")
    spec = WorkloadSpec(name="trace", trace=args.trace, limit=args.limit, seed=0)
    lines = ["# Sizing a deployment: `kvoffload plan`", "",
             "`kvoffload plan` answers the question a deployment asks: *how much host memory "
             "(and disk) per rank does this model need for this traffic, and what does it "
             "buy?* It simulates the model on a trace (`kvoffload trace convert` turns request "
             "logs into one): a store-everything run with unbounded host memory gives the "
             "working set and the unbounded hit rate; runs at shares of that working set give "
             "each policy's curve, from which the memory that reaches 50, 90 and 99 % of the "
             "unbounded hit rate is read (log-linear between grid points); `--disk-capacity` "
             "adds the same grid with a disk tier below host memory. It ends with the "
             "`--kv-transfer-config` for `vllm serve`: the policy that needs the least memory "
             "for 90 %, that memory rounded up to a whole GiB per rank.", "",
             f"Below: the first {args.limit} requests of the shared Mooncake conversation "
             "trace, three models, `value` and `lru`, accounting mode (no tensors move), "
             "figures per rank. Regenerate with "
             f"`python benchmarks/make_plan_doc.py --limit {args.limit}` "
             f"({args.jobs} jobs). A short prefix of the trace holds little reuse yet (reuse "
             "grows with the length of the replay; docs/policy.md replays the whole trace), "
             "so the hit rates here are small: plan on as much of your own traffic as you "
             "have.", ""]
    start = time.perf_counter()
    for preset, kind in MODELS:
        base = SimulationConfig(preset=preset, mode=Mode.ACCOUNTING, engine_tokens=1 << 20,
                                decode_tokens_per_step=16, eviction_policy="lru")
        plan = make_plan(base, spec, policies=POLICIES, fractions=DEFAULT_FRACTIONS,
                         jobs=args.jobs)
        image = DOCS / "img" / f"plan-{preset}.png"
        image.parent.mkdir(exist_ok=True)
        plot_plan(plan, image)
        lines += [f"## {preset} ({kind})", "",
                  f"    kvoffload plan --preset {preset} --trace {args.trace.name} "
                  f"--limit {args.limit} --policy {','.join(POLICIES)}", "",
                  f"Working set {format_bytes(plan.working_set_bytes)}; unbounded host hit "
                  f"rate {100 * plan.unbounded_hit_rate:.1f} % of prompt tokens.", "",
                  "```", format_rows(memory_rows(plan)), "```", "",
                  f"Recommended: `{plan.recommended_policy}` with "
                  f"{format_bytes(plan.recommended_host_bytes)} per rank.", "",
                  f"![{preset}](img/plan-{preset}.png)", "",
                  "<details><summary>every point</summary>", "", "```",
                  format_rows(plan_rows(plan)), "```", "", "</details>", ""]
        print(f"{preset}: {time.perf_counter() - start:.0f} s", flush=True)
    (DOCS / "plan.md").write_text("\n".join(lines))
    print(f"wrote {DOCS / 'plan.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
