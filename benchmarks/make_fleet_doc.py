"""Regenerate docs/fleet.md and docs/img/fleet.png: what a shared tier is worth to a fleet.

    PYTHONPATH=src .venv/bin/python benchmarks/make_fleet_doc.py               # 2000 requests
    PYTHONPATH=src .venv/bin/python benchmarks/make_fleet_doc.py --limit 500   # a quick look

Replays the first ``--limit`` requests of the shared Mooncake conversation trace through
fleets of 1, 2, 4 and 8 engines (``kvoffload simulate --engines N``) under both routers,
each once without offloading, once with offloading but no shared tier and once with the
shared tier. Every engine: gpt-oss-20b, the CLI's engine memory for traces (1M tokens in
64-token blocks), 256 GiB of host memory (256-token offloaded blocks, LRU); the shared
tier: 1 TiB. Accounting mode. The default 2,000 requests (the trace's first 11 minutes)
take about 5 minutes on two cores. The trace is looked up at ``$KVOFFLOAD_TRACE`` or at
``../shared/traces/`` beside the checkout.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvoffload.cli.common import format_seconds
from kvoffload.sim.fleet import (
    PREFIX_ROUTE_TOKENS,
    ROUTER_HELP,
    FleetConfig,
    FleetRun,
    Router,
    run_fleet,
)
from kvoffload.sim.replay import Arrival
from kvoffload.sim.simulation import Mode, SimulationConfig, resolve
from kvoffload.sizes import format_bytes
from kvoffload.workloads import WorkloadRequest, read_mooncake_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(os.environ.get("KVOFFLOAD_TRACE", ROOT.parent / "shared" / "traces"
                            / "mooncake_conversation_trace.jsonl"))
DOCS = ROOT / "docs"
GiB = 1 << 30
ENGINES = (1, 2, 4, 8)
HOST = 256 * GiB
SHARED = 1 << 40
ENGINE_TOKENS = 1 << 20
"""What ``kvoffload simulate --trace`` gives every engine by default."""


def engine_config(shared: bool) -> SimulationConfig:
    return SimulationConfig(
        preset="gpt-oss-20b", mode=Mode.ACCOUNTING, block_size=64, block_size_factor=4,
        engine_tokens=ENGINE_TOKENS, host_capacity_bytes=HOST,
        remote_capacity_bytes=SHARED if shared else None, decode_tokens_per_step=16,
        arrival=Arrival.TRACE, eviction_policy="lru")


class Trace:
    """The trace's first ``limit`` requests, read afresh by every run."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.limit = path, limit

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return read_mooncake_trace(self.path, limit=self.limit)


@dataclass(frozen=True)
class Row:
    router: Router
    engines: int
    shared: bool
    run: FleetRun
    baseline: FleetRun

    @property
    def saved(self) -> float:
        return self.run.totals.hit_rate

    @property
    def computed_share(self) -> float:
        return (self.run.totals.prefill_tokens_computed
                / self.baseline.totals.prefill_tokens_computed)

    @property
    def ttft_ratio(self) -> float:
        return self.baseline.totals.ttft.mean / self.run.totals.ttft.mean

    def tier(self, name: str) -> float:
        return self.run.totals.tier_hit_rates.get(name, 0.0)


