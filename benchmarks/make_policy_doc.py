"""Regenerate docs/policy.md and its plots: the hybrid-aware ``value`` policy against
store-everything LRU and ARC, on the shared Mooncake trace and the built-in agentic
workload, host capacity from 1 % to 50 % of each preset's store-everything working set.

    .venv/bin/python benchmarks/make_policy_doc.py                 # run the sweeps, write
    .venv/bin/python benchmarks/make_policy_doc.py --limit 4000    # more trace requests
    .venv/bin/python benchmarks/make_policy_doc.py --from-json     # re-render saved data
    .venv/bin/python benchmarks/make_policy_doc.py --add-policies oracle   # add a series
    .venv/bin/python benchmarks/make_policy_doc.py --add-policies oracle --replace  # rerun it

``--add-policies`` runs only the (policy, workload, preset) series missing from the saved
data, at the saved working sets and trace limit, and merges them in, keeping every other
series. A series is named by its label: a policy name, or ``value+hints90`` for ``value``
with client hints drawn at 90 % accuracy (a simulator that has ``hint_accuracy``).

Every run goes through ``kvoffload.sim.sweep.run_sweep`` (what ``kvoffload sweep`` runs), in
accounting mode with per-group byte accounting (``--host-accounting bytes``). The raw
numbers are kept in ``docs/policy_data.json``. The trace is looked up at
``$KVOFFLOAD_TRACE`` or at ``../shared/traces/`` beside the checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvoffload.cli.common import format_seconds
from kvoffload.cli.tables import format_rows, goal_table
from kvoffload.models.presets import PRESETS as PRESET_SPECS
from kvoffload.sim.simulation import Mode, SimulationConfig, auto_block_size, resolve
from kvoffload.sim.sweep import Reference, SweepPoint, memory_to_reach, run_sweep
from kvoffload.sizes import format_bytes
from kvoffload.workloads.mooncake import read_mooncake_trace
from kvoffload.workloads.spec import WorkloadSpec
from reuse_report import continuation_report, format_report, quantile

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(os.environ.get("KVOFFLOAD_TRACE", ROOT.parent / "shared" / "traces"
                            / "mooncake_conversation_trace.jsonl"))
DOCS = ROOT / "docs"
DATA = DOCS / "policy_data.json"
PRESETS = ("gpt-oss-20b", "gemma3-27b", "nemotron-h-8b", "llama3-8b")
POLICIES = ("lru", "arc", "value", "oracle")
"""The series of a full run, in the order tables and plots show them."""
HINT_SERIES = "value+hints"
"""Series label prefix of ``value`` with hints drawn at an accuracy (``value+hints90``)."""
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 1.0)
"""Host capacities as shares of the store-everything working set: 1-50 % for the curves,
60-100 % so the memory to reach 90 % of the unbounded hit rate can be measured (40 and
60 % because that memory is read between grid points)."""
AGENTIC_SESSIONS = 16
"""Agent sessions per run of the built-in agentic workload (`--sessions`). Its default of 4
gives 59 to 116 requests a run (by seed), so that one request moves a point; 16 give 281
to 452."""
AGENTIC_SEEDS = (0, 1, 2, 3, 4)
"""Figures on the agentic workload are means over these seeds."""
MEMORY_GOALS = {"gpt-oss-20b": 0.7, "gemma3-27b": 0.5, "nemotron-h-8b": 0.5}
"""Goal: the value policy's memory to reach 90 % of the unbounded hit rate, at most this
share of store-everything LRU's."""
HIT_GOALS = {"gpt-oss-20b": 2.0, "gemma3-27b": 3.0, "nemotron-h-8b": 1.5}
"""Goal: at 2 % capacity, the value policy's host hit rate at least this multiple of LRU's."""
MAX_LOSS_POINTS = 0.5
"""Goal: at no capacity below LRU's host hit rate by more than this many points."""
ORACLE_MEMORY_GOAL = 1.3
"""Goal: ``value``'s memory to reach 90 % of the unbounded hit rate, at most this multiple
of the oracle's."""
ORACLE_HIT_GOAL = 0.8
"""Goal: ``value``'s host hit rate at least this share of the oracle's at every capacity
in ``ORACLE_HIT_RANGE``."""
ORACLE_HIT_RANGE = (0.05, 0.5)
HINTED_SERIES = "value+hints90"
HINTED_MEMORY_GOAL = 1.1
"""Goal: with 90 %-accurate client hints, ``value`` within this multiple of the oracle's
memory."""


def preset_config(preset: str, trace: bool) -> SimulationConfig:
    """Attention-only presets: engine blocks of 64 tokens offloaded 4 at a time (256-token
    host blocks); Mamba hybrids: vLLM's page-matching block size, offloaded as is."""
    mamba = PRESET_SPECS[preset].mamba is not None
    return SimulationConfig(
        preset=preset, mode=Mode.ACCOUNTING, block_size=None if mamba else 64,
        block_size_factor=1 if mamba else 4, engine_tokens=(1 << 20) if trace else 32768,
        decode_tokens_per_step=16, baseline=False, host_accounting="bytes", eviction_policy="lru")


def series_run(config: SimulationConfig, spec: WorkloadSpec,
               label: str) -> tuple[SimulationConfig, WorkloadSpec]:
    """The simulation and workload a series label names: a policy, or ``value+hintsNN``
    (``value`` on the workload with client hints drawn at NN % accuracy)."""
    if label.startswith(HINT_SERIES):
        accuracy = int(label[len(HINT_SERIES):]) / 100
        return (replace(config, eviction_policy="value"),
                replace(spec, hint_accuracy=accuracy))
    return replace(config, eviction_policy=label), spec


