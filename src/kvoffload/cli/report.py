"""Plain-text reports of simulations, and their JSON form."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvoffload.cli.common import format_seconds
from kvoffload.models.layout import ModelLayout
from kvoffload.sim.fleet import ROUTER_HELP, FleetResult, FleetTotals
from kvoffload.sim.simulation import (
    Capacities,
    Mode,
    SimulationConfig,
    SimulationResult,
    describe_groups,
)
from kvoffload.sim.summary import Percentiles, RunSummary
from kvoffload.sizes import format_bytes
from kvoffload.tiers.config import masked_url


def _pct(x: float) -> str:
    return f"{100 * x:5.1f} %"


def _ttft(p: Percentiles) -> str:
    return f"{format_seconds(p.mean)} / {format_seconds(p.p50)} / {format_seconds(p.p90)}"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                         strict=True)]
        out.append(indent + "  ".join(cells).rstrip())
    return out


def _work_and_ttft_lines(rows: list[list[str]], base: RunSummary | FleetTotals | None,
                         o: RunSummary | FleetTotals) -> list[str]:
    """``rows`` followed by prefill work, TTFT and preemptions without (``base``, None
    when no baseline ran) and with offloading (``o``), as a table; then, with a baseline,
    the line of what offloading saved."""
    rows.append(["prefill tokens computed",
                 f"{base.prefill_tokens_computed:,}" if base else "-",
                 f"{o.prefill_tokens_computed:,}"])
    rows.append(["TTFT modelled, mean / p50 / p90",
                 _ttft(base.ttft) if base else "-", _ttft(o.ttft)])
    rows.append(["TTFT on the clock (with queueing)",
                 _ttft(base.clock_ttft) if base else "-", _ttft(o.clock_ttft)])
    rows.append(["preemptions", f"{base.preemptions:,}" if base else "-", f"{o.preemptions:,}"])
    lines = _table(rows)
    if base is not None and base.prefill_tokens_computed:
        saved = 1 - o.prefill_tokens_computed / base.prefill_tokens_computed
        speed = base.ttft.mean / o.ttft.mean if o.ttft.mean else float("inf")
        lines.append(f"  offloading computes {100 * saved:.1f} % fewer prefill tokens; mean "
                     f"modelled TTFT {speed:.2f}x faster")
    return lines


def simulation_text(result: SimulationResult, workload_label: str) -> str:
    """The human summary ``kvoffload simulate`` prints."""
    lines = _setup_lines(result, workload_label)
    lines.append("")
    lines += _comparison_lines(result)
    lines.append("")
    lines += _storage_lines(result)
    lines += _worker_lines(result)
    o, b = result.offload, result.baseline
    wall = o.wall_s + (b.wall_s if b is not None else 0.0)
    lines.append(f"  modelled makespan {format_seconds(o.makespan_s)}, {o.steps:,} steps; "
                 f"wall time {wall:.1f} s")
    return "\n".join(lines)


def _setup_lines(result: SimulationResult, workload_label: str) -> list[str]:
    """What was simulated: model, workload, groups, mode, capacities, modelled hardware."""
    o = result.offload
    return _setup(result.config, result.layout, result.capacities,
                  f"{workload_label}, {o.requests} requests, {o.prompt_tokens:,} prompt tokens")


def _setup(cfg: SimulationConfig, lay: ModelLayout, caps: Capacities, what: str,
           each: str = "") -> list[str]:
    """``_setup_lines`` of ``what`` was run; ``each`` qualifies the engine's and host's
    capacities (a fleet: " (each)")."""
    t = cfg.timing
    lines = [f"kvoffload simulate: {lay.preset.name}, {what}, {cfg.mode.value} mode"]
    lines.append(f"  groups: {'; '.join(describe_groups(lay))}")
    if cfg.mode.value == "bytes":
        scaled = ("pages scaled to " + ", ".join(f"{g.spec.page_bytes} B" for g in lay.groups)
                  + " per layer (real " + ", ".join(format_bytes(g.real_page_bytes)
                                                     for g in lay.groups)
                  + "); every figure below uses the real sizes")
        lines.append(f"  moved bytes: real tensors, {scaled}")
    else:
        lines.append("  accounting mode: no tensors move; jobs complete in modelled time")
    lines.append(f"  engine{each}: {caps.engine_blocks - 1:,} blocks of {lay.block_size} tokens "
                 f"({format_bytes((caps.engine_blocks - 1) * caps.engine_block_bytes)}); "
                 f"host{each}: {caps.host_slots:,} slots of {format_bytes(caps.host_slot_bytes)} "
                 f"({format_bytes(caps.host_slots * caps.host_slot_bytes)}), policy "
                 f"{cfg.eviction_policy}")
    steps = ("" if cfg.decode_tokens_per_step == 1 else
             f", one step stands for {cfg.decode_tokens_per_step} engine iterations")
    lines.append(f"  model: {t.accelerator_flops / 1e12:g} TFLOP/s accelerator, "
                 f"{t.link_bytes_per_s / 1e9:g} GB/s host link per direction{steps}")
    return lines


def _comparison_lines(result: SimulationResult) -> list[str]:
    """Hits, prefill work, TTFT and preemptions without and with offloading."""
    o, base = result.offload, result.baseline
    rows = [["", "without offload", "with offload"]]
    rows.append(["prompt tokens from engine prefix cache",
                 _pct(base.engine_hit_rate) if base else "-", _pct(o.engine_hit_rate)])
    tiers = o.tier_hit_rates or {"host": o.host_hit_rate}
    rows.append(["prompt tokens from host tier", "-", _pct(tiers.get("host", 0.0))])
    for name in o.lower_tier_bytes:
        rows.append([f"prompt tokens from {name} tier (promoted)", "-",
                     _pct(tiers.get(name, 0.0))])
    return _work_and_ttft_lines(rows, base, o)


def _storage_lines(result: SimulationResult) -> list[str]:
    """Bytes moved and held per group and tier, host slots, link time."""
    o = result.offload
    grows = [["group", "stored", "loaded", "host held (peak)", "host held (end)"]]
    for g in o.groups:
        grows.append([f"{g.name}", format_bytes(g.stored_bytes), format_bytes(g.loaded_bytes),
                      format_bytes(g.host_bytes_peak), format_bytes(g.host_bytes_final)])
    lines = _table(grows)
    for name, held in o.lower_tier_bytes.items():
        blocks = o.lower_tier_blocks.get(name, 0)
        size = format_bytes(held) + (" moved, scaled" if result.config.mode is Mode.BYTES
                                     else "")
        lines.append(f"  {name} tier holds {blocks:,} blocks ({size}) at the end")
    lines.append(f"  host slots in use at peak: {format_bytes(o.host_reserved_bytes_peak)} of "
                 f"{format_bytes(o.host_capacity_bytes)} (a slot fits the largest group's block)")
    lines.append(f"  transfer time (modelled link busy): stores {format_seconds(o.store_link_s)}, "
                 f"loads {format_seconds(o.load_link_s)}; flush stalls "
                 f"{format_seconds(o.flush_stall_s)}")
    if o.cold_keys:
        lines.append(f"  bimodal insertion: {o.cold_keys:,} host blocks stored cold (first "
                     "to evict)")
    return lines


def _worker_lines(result: SimulationResult) -> list[str]:
    """Bytes mode's measured transfers and verification, and the contract warnings."""
    o = result.offload
    lines: list[str] = []
    if result.config.mode.value == "bytes":
        lines.append(f"  worker moved {format_bytes(o.moved_stored_bytes)} to host and "
                     f"{format_bytes(o.moved_loaded_bytes)} back in "
                     f"{format_seconds(o.measured_transfer_s)} (measured, scaled pages)")
        verdict = "OK" if o.wrong_bytes == 0 else "MISMATCH"
        lines.append(f"  verification: {o.verified_blocks:,} engine blocks read or loaded and "
                     f"{o.audited_host_blocks:,} host blocks compared byte for byte: wrong "
                     f"bytes {o.wrong_bytes:,} [{verdict}] (loaded {o.wrong_loaded_bytes:,}, "
                     f"engine cache {o.wrong_cached_bytes:,}, host {o.wrong_host_bytes:,}); "
                     f"corrupt loads {o.corrupt_loads}, failed loads {o.failed_loads}")
    if o.same_step_flushes:
        lines.append(f"  WARNING: {o.same_step_flushes} store(s) were flushed in the step that "
                     "planned them, i.e. copied before the forward pass wrote their blocks "
                     "(a planner bug)")
    if o.misplaced_store_blocks:
        lines.append(f"  WARNING: {o.misplaced_store_blocks} stored block(s) were not at the "
                     "position their transfer implies (GroupTransfer contract broken)")
    return lines