def run_all(trace: Trace) -> list[Row]:
    rows = []
    for router in Router:
        for engines in ENGINES:
            started = time.perf_counter()
            baseline = run_fleet(FleetConfig(engine_config(False), engines, router), trace,
                                 offload=False)
            for shared in (False, True):
                config = FleetConfig(engine_config(shared), engines, router)
                rows.append(Row(router, engines, shared, run_fleet(config, trace), baseline))
            print(f"{router.value:>11} x {engines}: {time.perf_counter() - started:.0f} s, "
                  f"saved {100 * rows[-2].saved:.1f} % / {100 * rows[-1].saved:.1f} % "
                  "(without / with the shared tier)", file=sys.stderr)
    return rows


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def table(rows: list[Row]) -> list[str]:
    out = ["| router | engines | shared tier | device | host | shared | prefill saved | "
           "tokens saved | computed vs no offload | TTFT mean | vs no offload | "
           "waits given up |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r.run.totals
        out.append(
            f"| {r.router.value} | {r.engines} | {'1 TiB' if r.shared else 'none'} | "
            f"{pct(t.engine_hit_rate)} | {pct(r.tier('host'))} | "
            f"{pct(r.tier('remote')) if r.shared else '-'} | **{pct(r.saved)}** | "
            f"{t.prefill_tokens_saved:,} | {pct(r.computed_share)} | "
            f"{format_seconds(t.ttft.mean)} | {r.ttft_ratio:.2f}x | "
            f"{sum(r.run.deferral_timeouts)} |")
    return out


def baseline_table(rows: list[Row]) -> list[str]:
    out = ["| router | engines | device (no offload) | TTFT mean (no offload) | "
           "requests per engine |", "|---|---|---|---|---|"]
    for r in rows:
        if r.shared:
            continue
        b = r.baseline.totals
        out.append(f"| {r.router.value} | {r.engines} | {pct(b.engine_hit_rate)} | "
                   f"{format_seconds(b.ttft.mean)} | "
                   f"{', '.join(str(n) for n in r.run.routed)} |")
    return out


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {Router.ROUND_ROBIN: "tab:red", Router.PREFIX: "tab:blue"}
    for router in Router:
        for shared in (False, True):
            pts = [r for r in rows if r.router is router and r.shared is shared]
            label = f"{router.value}, {'shared tier' if shared else 'no shared tier'}"
            left.plot([r.engines for r in pts], [100 * r.saved for r in pts],
                      marker="o" if shared else "s", color=styles[router],
                      linestyle="-" if shared else "--", label=label)
            if shared:
                right.plot([r.engines for r in pts], [100 * r.tier("remote") for r in pts],
                           marker="o", color=styles[router], label=f"{router.value}")
        base = [r for r in rows if r.router is router and not r.shared]
        left.plot([r.engines for r in base], [100 * r.baseline.totals.hit_rate for r in base],
                  color=styles[router], linestyle=":", alpha=0.6,
                  label=f"{router.value}, no offloading")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ENGINES), [str(n) for n in ENGINES])
        ax.set_xlabel("engines")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    left.set_ylabel("prefill saved (% of prompt tokens)")
    left.set_title("prefill saved: device + host + shared tier")
    right.set_ylabel("% of prompt tokens")
    right.set_title("served by the shared tier (1 TiB)")
    left.set_ylim(0, 1.45 * max(100 * r.saved for r in rows))
    left.legend(fontsize=7, loc="upper center", ncol=2)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def find(rows: list[Row], router: Router, engines: int, shared: bool) -> Row:
    return next(r for r in rows if (r.router, r.engines, r.shared) == (router, engines, shared))