def sweep(workload: str, limit: int | None, preset: str,
          policies: tuple[str, ...] = POLICIES,
          working_set: float | None = None) -> dict[str, Any]:
    """One workload's grid for one preset (run in a worker process); plain data.

    With ``working_set`` (the saved reference's), the capacities are its ``FRACTIONS``
    and no reference run is made (the added series land on the saved grid)."""
    trace = TRACE if workload == "mooncake" else None
    spec = WorkloadSpec("agentic", trace, limit, 0,
                        None if trace is not None else AGENTIC_SESSIONS)
    references: dict[str, Reference] = {}
    started = time.perf_counter()
    base = preset_config(preset, trace is not None)
    seeds = (0,) if trace is not None else AGENTIC_SEEDS
    points: list[SweepPoint] = []
    plain = tuple(p for p in policies if not p.startswith(HINT_SERIES))
    groups = ([(plain, (base, spec))] if plain else []) + [
        ((p,), series_run(base, spec, p)) for p in policies if p.startswith(HINT_SERIES)]
    for labels, (config, series_spec) in groups:
        hinted = labels[0].startswith(HINT_SERIES)
        runs = (config.eviction_policy,) if hinted else labels
        if working_set is None:
            got = run_sweep(config, series_spec, presets=(preset,), policies=runs, capacities=(),
                            seeds=seeds, fractions=FRACTIONS, references=references)
        else:
            floor = resolve(base, base.layout())[0].host_slot_bytes
            caps = {max(floor, int(f * working_set)): f for f in FRACTIONS}
            got = [replace(p, capacity_fraction=caps[p.host_capacity_bytes])
                   for p in run_sweep(config, series_spec, presets=(preset,), policies=runs,
                                      capacities=sorted(caps), seeds=seeds)]
        named = dict(zip(runs, labels, strict=True))
        points += [replace(p, policy=named[p.policy]) for p in got]
    label = spec.label_for(seeds)
    return {"workload": label, "limit": limit, "wall_s": time.perf_counter() - started,
            "references": {k: r.to_dict() for k, r in references.items()},
            "points": [p.to_dict() for p in points]}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One workload's data from its per-preset sweeps (in preset order)."""
    return {"workload": parts[0]["workload"], "limit": parts[0]["limit"],
            "wall_s": sum(p["wall_s"] for p in parts),
            "references": {k: v for p in parts for k, v in p["references"].items()},
            "points": [point for p in parts for point in p["points"]]}


def add_series(data: dict[str, Any], labels: tuple[str, ...],
               presets: tuple[str, ...]) -> None:
    """Run every (series, workload, preset) of ``labels`` x ``presets`` that ``data`` lacks,
    at its saved working sets and limits, and merge the points in (``--add-policies``).
    Each series' run time is kept under ``series_wall_s``."""
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        jobs = {}
        for workload in ("mooncake", "agentic"):  # the trace first: it runs longest
            saved = data[workload]
            for preset in presets:
                have = {p["policy"] for p in saved["points"] if p["preset"] == preset}
                missing = tuple(label for label in labels if label not in have)
                ref = saved["references"].get(preset)
                if missing and ref is not None:
                    jobs[workload, preset, missing] = pool.submit(
                        sweep, workload, saved["limit"], preset, missing,
                        ref["working_set_bytes"])
        for (workload, preset, missing), job in jobs.items():
            part = job.result()
            saved = data[workload]
            saved["points"] += part["points"]
            walls = saved.setdefault("series_wall_s", {})
            for label in missing:
                walls[label] = walls.get(label, 0.0) + part["wall_s"] / len(missing)
            print(f"{workload} {preset}: added {', '.join(missing)} "
                  f"({part['wall_s'] / 60:.1f} min)", flush=True)


def load_points(data: dict[str, Any]) -> tuple[list[SweepPoint], dict[str, Reference]]:
    names = {f.name for f in fields(SweepPoint)}
    points = [SweepPoint(**{k: v for k, v in p.items() if k in names}) for p in data["points"]]
    refs = {k: Reference(**v) for k, v in data["references"].items()}
    return points, refs


def series(points: list[SweepPoint]) -> list[str]:
    """The series in ``points``: ``POLICIES`` first, then any others (hint series) by name."""
    present = {p.policy for p in points}
    return [p for p in POLICIES if p in present] + sorted(present - set(POLICIES))


def curve(points: list[SweepPoint], preset: str, policy: str) -> list[SweepPoint]:
    return sorted((p for p in points if p.preset == preset and p.policy == policy),
                  key=lambda p: p.capacity_fraction)


