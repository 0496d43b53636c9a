"""The tables ``kvoffload sweep`` and ``kvoffload plan`` print (also used by the scripts in
``benchmarks/`` that write the documentation's tables from the same figures).

Each ``*_table`` / ``*_rows`` function turns library results (``kvoffload.sim.sweep``,
``kvoffload.sim.plan``) into rows of strings, header first; ``format_rows`` lays rows out
in aligned columns (the first two left-aligned, the rest right-aligned). Nothing here runs a
simulation or prints.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.cli.common import format_seconds
from kvoffload.sim.plan import TARGETS, Plan
from kvoffload.sim.sweep import Reference, SweepPoint, memory_to_reach
from kvoffload.sizes import format_bytes


def format_rows(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1])]
                               + [c.rjust(w) for c, w in zip(r[2:], widths[2:], strict=True)])
                     for r in rows)


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