def findings(rows: list[Row]) -> list[str]:
    """Sentences about the table, each kept only where the numbers bear it out."""
    rr, px = Router.ROUND_ROBIN, Router.PREFIX
    lo, hi = ENGINES[0], ENGINES[-1]
    rr_none = [find(rows, rr, n, False).saved for n in ENGINES]
    rr_shared = [find(rows, rr, n, True).saved for n in ENGINES]
    px_none = [find(rows, px, n, False).saved for n in ENGINES]
    px_shared = [find(rows, px, n, True).saved for n in ENGINES]
    one = find(rows, rr, lo, True)
    waits = [sum(find(rows, rr, n, True).run.deferral_timeouts) for n in ENGINES]
    recovers = (all(s > n for s, n in zip(rr_shared[1:], rr_none[1:], strict=True))
                and rr_shared[-1] >= 0.9 * rr_shared[0])
    claims: list[tuple[bool, str]] = [
        (all(a > b for a, b in itertools.pairwise(rr_none)),
         f"**Round robin without a shared tier loses hits as the fleet grows**: prefill "
         f"saved falls from {pct(rr_none[0])} with {lo} engine to {pct(rr_none[-1])} with "
         f"{hi}, although the fleet's memory grows with it. A conversation's next turn lands "
         "on another engine, whose prefix cache and host memory never saw the earlier "
         f"turns; host hits drop from {pct(find(rows, rr, lo, False).tier('host'))} to "
         f"{pct(find(rows, rr, hi, False).tier('host'))}."),
        (recovers,
         f"**The shared tier recovers them**: with it, round robin saves "
         f"{pct(min(rr_shared))} to {pct(max(rr_shared))} at every size, and the hits the "
         f"engines' own tiers lose move to the shared tier (it serves "
         f"{pct(find(rows, rr, lo, True).tier('remote'))} of prompt tokens with {lo} "
         f"engine, {pct(find(rows, rr, hi, True).tier('remote'))} with {hi})."),
        (recovers and rr_shared[-1] < rr_shared[0] and waits[-1] > 0
         and all(a <= b for a, b in itertools.pairwise(waits)),
         f"It does not recover all of them: {pct(rr_shared[-1])} with {hi} engines against "
         f"{pct(rr_shared[0])} with {lo}, while the waits given up grow with the fleet ("
         + ", ".join(map(str, waits))
         + f" with {', '.join(map(str, ENGINES))} engines): a lookup "
         "waits for its promote at most 64 engine steps, and a lightly loaded engine takes "
         "a short step for every promote that lands, so a long prefix promoted on an "
         "engine with little else to do can run out of steps before it is up."),
        (all(b >= a - 0.005 for a, b in itertools.pairwise(px_none))
         and px_none[-1] >= 0.95 * rr_shared[0],
         f"**The prefix router keeps them without a shared tier**: it sends a conversation's "
         f"turns to one engine, so each engine's own caches serve its reuse; prefill saved "
         f"goes from {pct(px_none[0])} with {lo} engine to {pct(px_none[-1])} with {hi}, "
         "as the fleet's device and host memory grow with it and each engine holds only "
         "its share of the conversations."),
        (max(px_shared) - min(px_shared) < 0.01,
         f"With the prefix router the shared tier adds little once the fleet's own memory "
         f"holds the reuse: the shared tier serves "
         f"{pct(find(rows, px, ENGINES[1], True).tier('remote'))} with {ENGINES[1]} engines "
         f"and {pct(find(rows, px, hi, True).tier('remote'))} with {hi}."),
        (one.saved > find(rows, rr, lo, False).saved,
         f"With one engine the shared tier is simply a large tier below host memory: it "
         f"lifts prefill saved from {pct(find(rows, rr, lo, False).saved)} to "
         f"{pct(one.saved)} (256 GiB of host memory does not hold the first "
         f"{rows[0].run.totals.requests:,} requests' reuse)."),
    ]
    kept = [f"* {text}" for holds, text in claims if holds]
    dropped = sum(1 for holds, _ in claims if not holds)
    if dropped:
        print(f"note: {dropped} finding(s) left out: the numbers do not bear them out",
              file=sys.stderr)
    return kept


