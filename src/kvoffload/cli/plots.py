"""Figures: a simulation over time, a sweep's curves, a plan's curves.

Each ``plot_*`` function draws library results (``kvoffload.sim``) into a file. Needs
matplotlib (the ``cli`` extra): without it, ``--plot`` is a ``UsageError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvoffload.cli.common import UsageError
from kvoffload.sim.plan import Plan
from kvoffload.sim.simulation import SimulationResult
from kvoffload.sim.sweep import SweepPoint

GIB = float(1 << 30)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvoffload[cli]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_simulation(result: SimulationResult, path: Path, title: str) -> None:
    """Hit rate by source and host occupancy over modelled time (two panels)."""
    plt = _pyplot()
    o, b = result.offload, result.baseline
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    times = [s.time_s for s in o.samples]

    def rate(samples: Sequence[Any], attr: str) -> list[float]:
        return [getattr(s, attr) / s.prompt_tokens if s.prompt_tokens else 0.0 for s in samples]

    engine = rate(o.samples, "engine_hit_tokens")
    host = rate(o.samples, "host_hit_tokens")
    top.stackplot(times, [100 * e for e in engine], [100 * h for h in host],
                  labels=["engine prefix cache", "host tier"], alpha=0.7)
    if b is not None:
        top.plot([s.time_s for s in b.samples], [100 * e for e in rate(b.samples,
                                                                      "engine_hit_tokens")],
                 color="black", linestyle="--", label="engine cache, no offloading")
    top.set_ylabel("prompt tokens served (%, cumulative)")
    top.set_ylim(0, 100)
    top.legend(loc="lower right")
    top.set_title(title)
    names = [g.name for g in o.groups]
    per_group = [[s.host_bytes_by_group[i] / GIB for s in o.samples] for i in range(len(names))]
    bottom.stackplot(times, per_group, labels=[f"host: {n}" for n in names], alpha=0.7)
    bottom.axhline(o.host_capacity_bytes / GIB, color="red", linestyle=":",
                   label="host capacity (slots)")
    bottom.set_ylabel("host memory held (GiB, real)")
    bottom.set_xlabel("modelled time (s)")
    twin = bottom.twinx()
    blocks = result.capacities.engine_blocks - 1
    twin.plot(times, [100 * s.engine_blocks_used / blocks for s in o.samples], color="gray",
              linewidth=0.8, label="engine blocks in use (%)")
    twin.set_ylabel("engine blocks in use (%)")
    twin.set_ylim(0, 105)
    lines, labels = bottom.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    bottom.legend(lines + more, labels + more_labels, loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(points: Sequence[SweepPoint], path: Path, title: str) -> None:
    """Host hit rate and modelled TTFT speed-up against host capacity, one curve per
    (preset, policy)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    curves: dict[tuple[str, str], list[SweepPoint]] = {}
    for p in points:
        curves.setdefault((p.preset, p.policy), []).append(p)
    presets = list(dict.fromkeys(p.preset for p in points))
    policies = list(dict.fromkeys(p.policy for p in points))
    styles = ["-", "--", ":", "-."]
    colors = plt.get_cmap("tab10")
    capacities = sorted({p.host_capacity_bytes for p in points})
    for (preset, policy), unordered in curves.items():
        pts = sorted(unordered, key=lambda p: p.host_capacity_bytes)
        xs = [p.host_capacity_bytes / GIB for p in pts]
        label = f"{preset} / {policy}" if len(policies) > 1 else preset
        style = {"color": colors(presets.index(preset) % 10), "marker": "o",
                 "linestyle": styles[policies.index(policy) % len(styles)]}
        left.plot(xs, [100 * p.hit_rate for p in pts], label=label, **style)
        right.plot(xs, [p.ttft_speedup for p in pts], label=label, **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks([c / GIB for c in capacities])
        ax.set_xticklabels([f"{c / GIB:g}" for c in capacities])
        ax.set_xlabel("host capacity (GiB)")
        ax.grid(True, alpha=0.3)
    left.set_ylabel("prompt tokens served by a cache (%)")
    left.set_ylim(0, 100)
    right.set_ylabel("mean modelled TTFT, without / with offloading")
    right.axhline(1.0, color="black", linewidth=0.8)
    left.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_plan(plan: Plan, path: Path) -> None:
    """A plan's hit-rate curves against host memory per rank (one per policy, dashed with
    the disk tier), the unbounded hit rate and its 50/90/99 % marks; and TTFT speed-up."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.get_cmap("tab10")
    policies = list(dict.fromkeys(p.policy for p in plan.points))
    for i, policy in enumerate(policies):
        for disk in (False, True):
            pts = sorted((p for p in plan.points if p.policy == policy and p.disk == disk),
                         key=lambda p: p.host_capacity_bytes)
            if not pts:
                continue
            xs = [p.host_capacity_bytes / GIB for p in pts]
            style = {"color": colors(i % 10), "marker": "o",
                     "linestyle": "--" if disk else "-"}
            label = policy + (" + disk" if disk else "")
            left.plot(xs, [100 * (p.host_hit_rate + p.lower_hit_rate) for p in pts],
                      label=label, **style)
            right.plot(xs, [p.ttft_speedup for p in pts], label=label, **style)
    for share in (0.5, 0.9, 0.99):
        left.axhline(100 * share * plan.unbounded_hit_rate, color="gray", linewidth=0.6,
                     linestyle=":")
    left.axhline(100 * plan.unbounded_hit_rate, color="black", linewidth=0.8,
                 label="unbounded host memory")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("host memory per rank (GiB)")
        ax.grid(True, alpha=0.3)
    left.set_ylabel("prompt tokens served by offloading (%)")
    right.set_ylabel("mean modelled TTFT, without / with offloading")
    right.axhline(1.0, color="black", linewidth=0.8)
    left.legend(fontsize="small")
    fig.suptitle(f"kvoffload plan: {plan.preset} on {plan.workload} "
                 "(dotted: 50/90/99 % of unbounded)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