def run_dict(summary: RunSummary | None) -> dict[str, Any] | None:
    return None if summary is None else summary.to_dict()


def simulation_dict(result: SimulationResult, workload_label: str) -> dict[str, Any]:
    """The JSON object ``kvoffload simulate --json`` prints."""
    return {
        "workload": workload_label,
        "config": _config_dict(result.config),
        "layout": _layout_dict(result.layout),
        "capacities": asdict(result.capacities),
        "offload": run_dict(result.offload),
        "baseline": run_dict(result.baseline),
    }


def _config_dict(cfg: SimulationConfig) -> dict[str, Any]:
    config = asdict(cfg)
    config["mode"] = cfg.mode.value
    config["arrival"] = cfg.arrival.value
    config["mac_key"] = cfg.mac_key is not None  # whether one is used; never the key
    if cfg.remote_url is not None:
        config["remote_url"] = masked_url(cfg.remote_url)
    return config


def _layout_dict(layout: ModelLayout) -> dict[str, Any]:
    return {
        "preset": layout.preset.name,
        "block_size": layout.block_size,
        "scaled": layout.is_scaled,
        "groups": [{"name": g.spec.name, "kind": g.spec.kind.value,
                    "num_layers": g.spec.num_layers, "block_size": g.spec.block_size,
                    "sliding_window": g.spec.sliding_window,
                    "real_page_bytes": g.real_page_bytes,
                    "moved_page_bytes": g.spec.page_bytes}
                   for g in layout.groups],
    }