def plot(points: list[SweepPoint], refs: dict[str, Reference], title: str,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = [p for p in PRESETS if any(q.preset == p for q in points)]
    fig, axes = plt.subplots(2, len(presets), figsize=(4.2 * len(presets), 7.4),
                             squeeze=False)
    styles = {"lru": ("tab:blue", "-"), "arc": ("tab:orange", "--"),
              "value": ("tab:green", "-"), "oracle": ("black", ":")}
    for col, preset in enumerate(presets):
        top, bottom = axes[0][col], axes[1][col]
        for policy in series(points):
            pts = curve(points, preset, policy)
            if not pts:
                continue
            color, line = styles.get(policy, ("tab:purple", "-."))
            xs = [100 * p.capacity_fraction for p in pts]
            top.plot(xs, [100 * p.host_hit_rate for p in pts], color=color, linestyle=line,
                     marker="o", label=policy)
            bottom.plot(xs, [p.ttft_speedup for p in pts], color=color, linestyle=line,
                        marker="o", label=policy)
        ref = refs.get(preset)
        if ref is not None:
            top.axhline(100 * ref.host_hit_rate, color="gray", linewidth=0.8)
            top.axhline(90 * ref.host_hit_rate, color="gray", linewidth=0.8, linestyle=":")
        top.set_title(f"{preset}\nworking set {format_bytes(ref.working_set_bytes)}"
                      if ref else preset, fontsize="medium")
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_xticks([100 * f for f in FRACTIONS])
            ax.set_xticklabels([f"{100 * f:g}" for f in FRACTIONS])
            ax.grid(True, alpha=0.3)
        bottom.set_xlabel("host capacity (% of store-everything working set)")
        if col == 0:
            top.set_ylabel("prompt tokens served from host (%)")
            bottom.set_ylabel("mean modelled TTFT speed-up")
        top.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def result_rows(points: list[SweepPoint]) -> list[str]:
    rows = ["| preset | capacity | policy | host | host hit | prefill tokens saved | "
            "TTFT mean | speed-up |", "|---|---|---|---|---|---|---|---|"]
    for preset in PRESETS:
        for fraction in FRACTIONS:
            for policy in series(points):
                for p in curve(points, preset, policy):
                    if p.capacity_fraction != fraction:
                        continue
                    rows.append(
                        f"| {preset} | {100 * fraction:g} % | {policy} | "
                        f"{format_bytes(p.host_capacity_bytes)} | "
                        f"{100 * p.host_hit_rate:.2f} % | {p.prefill_tokens_saved:,.0f} | "
                        f"{format_seconds(p.ttft_mean_s)} | {p.ttft_speedup:.3f}x |")
    return rows


def at(points: list[SweepPoint], preset: str, policy: str, fraction: float) -> SweepPoint | None:
    for p in curve(points, preset, policy):
        if abs(p.capacity_fraction - fraction) < 1e-9:
            return p
    return None


def goal_rows(points: list[SweepPoint], refs: dict[str, Reference]) -> list[str]:
    """Each goal, measured, and whether it is met (computed from the data)."""
    rows = ["| preset | goal | measured | met |", "|---|---|---|---|"]
    for preset in PRESETS:
        ref = refs.get(preset)
        if ref is None:
            continue
        target = 0.9 * ref.host_hit_rate
        value = memory_to_reach(curve(points, preset, "value"), target)
        lru = memory_to_reach(curve(points, preset, "lru"), target)
        if preset in MEMORY_GOALS:
            goal = MEMORY_GOALS[preset]
            if value is not None and lru is not None:
                ratio = value / lru
                measured = (f"{format_bytes(value)} vs {format_bytes(lru)} = {ratio:.2f} "
                            "of LRU's")
                met = "yes" if ratio <= goal else "no"
            else:
                measured = (f"value {format_bytes(value) if value else 'not reached'}, "
                            f"LRU {format_bytes(lru) if lru else 'not reached'} (within 50 %)")
                met = "yes" if value is not None and lru is None else "no"
            rows.append(f"| {preset} | memory to 90 % of unbounded ≤ {goal:g} × LRU's | "
                        f"{measured} | {met} |")
        v2, l2 = at(points, preset, "value", 0.02), at(points, preset, "lru", 0.02)
        if preset in HIT_GOALS and v2 is not None and l2 is not None:
            goal = HIT_GOALS[preset]
            if l2.host_hit_rate > 0:
                ratio = v2.host_hit_rate / l2.host_hit_rate
                measured = (f"{100 * v2.host_hit_rate:.2f} % vs {100 * l2.host_hit_rate:.2f} %"
                            f" = {ratio:.2f}x")
                met = "yes" if ratio >= goal else "no"
            else:
                measured = (f"{100 * v2.host_hit_rate:.2f} % vs 0 %")
                met = "yes" if v2.host_hit_rate > 0 else "no (both 0)"
            rows.append(f"| {preset} | host hit at 2 % ≥ {goal:g} × LRU's | {measured} | {met} |")
        worst = max((100 * (lp.host_hit_rate - vp.host_hit_rate), lp.capacity_fraction)
                    for lp in curve(points, preset, "lru")
                    if (vp := at(points, preset, "value", lp.capacity_fraction)) is not None)
        rows.append(f"| {preset} | never more than {MAX_LOSS_POINTS} point below LRU | "
                    f"largest shortfall {max(worst[0], 0.0):.2f} points "
                    f"(at {100 * worst[1]:g} %) | "
                    f"{'yes' if worst[0] <= MAX_LOSS_POINTS else 'no'} |")
    return rows


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def distance_rows(points: list[SweepPoint], refs: dict[str, Reference],
                  series: str = "value") -> list[str]:
    """``series`` (``value`` by default) against the oracle: memory to reach 90 % of the
    unbounded hit rate as a multiple of the oracle's, and the host hit rate at each
    capacity as a share of the oracle's (the oracle's own rate in brackets)."""
    shown = [f for f in FRACTIONS if f <= ORACLE_HIT_RANGE[1]]
    rows = ["| preset | memory vs oracle | "
            + " | ".join(f"hit at {100 * f:g} %" for f in shown) + " |",
            "|---|---|" + "---|" * len(shown)]
    for preset in PRESETS:
        ref = refs.get(preset)
        if ref is None or not curve(points, preset, "oracle") or not curve(points, preset,
                                                                            series):
            continue
        value = memory_to_90(points, refs, preset, series)
        oracle = memory_to_90(points, refs, preset, "oracle")
        cells = []
        for f in shown:
            v, o = at(points, preset, series, f), at(points, preset, "oracle", f)
            if v is None or o is None:
                cells.append("-")
            elif o.host_hit_rate == 0:
                cells.append("both 0" if v.host_hit_rate == 0
                             else f"oracle 0 ({100 * v.host_hit_rate:.2f} %)")
            else:
                cells.append(f"{v.host_hit_rate / o.host_hit_rate:.2f} "
                             f"({100 * o.host_hit_rate:.2f} %)")
        rows.append(f"| {preset} | {_ratio(value, oracle)} | " + " | ".join(cells) + " |")
    return rows


def oracle_goal_rows(points: list[SweepPoint], refs: dict[str, Reference]) -> list[str]:
    """The goals against the oracle, measured, and whether each is met."""
    rows = []
    for preset in PRESETS:
        ref = refs.get(preset)
        if ref is None or not curve(points, preset, "oracle"):
            continue
        oracle = memory_to_90(points, refs, preset, "oracle")
        value = memory_to_90(points, refs, preset, "value")
        if value is not None and oracle is not None:
            ratio = value / oracle
            rows.append(f"| {preset} | memory to 90 % of unbounded ≤ {ORACLE_MEMORY_GOAL:g} × "
                        f"the oracle's | {format_bytes(value)} vs {format_bytes(oracle)} = "
                        f"{ratio:.2f}x | {'yes' if ratio <= ORACLE_MEMORY_GOAL else 'no'} |")
        else:
            rows.append(f"| {preset} | memory to 90 % of unbounded ≤ {ORACLE_MEMORY_GOAL:g} × "
                        f"the oracle's | value {format_bytes(value) if value else 'not reached'}"
                        f", oracle {format_bytes(oracle) if oracle else 'not reached'} | "
                        f"{'yes' if value is not None else 'no'} |")
        lowest = oracle_distance(points, refs, preset)[1]
        if lowest is not None:
            worst, where = lowest
            rows.append(f"| {preset} | host hit ≥ {ORACLE_HIT_GOAL:g} × the oracle's from "
                        f"{100 * ORACLE_HIT_RANGE[0]:g} to {100 * ORACLE_HIT_RANGE[1]:g} % | "
                        f"lowest {worst:.2f}x (at {100 * where:g} %) | "
                        f"{'yes' if worst >= ORACLE_HIT_GOAL else 'no'} |")
        hinted = memory_to_90(points, refs, preset, HINTED_SERIES)
        if not curve(points, preset, HINTED_SERIES):
            measured, met = "not measured", "not measured"
        elif hinted is not None and oracle is not None:
            measured = (f"{format_bytes(hinted)} vs {format_bytes(oracle)} = "
                        f"{hinted / oracle:.2f}x")
            met = "yes" if hinted / oracle <= HINTED_MEMORY_GOAL else "no"
        else:
            measured, met = "not reached", "no"
        rows.append(f"| {preset} | with 90 %-accurate hints, memory ≤ {HINTED_MEMORY_GOAL:g} × "
                    f"the oracle's | {measured} | {met} |")
    return rows


def memory_to_90(points: list[SweepPoint], refs: dict[str, Reference], preset: str,
                 series: str) -> float | None:
    """Host memory ``series`` needs to reach 90 % of ``preset``'s unbounded host hit rate
    (None if it never does)."""
    return memory_to_reach(curve(points, preset, series), 0.9 * refs[preset].host_hit_rate)


def oracle_distance(points: list[SweepPoint], refs: dict[str, Reference], preset: str
                    ) -> tuple[float | None, tuple[float, float] | None]:
    """``value``'s memory to 90 % of the unbounded hit rate over the oracle's (None if
    either is not reached), and its lowest host hit share of the oracle's in
    ``ORACLE_HIT_RANGE`` with where (None if the oracle has no hit there)."""
    value = memory_to_90(points, refs, preset, "value")
    oracle = memory_to_90(points, refs, preset, "oracle")
    shares = [(v.host_hit_rate / o.host_hit_rate, o.capacity_fraction)
              for o in curve(points, preset, "oracle")
              if ORACLE_HIT_RANGE[0] <= o.capacity_fraction <= ORACLE_HIT_RANGE[1]
              and o.host_hit_rate > 0
              and (v := at(points, preset, "value", o.capacity_fraction)) is not None]
    return (value / oracle if value is not None and oracle else None,
            min(shares) if shares else None)


def oracle_summary(data: dict[str, Any]) -> list[str]:
    """What the distance tables say, per workload, with every missed goal and by how much."""
    lines = []
    for key, name in (("mooncake", "On the trace"), ("agentic", "On the agentic workload")):
        points, refs = load_points(data[key])
        rows = [(preset, *oracle_distance(points, refs, preset)) for preset in PRESETS
                if preset in refs and curve(points, preset, "oracle")]
        if not rows:
            continue
        memory = ", ".join(f"{m:.2f}x ({p})" if m is not None else f"not reached ({p})"
                           for p, m, _ in rows)
        hits = ", ".join(f"{h[0]:.2f}x ({p}, at {100 * h[1]:g} %)" for p, _, h in rows
                         if h is not None)
        missed = [f"{p} {m:.2f}x" for p, m, _ in rows
                  if m is not None and m > ORACLE_MEMORY_GOAL]
        short = [f"{p} {h[0]:.2f}x at {100 * h[1]:g} %" for p, _, h in rows
                 if h is not None and h[0] < ORACLE_HIT_GOAL]
        lines.append(
            f"{name}, `value` needs {memory} the oracle's memory to reach 90 % of the "
            f"unbounded hit rate, and its lowest host hit rate from "
            f"{100 * ORACLE_HIT_RANGE[0]:g} to {100 * ORACLE_HIT_RANGE[1]:g} % of the working "
            f"set is {hits} of the oracle's. "
            + (f"The memory goal (at most {ORACLE_MEMORY_GOAL:g}x) is missed by "
               f"{', '.join(missed)}. " if missed else
               f"The memory goal (at most {ORACLE_MEMORY_GOAL:g}x) is met on every preset. ")
            + (f"The hit goal (at least {ORACLE_HIT_GOAL:g}x) is missed by "
               f"{', '.join(short)}." if short else
               f"The hit goal (at least {ORACLE_HIT_GOAL:g}x) is met on every preset."))
    if not lines:
        lines.append("The oracle's series are not in `docs/policy_data.json` yet, so the "
                     "distance to it is not measured here: `benchmarks/make_policy_doc.py "
                     "--add-policies oracle` runs them and renders this page with them.")
    return lines


def workload_section(name: str, data: dict[str, Any], image: str) -> list[str]:
    points, refs = load_points(data)
    requests = points[0].requests if points else 0
    lines = [f"## {name}", "",
             f"{data['workload']}: {requests} requests per run"
             f"{' on average' if 'mean of seeds' in data['workload'] else ''} "
             f"({(data['wall_s'] + sum(data.get('series_wall_s', {}).values())) / 60:.0f}"
             " min of simulation for the whole grid).", "",
             "Store-everything working set and unbounded hit rate (LRU, 1 PiB of host "
             "memory, nothing evicted):", "",
             "| preset | working set | host hit, unbounded | engine + host, unbounded |",
             "|---|---|---|---|"]
    for preset in PRESETS:
        ref = refs.get(preset)
        if ref:
            lines.append(f"| {preset} | {format_bytes(ref.working_set_bytes)} | "
                         f"{100 * ref.host_hit_rate:.2f} % | {100 * ref.hit_rate:.2f} % |")
    distance = oracle_goal_rows(points, refs)
    goals = goal_rows(points, refs)
    goals += distance
    lines += ["", f"![{name}](img/{image})", "", "### Goals", "", *goals, ""]
    if distance:
        lines += ["### Distance to the oracle", "",
                  "`value` against the oracle: its host memory to reach 90 % of the "
                  "unbounded hit rate as a multiple of the oracle's, and its host hit rate at "
                  "each capacity (share of the working set) as a share of the oracle's (the "
                  "oracle's own host hit rate in brackets). Above 1, `value` did better than "
                  "the oracle, which is a heuristic bound (see \"The oracle\" above).", "",
                  *distance_rows(points, refs), ""]
        hinted = distance_rows(points, refs, HINTED_SERIES)
        if len(hinted) > 2:
            lines += ["The same for `value` with client hints drawn at 90 % accuracy "
                      f"(`{HINTED_SERIES}`; \"Hints from clients\" below):", "", *hinted, ""]
    lines += ["### Memory to reach 90 % of the unbounded hit rate", "", "```",
              format_rows(goal_table(points, refs)), "```", "", "### Every point", "",
              *result_rows(points), ""]
    return lines


def reuse_section(data: dict[str, Any], preset: str = "nemotron-h-8b") -> list[str]:
    """Which prompts of the trace come back, at ``preset``'s block size, and what that
    means for its memory goal (the trace's own slice; the sweep's curves for the ratio).
    Each reading is stated only where the figures bear it out."""
    block = auto_block_size(PRESET_SPECS[preset])
    report = continuation_report(read_mooncake_trace(TRACE, limit=data["limit"]), block)
    points, refs = load_points(data)
    target = 0.9 * refs[preset].host_hit_rate
    value_memory = memory_to_reach(curve(points, preset, "value"), target)
    lru_memory = memory_to_reach(curve(points, preset, "lru"), target)
    turns = report.features["turn in its conversation"]
    if (value_memory is None or lru_memory is None or not report.continued
            or not turns or turns[0].label != "0"):
        return []
    first, later = turns[0], turns[1:]
    later_rate = (sum(b.continued for b in later) / sum(b.requests for b in later)
                  if later else 0.0)
    first_share = first.continued / report.continued
    reading = []
    if later_rate > first.rate:
        reading.append("Later turns of a conversation come back more often "
                       f"({100 * later_rate:.1f} % against {100 * first.rate:.1f} %), and "
                       "`value` already counts a prefix reached through a hit as worth "
                       "more.")
    if first_share >= 0.5:
        reading.append(
            f"But first turns are {100 * first.requests / report.requests:.0f} % of the "
            f"prompts and give {100 * first_share:.0f} % of all continuations: reaching 90 % "
            "of the unbounded hit rate means keeping nearly every first turn's "
            "full-attention blocks and state until its continuation comes, up to "
            f"{quantile(report.gap_requests, 0.9):,.0f} requests later (90th percentile).")
    longest = []
    for feature, length in (("prompt tokens", "prompt length"),
                            ("output tokens", "output length")):
        rates = [b.rate for b in report.features[feature]]
        if len(rates) > 1 and rates[-1] == max(rates):
            longest.append(f"{length} ({100 * rates[-1]:.1f} % against "
                           f"{100 * min(rates):.1f} % at the least)")
    if longest:
        reading.append(f"By {' and by '.join(longest)}, the longest quartile comes back "
                       "most often; `value`'s compute per byte already favours long "
                       "prefixes (it values a request's keys at the end of all it stored, "
                       "output included).")
    reading.append(
        "`value` stores states only at likely hit points and evicts by value, and needs "
        f"{format_bytes(value_memory)} ({value_memory / lru_memory:.2f} of LRU's "
        f"{format_bytes(lru_memory)}). Half of LRU's would take knowing which prompts "
        "come back, which the requests tell only as weakly as the tables show.")
    return ["### Which prompts come back", "",
            f"The goal for {preset} (half of LRU's memory to reach 90 % of the unbounded "
            f"hit rate) is not met. {preset} hits only where a later prompt continues an "
            f"earlier one at the end of a {block}-token block whose Mamba state was kept, "
            "so what matters is which prompts come back. `benchmarks/trace_reuse.py` "
            "measures it on the same requests, at those blocks:", "",
            *format_report(report), "", " ".join(reading), ""]


EXPLANATION = """\
# The hybrid-aware cache policy (`value`)

kvoffload's host tier can run plain LRU or ARC over every block it is given
(*store everything*), or the hybrid-aware policy `value`. Select it with
`--policy value` (`kvoffload simulate` / `sweep`), `eviction_policy="value"` in
`OffloadConfig`, or `"eviction_policy": "value"` in the vLLM connector's
`kv_connector_extra_config`. The planner's rules (load only readable blocks, pin while
loading, fence blocks a store still reads, exact completion counting) are the same under
every policy: the policy only decides *which* window blocks and Mamba states are stored
and *which* idle keys are evicted. One entry of the cache-policy registry
(`kvoffload.policies`) gives both halves: the planner's store policy
(`planner/selective.py`) and the host tier's eviction (`tiers/eviction/value.py`).

## The default

`value` is the default cache policy everywhere: the library's `OffloadConfig`
(`kvoffload.config.DEFAULT_POLICY`), the vLLM connector (`"eviction_policy"` in
`kv_connector_extra_config`) and `kvoffload simulate`; `sweep` compares it with `lru`, the
plain store-everything reference, and `plan` with every registered policy. In every sweep
below -- four models (dense, sliding window, Mamba hybrid), two workloads, 11 host
capacities from 1 to 100 % of the working set -- it is nowhere more than 0.26 points of
prompt tokens below LRU (the largest gaps: the agentic workload, Nemotron-H at 10 % and
gpt-oss-20b at 30 % of the working set), and it reaches 90 % of the unbounded hit rate
with 0.34x (Gemma 3 on the trace) to 1.00x (Llama 3, a dense model, where it stores
exactly what LRU stores) of LRU's host memory. Nothing is lost by choosing it, and hybrid
models need far less memory.
Pass `--policy lru` (or `"eviction_policy": "lru"`) for plain store-everything.

## What it does

**Admission per group kind.** A hit at token *t* needs every full-attention block before
*t*, only the last *W* tokens of a sliding-window group, and exactly one Mamba state, the
one at *t*. Storing everything keeps window blocks and states that no hit can use.

* Full-attention blocks: always stored (every hit needs all of them).
* Window blocks and Mamba states: stored only where they belong to the window or state of
  a *likely hit point*. The points are a policy (`HitPointAdmission`), not a constant:
  the end of the prompt; every point after it while the request decodes (the end of the
  turn, where a conversation's next turn hits; those that turn out not to be the end are
  demoted when the request finishes), as long as later prompts are seen to reach turn
  ends; the last multiples of the *sharing granule* before
  the prompt's end (the unit in which requests have been seen to share prefixes, learned
  from where full-attention prefixes found in the cache end; two multiples, and more, up
  to 8, where at least one in four later prompts that branch off a finished prompt do so
  that deep below its end); and points learned from misses, where a lookup
  found the full-attention prefix but a window block or state was missing (a branch
  point), so the next request through them stores there.
* The *resume point* of a prefill in progress: the engine preempts requests when its own
  memory runs short, and a preempted request restarts from the last point it finds whole
  in the cache. So while a prompt is being computed, the window and state at the point
  its prefill has reached are stored *provisionally*, and demoted (evicted first) once
  the prefill has stored a later point or the request finishes. Before this rule, a
  preempted request under `value` recomputed its prompt from the last granule point, and
  at small capacities `value` saved fewer prefill tokens than LRU (on Gemma 3 at 1 % of
  the first 1000 requests' working set, fewer than no offloading at all).
* *Cheap checkpoints.* A passed resume point is kept, not demoted, when its window and
  state cost at most a tenth of the full-attention blocks the request stored since its
  last kept point: a later request that branches off the prompt somewhere after it
  loses only the tokens since. That keeps every resume point on gpt-oss-20b (its window
  is one block) and one every ~53k tokens on Gemma 3 (four blocks of 52 layers).
* *Turn ends are learned.* A next turn hits at the end of the previous one only when its
  prompt repeats the output. Reasoning models whose thinking is dropped from the history
  do not, and neither do the trace's conversations (the simulator's outputs are not in
  the next prompts). So the policy records where turns end and counts how many a later
  prompt's full-attention prefix reaches, whether or not the window or state is there.
  Once 32 turn ends are recorded (a count that decays, so it follows a changing
  workload) and fewer than 1 in 16 were reached, points after the prompt stop being hit
  points, and their blocks are only spare. On the trace, this saves Nemotron-H a state
  per request. On the agentic workload, where most turn ends are reached, nothing
  changes.
* While host memory is not full, everything is admitted: selective admission only
  matters when memory is short, and must not lose hits storing everything would have had.
  But what no likely hit point needs is *spare*, and demoted when its request finishes:
  once memory runs short it goes first, not when its prefix does. A demoted block that is
  used again (a hit nobody predicted) is normal again. Before this rule, on the first
  1000 requests of the trace, the window blocks stored while host memory was filling
  were 41 % of those Gemma 3 held at 30 % capacity, and `value` needed 0.61 of LRU's
  memory to reach 90 % of the unbounded hit rate there instead of 0.36.

**Eviction by value per byte, blended with recency.** Each stored prefix is valued by the
prefill compute a hit at its end saves (the model's FLOPs for all its tokens, across all
layers) divided by the bytes that hit needs (all its full-attention blocks, its last
window, its state). A prefix that was itself reached through a hit counts more (it is a
conversation that continues). A key's eviction priority is, as in Marconi, recency plus a
weighted value: `clock + weight × n × density / mean density`, where the clock ticks once
per key inserted or used and `n` keys are one generation of the cache, so a key of twice
the mean value survives about `weight` generations longer than a mean one (`weight` is
0.25). All
keys of one request share its prefix's value and a value never moves a key in time, so
within a prefix the early blocks (which every deeper hit needs) stay longest, as under
LRU.

**Consistency of a hit point.** Every window block and Mamba state names the
full-attention block it cannot serve without (its *anchor*). Evicting an anchor demotes
its dependents to the front of the eviction order: they are worthless now. The reverse
(demoting full-attention blocks once no hit point at or below them keeps its window or
state) is not a rule: within a prefix recency already evicts the deepest blocks first, so
on the first 1000 requests of the trace it changed the host hit by at most 0.12 points,
and on the agentic
workload (4 sessions a run then) it cost Nemotron-H 3.4 points at 10 %.

**Insertion that adapts to capacity.** Blocks are stored as they are computed, so under
LRU insertion host memory holds the newest blocks, which the engine's own prefix cache
still holds too. Where host memory is small against the distance at which prefixes come
back (on the trace, below about twice the engine's cache), every block is gone before
anyone asks for it again; at the smallest capacities the blocks of the requests running
at once are already more than host memory holds. Bimodal insertion (after DIP, Qureshi
et al. 2007) stores the blocks of most requests *cold*, first in line for eviction, as
they are written, so that the others stay long enough for their prefixes to come back;
a block that is hit becomes normal. One request in eight is stored normally, and so is
a prefill's resume point. Three rules keep its cost small:

* Normal blocks are evicted before cold ones once they are more than 90 % of the blocks
  held, so the newest cold blocks (those of running requests) always keep some room.
* When the engine preempts a request, its cold blocks become normal: it reloads them
  when it resumes.
* Which insertion is better depends on capacity, so two *shadow directories* (keys
  only, no data) at the tier's budget run LRU and bimodal insertion side by side on the
  same stores, demotions, preemptions and lookups. Requests without a `continues` hint
  are stored cold only while the bimodal directory would have served clearly more (1.25
  times) full-attention tokens over the last few hundred lookups than the LRU one, and
  than the tier itself served while inserting normally. A request with one is stored
  as its hint says ("Hints from clients", below).

**Memory per group in bytes.** Pages differ in size across groups (a Gemma 3 window
block holds 52 layers, its full-attention block 10; a Nemotron-H Mamba state is about six
times a full-attention block). With `host_accounting="bytes"` the host tier charges each
block its own group's bytes against one budget. The sweeps below use it for every policy,
so the comparison is about the policy alone. The worker's host arena gives every block a
slot of the largest group's size. In vLLM that is exact: its hybrid allocator gives every
KV cache group's block the same page size (it splits layer types into groups of equal
layer counts and pads pages to match), so the connector's slot accounting charges each
block its bytes. For an engine whose groups differ in size, byte accounting is modelled
in the simulator until the arena packs groups by size.

## The oracle

`--policy oracle` (in `kvoffload simulate`, `sweep` and `plan`) is a reference, not a
policy a deployment can run: it knows the future of the workload it replays, so the
library's `OffloadConfig` and the vLLM connector refuse it with a `ConfigError` that says
so. Before the replay, `kvoffload.sim.oracle.future` hashes every request as the engine does
and finds, for each, where its hit would end against an unbounded cache of everything
the requests before it held (its prompt's longest prefix that an earlier request's
tokens contain, capped and rounded as the planner caps and rounds a hit), and which keys
that hit reads: every full-attention block, the last window, the Mamba state at the hit.
A request's output counts only where the workload gives it (the agentic workload's
outputs are in its next prompts; the trace's are not), less its last decode step, whose
KV the engine never computes; where that makes two points possible, both count. The
engine's own prefix cache is modelled too, as an LRU of the engine's blocks touched by
each request in turn: a hit it would serve whole is the engine's, not a tier's (except
with a Mamba group, whose states the engine caches only where a step ended on a block
boundary, which the future cannot tell). The oracle then

* stores full-attention blocks as every policy does, and a window block or Mamba state
  only where a request that has not started yet reads it;
* evicts the idle key whose next read lies furthest ahead, weighted by its bytes: the
  victim maximises (next read - now) x bytes, counted in requests, where a key only the
  engine's cache is modelled to serve ranks after every key a tier serves, and a key no
  later request reads goes first. This is Belady's rule with sizes. With keys of different
  sizes, and hits that need a whole prefix, finding the best victims is NP-hard, so the
  oracle is a heuristic bound, not the optimum.

It runs through the same planner, engine and byte accounting as every other policy; all
it learns from the replay is which requests have started. What it does not know is where
its models are wrong: when the engine's cache really serves a hit (the model ignores the
blocks running requests hold, and the order in which the scheduler admits them), and
when a request is preempted (it keeps no resume points). Where `value` beats it, a ratio
above 1 in "Distance to the oracle" says so: the bound is loose there.

ORACLE_SUMMARY

**Why `value` is far from the oracle on the trace.** The gap is in eviction, not in
admission. On llama3-8b, a dense model for which `value` stores exactly what LRU stores,
the oracle reaches 90 % of the unbounded hit rate with about a fifth of the memory, only
by keeping the prefixes that will come back and dropping those that will not. On the
trace nothing a request carries predicts which first turns come back ("Which prompts come
back", below), so no online policy can make that choice, and the hit goal is missed most
at 5 % of the working set, where that choice is all that counts. A client that knows
whether its conversation goes on can make it: with a `continues` hint, `value` stores the
new blocks of a conversation that ends *cold* (first in line for eviction) and those of
one that goes on normally ("Hints from clients", below). With hints drawn at 90 %
accuracy that closes much of the gap on the trace (the second distance table): at 5 % of
the working set from 0.27x to 0.61x the oracle's host hit on gpt-oss-20b, 0.72x to 1.02x
on gemma3-27b, 0.42x to 0.66x on nemotron-h-8b and 0.24x to 0.34x on llama3-8b; at 20 %
every preset is at 0.85x or more. Without hints the choice is left to the insertion duel
and recency. The rule has no parameter fitted to the trace, and the trace's second half
says the same: on the 2000 requests after its midpoint in time (`tail -n +5607
mooncake_conversation_trace.jsonl | head -n 2000`, the same sweep), `value` with 90
%-accurate hints reaches 0.28x (llama3-8b) and 0.49x (gpt-oss-20b) the oracle's host hit
at 5 % of that slice's working set, 0.52x and 0.80x at 10 %, 0.83x and 0.95x at 20 %,
against 0.13x and 0.21x, 0.22x and 0.44x, 0.45x and 0.77x without hints.
On Nemotron-H the oracle does not reach 90 % of the unbounded
hit rate at any capacity measured, so the bound is loose there and the memory goal is
counted as met only because `value` reaches the target and the oracle does not. On the
agentic workload, where turns do come back and `value` learns it, `value` is at or above
the oracle except for llama3-8b at the smallest capacities.

## Reading the results

* *Host hit* counts prompt tokens loaded from host memory when a request first starts.
  *Prefill tokens saved* also counts work saved or lost after preemptions: a preempted
  request reloads its own blocks from host memory (its resume point, under `value`).
  Where the engine's own cache serves a prefix that host memory would have served, the
  host hit falls but nothing is lost: read the host hit with the prefill saved and TTFT
  columns (on the agentic workload at 30 % for gpt-oss-20b, `value` has the lower host
  hit and the faster TTFT).
* A goal marked "both 0" means neither policy had a single host hit at that capacity
  (the engine's own prefix cache serves what little reuse there is).
* The smallest capacities sit in the shadow of the engine's own prefix cache. On the
  trace the engine holds 1M tokens: 48 GiB of KV for gpt-oss-20b, against HOST_1 and HOST_2
  of host memory at 1 and 2 %. Every request that comes back within the engine's reach hits
  the engine, not host memory, so at 1-5 % host hits are the few prefixes that outlive
  the engine's copy. Halving the bytes a prefix needs there does not double the hits,
  because the hit-rate curve is nearly flat below the engine's size; bimodal insertion
  is what lifts the curve once host memory nears the engine's size (5-20 %).
* The byte accounting is modelled: the sweeps charge every block its group's real bytes
  (the presets keep each layer type in one group), while the worker's host arena backs
  every block with a slot of the largest group's size (exact in vLLM, whose groups are
  equal in size; see above).

## How the curves are made

`.venv/bin/python benchmarks/make_policy_doc.py` regenerates this page. The trace figures
are over its first LIMIT requests (of TRACE_REQUESTS; `--limit` sets it). The first 1000 are
mostly the engine's warm-up: there host memory at 1-5 % of the working set serves a few
dozen hits over the whole run, so those points move with single requests. For each workload and
preset it first runs store-everything LRU with unbounded host memory: its peak host
memory is the *working set*, its host hit rate the *unbounded hit rate*. Then LRU, ARC,
`value` and the oracle run at PERCENTS % of that working set (the points above 50 % are there so the
memory to reach 90 % of the unbounded hit rate can be read between close points), in the
same `run_sweep` call that `kvoffload sweep --capacity-fraction` uses. *Host hit* is the share
of prompt tokens loaded from host memory (the engine's own prefix cache is the same for
every policy and is not counted); *prefill tokens saved* compares with a run without
offloading; *TTFT* is the modelled time to first token (prefill FLOPs at 400 TFLOP/s plus
loaded bytes at 25 GB/s). The same comparison by hand:

```bash
kvoffload sweep --preset gpt-oss-20b,gemma3-27b,llama3-8b \\
    --block-size 64 --block-size-factor 4 \\
    --trace ../shared/traces/mooncake_conversation_trace.jsonl --limit LIMIT \\
    --policy lru,arc,value,oracle --capacity-fraction FRACTIONS \\
    --host-accounting bytes
kvoffload sweep --preset nemotron-h-8b ...same options without --block-size...
kvoffload sweep --workload agentic --sessions SESSIONS --seeds SEEDS ...same options...
```

Attention-only presets run with engine blocks of 64 tokens offloaded four at a time
(256-token host blocks); Nemotron-H runs at vLLM's page-matching block size. The engine
holds 1M tokens for the trace and 32k tokens for the agentic workload.

A full run takes over an hour on two cores. `--add-policies oracle` runs only the series
the saved data lacks (per policy, workload and preset, at the saved working sets) and
merges them into `docs/policy_data.json`; `--replace` runs them again; `--from-json`
renders. A series is named by its label, so `value` with client hints drawn at 90 %
accuracy is added as `--add-policies value+hints90` (on a simulator that has
`hint_accuracy`), and the goal row for hints reads it.
"""


HINTS_SECTION = """## Hints from clients

A request may say what its client knows (`RequestControls.continues` and `session_id` in
the library; `conversation_continues` and `session_id` in vLLM's `kv_transfer_params`,
`docs/vllm.md`). The `hybrid` and `value` policies use a hint where one is given and learn
as above where none is; `lru` and `arc` ignore hints. A hint changes only what is stored,
how it enters host memory and what is demoted, never what a hit loads (the planner state
machine test drives random hints under every policy and checks every loaded block):

* `continues=True`: the prompt's end and every point after it are hit points, whatever was
  learned about turn ends: the windows and states at the end of the prompt and of the turn
  are stored, not spare, and not demoted when the request finishes (decode blocks before
  the turn's end still are).
* `continues=False`: neither the prompt's end nor the points after it are hit points: their
  windows and states are spare while the tier has room (demoted at the finish), not
  stored once it is full. What other requests may share stays: full-attention blocks, the
  granule multiples before the prompt's end (a prompt ending on one keeps it) and points
  learned from misses.
* Under `value`, a hint also sets how the request's new blocks enter host memory, whatever
  the insertion duel says: cold (evicted before normal blocks unless those are more than
  90 % of the blocks held, as bimodal insertion stores them) for `continues=False`, since
  no later turn reads what only this prompt has (a branch that does finds them while they
  last, and its hit makes them normal); normally for `continues=True`, since its next
  turn reads them. Without a hint the duel decides, as above.
* `session_id`: the policy remembers the last 65,536 session ids it saw at a first lookup;
  a request whose session an earlier request had, and which gives no `continues`, is
  taken as `continues=True`. The first request of a session is learned as without hints.

Dropping the granule multiples as well under `continues=False` was tried and is worse: on
the trace below, with exact hints (before hints set the insertion), `value`'s host hit fell
from 3.48 % to 2.99 % at 15 % of the working set (from 1.71 % to 1.55 % at 5 %): those
multiples are where *other*
conversations branch off (a shared system prompt), which the hint does not speak of.

**What hints are worth.** `--hint-accuracy P` draws each request's `continues` from the
workload's own future (a later prompt contains its whole prompt; `docs/simulator.md`),
flipped with probability 1 − P. Host hit rate of `value` (share of prompt tokens loaded
from host memory), Nemotron-H, against LRU on the same runs:

Built-in agentic workload, 16 sessions, mean of seeds 0–3 (374 requests per run):

```bash
kvoffload sweep --preset nemotron-h-8b --policy value,lru --workload agentic --sessions 16 \\
    --seeds 0,1,2,3 --capacity-fraction 0.05,0.1,0.2,0.3 [--hint-accuracy P]
```

| of working set | lru | value, no hints | value, hints 100 % | 90 % | 70 % |
|---|---|---|---|---|---|
| 5 % | 15.66 % | 17.22 % | 17.67 % | 17.11 % | 16.35 % |
| 10 % | 35.34 % | 35.60 % | 38.85 % | 40.15 % | 38.32 % |
| 20 % | 58.77 % | 58.99 % | 59.71 % | 59.65 % | 59.32 % |
| 30 % | 62.57 % | 62.52 % | 63.48 % | 63.55 % | 63.39 % |

Mooncake conversation trace, first 1000 requests:

```bash
kvoffload sweep --preset nemotron-h-8b --policy value,lru \\
    --trace mooncake_conversation_trace.jsonl --limit 1000 \\
    --capacity-fraction 0.05,0.15,0.3 [--hint-accuracy P]
```

| of working set | lru | value, no hints | value, hints 100 % | 90 % | 70 % |
|---|---|---|---|---|---|
| 5 % | 0.14 % | 1.71 % | 3.17 % | 2.05 % | 0.89 % |
| 15 % | 2.20 % | 3.48 % | 13.14 % | 10.03 % | 7.32 % |
| 30 % | 9.69 % | 10.25 % | 15.69 % | 14.67 % | 12.78 % |

On the trace the hint is worth most through insertion. Only 28 % of the first 1000
requests are continued by a later one; the other 72 % store their new blocks cold, so the
blocks of conversations that go on stay, and at 15 % of the working set exact hints
almost quadruple `value`'s host hit (3.48 % to 13.14 %), 90 %-accurate ones nearly
triple it. What hints do to windows and states matters little there: the continued
requests are continued at their last full 512-token hash block (a trace's last, partial
block is never shared), a granule point `value` keeps for every prompt anyway, and the
windows and states at the prompt's own end, which `continues=True` keeps, are never read.
Wrong hints cost: at 5 % with 70 %-accurate hints `value` stays above LRU but falls below
itself without hints (0.89 % against 1.71 %), because a wrong `false` sends a conversation
that comes back to the front of the eviction order. On the agentic workload, where most
turns are continued and `value` already learns that turn ends are reached, hints add up
to 4.6 points (10 %). Session ids are not measured: in these runs every request carries
`continues`, which takes precedence.

The hint-accuracy series of the tables above (`value+hints90`) measure the same on every
preset at every capacity; the memory each needs to reach 90 % of the unbounded hit rate
is in their "Memory to reach" tables.
"""
"""What client hints do and what they were measured to be worth (the runs are in the
section's own commands, not in ``docs/policy_data.json``)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=2000,
                        help="trace requests (default 2000)")
    parser.add_argument("--agentic-limit", type=int, default=None,
                        help="agentic workload requests (default: all)")
    parser.add_argument("--presets", default=",".join(PRESETS),
                        help="comma-separated presets (default: all four)")
    parser.add_argument("--from-json", action="store_true",
                        help=f"re-render from {DATA.relative_to(ROOT)} without running")
    parser.add_argument("--add-policies", metavar="LABELS",
                        help="comma-separated series (oracle, value+hints90, ...) to run "
                             "where the saved data lacks them, merged into it")
    parser.add_argument("--replace", action="store_true",
                        help="with --add-policies: drop the saved series of those labels "
                             "first and run them again")
    args = parser.parse_args()
    if args.from_json:
        data = json.loads(DATA.read_text())
    elif args.add_policies:
        data = json.loads(DATA.read_text())
        labels = tuple(p for p in args.add_policies.split(",") if p)
        presets = tuple(p for p in args.presets.split(",") if p)
        if args.replace:
            for saved in data.values():
                saved["points"] = [p for p in saved["points"] if p["policy"] not in labels
                                   or p["preset"] not in presets]
                for label in labels:
                    saved.get("series_wall_s", {}).pop(label, None)
        add_series(data, labels, presets)
        DATA.write_text(json.dumps(data, indent=1))
    else:
        presets = tuple(p for p in args.presets.split(",") if p)
        with ProcessPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            # One job per workload and preset, longest (the trace) first.
            jobs = {(workload, preset): pool.submit(sweep, workload, limit, preset)
                    for workload, limit in (("mooncake", args.limit),
                                            ("agentic", args.agentic_limit))
                    for preset in presets}
            data = {workload: merge([jobs[workload, preset].result() for preset in presets])
                    for workload in ("mooncake", "agentic")}
        DATA.write_text(json.dumps(data, indent=1))
    (DOCS / "img").mkdir(exist_ok=True)
    percents = [f"{100 * f:g}" for f in FRACTIONS]
    gpt_oss_set = data["mooncake"]["references"]["gpt-oss-20b"]["working_set_bytes"]
    with TRACE.open(encoding="utf-8") as trace:
        trace_requests = sum(1 for line in trace if line.strip())
    lines = [EXPLANATION.replace("LIMIT", str(data["mooncake"]["limit"]))
             .replace("TRACE_REQUESTS", f"{trace_requests:,}")
             .replace("HOST_1", format_bytes(0.01 * gpt_oss_set))
             .replace("HOST_2", format_bytes(0.02 * gpt_oss_set))
             .replace("PERCENTS", ", ".join(percents[:-1]) + " and " + percents[-1])
             .replace("FRACTIONS", ",".join(f"{f:g}" for f in FRACTIONS))
             .replace("SESSIONS", str(AGENTIC_SESSIONS))
             .replace("SEEDS", ",".join(map(str, AGENTIC_SEEDS)))
             .replace("ORACLE_SUMMARY", "\n\n".join(oracle_summary(data)))]
    for key, name in (("mooncake", "Mooncake conversation trace"),
                      ("agentic", "Built-in agentic workload")):
        points, refs = load_points(data[key])
        image = f"policy_{key}.png"
        plot(points, refs, f"{data[key]['workload']}: host hit rate and TTFT speed-up",
             DOCS / "img" / image)
        lines += workload_section(name, data[key], image)
        if key == "mooncake":
            lines += reuse_section(data[key])
    lines += ["", HINTS_SECTION]
    (DOCS / "policy.md").write_text("\n".join(lines))
    print(f"wrote {DOCS / 'policy.md'}")


if __name__ == "__main__":
    main()