def render(rows: list[Row], limit: int, elapsed: float) -> str:
    config = engine_config(True)
    layout = config.layout()
    caps, _ = resolve(config, layout)
    first = rows[0].run.totals
    shared_end = max(r.run.shared_bytes for r in rows if r.shared)
    cli = ("kvoffload simulate --trace ../shared/traces/mooncake_conversation_trace.jsonl "
           f"--limit {limit} \\\n    --block-size 64 --block-size-factor 4 --host-capacity "
           "256GiB --engines 8 --router round-robin --remote-capacity 1TiB")
    lines = [
        "# What a shared tier is worth: a simulated fleet",
        "",
        "`kvoffload simulate --engines N --router round-robin|prefix` replays a workload "
        "through N engines behind one router. Each engine is the simulator's reference "
        "engine ([simulator.md](simulator.md)) with its own device prefix cache, planner and "
        "host tier; with `--remote-capacity SIZE` they all share one remote tier that every "
        "engine's cascade writes through and promotes from, as a fleet shares a Redis/Valkey "
        "server ([tiers.md](tiers.md#remote-tier)). The question: how much prefill does the "
        "shared tier save, and how much does the router?",
        "",
        "## Setup",
        "",
        f"* **Workload**: the first {limit:,} requests of the shared Mooncake conversation "
        f"trace, at their own timestamps ({first.prompt_tokens:,} prompt tokens).",
        f"* **Each engine**: gpt-oss-20b, {caps.engine_blocks - 1:,} blocks of "
        f"{layout.block_size} tokens of engine memory "
        f"({format_bytes((caps.engine_blocks - 1) * caps.engine_block_bytes)}, the 1M "
        f"tokens `simulate --trace` gives by default), {format_bytes(HOST)} of host memory "
        f"({caps.host_slots:,} slots of {format_bytes(caps.host_slot_bytes)}: offloaded "
        f"blocks of {layout.block_size * config.block_size_factor} tokens, LRU), 64 "
        "sequences at once. The fleet's memory grows with N.",
        f"* **Shared tier**: {format_bytes(SHARED)}, modelled (no server): one budgeted "
        "LRU index of the blocks held, read and written by every engine "
        "(`kvoffload.sim.shared_store`). An engine sees another's block once its write has "
        "landed (a write in flight reads as absent, as on a server); existence checks are "
        "exact and instant. Promotes are charged to the promoting engine's own lower-tier "
        f"link ({config.timing.lower_bytes_per_s / 1e9:g} GB/s); the shared server's own "
        "bandwidth is not modelled, so no engine waits for another's traffic. At most "
        f"{format_bytes(shared_end)} of it was used, so nothing was evicted.",
        f"* **Routers**: `round-robin`: {ROUTER_HELP[Router.ROUND_ROBIN]}. `prefix`: "
        f"{ROUTER_HELP[Router.PREFIX]}. The trace names no sessions, so the prefix router "
        f"hashes the first {PREFIX_ROUTE_TOKENS} tokens: two 512-token trace blocks. Every "
        "request of the trace starts with the same first block (a system prompt), so "
        "hashing that block alone would send every request to one engine; the second "
        "block names the conversation.",
        "* **Time**: every engine keeps its own modelled clock, and the engine whose clock "
        "is earliest steps next, so blocks cross engines in modelled-time order (to within "
        "one step). Accounting mode: no tensors move.",
        "* **Counted**: *device* is the share of prompt tokens the engines' own prefix "
        "caches served, *host* the share loaded from host memory, *shared* the share "
        "promoted from the shared tier (and loaded through host memory); *prefill saved* "
        "is their sum, the share of prompt tokens not computed. *Computed vs no offload* compares "
        "prefill tokens computed (recomputation after preemption included) with the same "
        "fleet and router without offloading; *TTFT* is the mean modelled TTFT (prefill "
        "FLOPs plus loaded bytes, no queueing) and its ratio to the fleet without "
        "offloading. *Waits given up*: lookups that stopped waiting for a promote after "
        "64 engine steps (`max_deferred_steps`) and computed instead.",
        "",
        "## Results",
        "",
        *table(rows),
        "",
        "![prefill saved vs engines](img/fleet.png)",
        "",
        "Without offloading (the engines' prefix caches only), the same fleets:",
        "",
        *baseline_table(rows),
        "",
        "## What the numbers show",
        "",
        *findings(rows),
        "",
        "Caveats: this is one trace slice and one model; the fleet's memory grows with N "
        "(a fleet of fixed total memory is another experiment); the shared tier's "
        "bandwidth is unlimited in this model; and the prefix router spreads "
        "conversations by hash, not by load (the requests per engine are in the second "
        "table).",
        "",
        "## Regenerate",
        "",
        "```bash",
        f"PYTHONPATH=src python benchmarks/make_fleet_doc.py --limit {limit}",
        "```",
        "",
        f"This run took {elapsed / 60:.1f} min on two cores ({len(ENGINES)} fleet sizes x 2 "
        "routers x 3 runs). One row by hand:",
        "",
        "```bash",
        cli,
        "```",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=2000,
                        help="trace requests (default 2000)")
    parser.add_argument("--trace", type=Path, default=TRACE)
    args = parser.parse_args()
    if not args.trace.exists():
        print(f"trace not found: {args.trace} (set KVOFFLOAD_TRACE)", file=sys.stderr)
        return 2
    (DOCS / "img").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = run_all(Trace(args.trace, args.limit))
    elapsed = time.perf_counter() - started
    plot(rows, DOCS / "img" / "fleet.png",
         f"gpt-oss-20b fleets, first {args.limit:,} requests of the Mooncake conversation "
         f"trace; {format_bytes(HOST)} host memory per engine")
    (DOCS / "fleet.md").write_text(render(rows, args.limit, elapsed))
    print(f"wrote {DOCS / 'fleet.md'} in {elapsed:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