# ---------------------------------------------------------------------------- fleets


def fleet_dict(result: FleetResult, workload_label: str) -> dict[str, Any]:
    """The JSON object ``kvoffload simulate --engines N --json`` prints: the keys of
    ``simulation_dict``, with ``offload`` and ``baseline`` holding the fleet's figures
    (``FleetRun.to_dict``: the totals, the shared tier, and ``engines``: one object per
    engine), and ``fleet`` saying how it was set up."""
    fleet = result.config
    sim = fleet.simulation
    return {
        "workload": workload_label,
        "config": _config_dict(sim),
        "fleet": {"engines": fleet.engines, "router": fleet.router.value,
                  "router_rule": ROUTER_HELP[fleet.router],
                  "shared_tier_capacity_bytes": sim.remote_capacity_bytes},
        "layout": _layout_dict(result.layout),
        "capacities": asdict(result.capacities),
        "offload": result.offload.to_dict(),
        "baseline": None if result.baseline is None else result.baseline.to_dict(),
    }


def fleet_text(result: FleetResult, workload_label: str) -> str:
    """The human summary of ``kvoffload simulate --engines N``."""
    fleet = result.config
    sim = fleet.simulation
    o, base = result.offload, result.baseline
    t = o.totals
    lines = _setup(sim, result.layout, result.capacities,
                   f"{workload_label}, {t.requests} requests, {t.prompt_tokens:,} prompt "
                   f"tokens, {fleet.engines} engines", each=" (each)")
    lines.append(f"  router {fleet.router.value}: {ROUTER_HELP[fleet.router]}")
    if fleet.shared_tier:
        lines.append(f"  shared tier: one remote store of "
                     f"{format_bytes(sim.remote_capacity_bytes or 0)} that every engine "
                     "writes through and promotes from (modelled, LRU)")
    else:
        lines.append("  shared tier: none (each engine has only its own tiers; "
                     "--remote-capacity SIZE adds one)")
    lines.append("")
    lines += _fleet_comparison_lines(result)
    lines.append("")
    lines += _fleet_engine_lines(result)
    if fleet.shared_tier:
        lines.append(f"  shared tier holds {o.shared_blocks:,} blocks "
                     f"({format_bytes(o.shared_bytes)}) at the end")
    wall = o.wall_s + (base.wall_s if base is not None else 0.0)
    lines.append(f"  modelled makespan {format_seconds(t.makespan_s)}; wall time {wall:.1f} s")
    return "\n".join(lines)


def _tier_label(name: str) -> str:
    return {"host": "host tiers", "disk": "disk tiers (promoted)",
            "remote": "the shared tier (promoted)"}.get(name, f"{name} tier (promoted)")


def _fleet_tiers(result: FleetResult) -> list[str]:
    """The offload tiers a fleet's requests could be served from, in cascade order."""
    sim = result.config.simulation
    return ["host"] + (["disk"] if sim.disk_capacity_bytes else []) + (
        ["remote"] if sim.remote_capacity_bytes else [])


def _fleet_comparison_lines(result: FleetResult) -> list[str]:
    """The fleet's hits per tier, prefill work and TTFT, without and with offloading."""
    o, b = result.offload.totals, (result.baseline.totals if result.baseline else None)
    rows = [["all engines", "without offload", "with offload"]]
    rows.append(["prompt tokens from the engines' prefix caches (device)",
                 _pct(b.engine_hit_rate) if b else "-", _pct(o.engine_hit_rate)])
    rates = o.tier_hit_rates
    for name in _fleet_tiers(result):
        rows.append([f"prompt tokens from {_tier_label(name)}", "-",
                     _pct(rates.get(name, 0.0))])
    rows.append(["prefill tokens saved (served from a cache)",
                 f"{b.prefill_tokens_saved:,}" if b else "-", f"{o.prefill_tokens_saved:,}"])
    return _work_and_ttft_lines(rows, b, o)


def _fleet_engine_lines(result: FleetResult) -> list[str]:
    """One row per engine (with offloading): requests, hits per tier, tokens saved."""
    run = result.offload
    tiers = _fleet_tiers(result)
    names = {"host": "host", "disk": "disk", "remote": "shared"}
    rows = [["engine", "requests", "prompt tokens", "device", *(names[n] for n in tiers),
             "tokens saved", "waits given up"]]
    for i, (s, tokens, timeouts) in enumerate(zip(run.engines, run.engine_tier_tokens,
                                                  run.deferral_timeouts, strict=True)):
        prompt = s.prompt_tokens or 1
        rows.append([str(i), f"{s.requests:,}", f"{s.prompt_tokens:,}",
                     _pct(s.engine_hit_rate), *(_pct(tokens.get(n, 0) / prompt) for n in tiers),
                     f"{s.prefill_tokens_saved:,}", f"{timeouts:,}"])
    lines = _table(rows)
    lines.append("  (shares of each engine's prompt tokens; waits given up: lookups that "
                 "stopped waiting for a promote after max_deferred_steps steps)")
    return lines
