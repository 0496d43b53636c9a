"""Connector statistics for vLLM's stats pipeline and Prometheus.

The scheduler side knows everything worth exporting: the planner's counters, the host
tier's occupancy, and the workers' bytes and seconds (their reports reach it through the
worker metadata). Each engine step it hands vLLM the *increments* since the previous step
as a ``KVOffloadStats``; vLLM sums them over an interval for its log line
(``reduce``) and feeds every increment to ``KVOffloadPromMetrics``.

The payload is a dict of plain numbers keyed by strings, so it survives vLLM's IPC::

    {"counters": {name: number}, "gauges": {name: number},
     "group_counters": {name: {group: number}}, "group_gauges": {name: {group: number}},
     "tier_counters": {name: {tier: number}}}

Counters add up under ``aggregate``; gauges keep the latest value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvoffload.jobs import TransferStats
from kvoffload.metrics import PlannerStats
from kvoffload.tiers.base import TierUsage

COUNTERS: dict[str, str] = {
    "lookups": "Lookups answered by the kvoffload planner.",
    "hit_tokens": "Tokens the host tier offered beyond vLLM's own prefix cache.",
    "deferred_lookups": "Lookups answered 'ask again later' (a needed block was in flight).",
    "load_jobs": "Load jobs (host -> engine) issued.",
    "store_jobs": "Store jobs (engine -> host) issued.",
    "failed_loads": "Loads that failed; vLLM recomputed those tokens.",
    "abandoned_loads": "Loads given up at load_deadline_s; vLLM recomputed those tokens.",
    "failed_stores": "Stores that failed; their host slots were freed.",
    "store_retries": "Stores postponed because the host tier had no evictable room.",
    "cold_keys": "Host blocks stored cold (first to evict) by the value policy's "
                 "bimodal insertion or for a conversation_continues=false hint.",
    "loaded_bytes": "Bytes copied host -> engine, summed over ranks.",
    "stored_bytes": "Bytes copied engine -> host, summed over ranks.",
    "load_seconds": "Seconds spent in loads, summed over ranks.",
    "store_seconds": "Seconds spent in stores, summed over ranks.",
    "flushed_jobs": "Jobs of earlier steps a step's plan flushed before its forward pass "
                    "(vLLM handed out again a block they still used), summed over ranks.",
    "flush_wait_seconds": "Seconds steps waited for those jobs to end, summed over ranks.",
}
GROUP_COUNTERS: dict[str, str] = {
    "blocks_loaded": "Engine blocks loaded, per KV-cache group.",
    "blocks_stored": "Engine blocks stored, per KV-cache group.",
}
TIER_COUNTERS: dict[str, str] = {
    "tier_blocks_loaded": "Blocks loaded into the engine, by the tier that held them when "
                          "the request asked (host, or the lower tier they came from).",
    "tier_blocks_written": "Blocks written to a lower tier (disk, remote), by tier.",
    "tier_write_failures": "Writes to a lower tier that failed (the block stays a miss "
                           "there), by tier.",
    "tier_read_failures": "Reads from a lower tier that failed (the block is a miss; "
                          "vLLM computes it), by tier.",
    "tier_blocks_without_room": "Blocks a lower tier held whose promote found no host slot "
                                "in time, so the request that wanted them went on without "
                                "them (host memory too small for the requests loading at "
                                "once), by tier.",
}
GAUGES: dict[str, str] = {
    "host_capacity_slots": "Host tier capacity in offloaded blocks.",
    "host_used_slots": "Host slots holding a block (ready or being written).",
    "host_pinned_slots": "Host slots pinned by loads in flight.",
}
GROUP_GAUGES: dict[str, str] = {
    "host_bytes": "Bytes of offloaded blocks held in host memory, per KV-cache group.",
}
_SECTIONS = ("counters", "gauges", "group_counters", "group_gauges", "tier_counters")
_LABELED_COUNTERS = ("group_counters", "tier_counters")
METRIC_PREFIX = "vllm:kvoffload_"


def _empty() -> dict[str, Any]:
    return {section: {} for section in _SECTIONS}


@dataclass
class KVOffloadStats(KVConnectorStats):
    """Increments of kvoffload's counters and the latest gauges (see module docstring)."""

    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        for section in _SECTIONS:
            self.data.setdefault(section, {})

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        return not any(self.data[s] for s in _SECTIONS)

    def aggregate(self, other: KVConnectorStats) -> KVOffloadStats:
        """Add ``other``'s counters into this one; take its gauges. Returns ``self``."""
        if not isinstance(other, KVOffloadStats) or other.is_empty():
            return self
        counters, gauges = self.data["counters"], self.data["gauges"]
        for name, value in other.data["counters"].items():
            counters[name] = counters.get(name, 0) + value
        gauges.update(other.data["gauges"])
        for section in _LABELED_COUNTERS:
            for name, per_label in other.data[section].items():
                mine = self.data[section].setdefault(name, {})
                for label, value in per_label.items():
                    mine[label] = mine.get(label, 0) + value
        for name, per_group in other.data["group_gauges"].items():
            self.data["group_gauges"].setdefault(name, {}).update(per_group)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat ``{name: value}`` for vLLM's periodic log line."""
        out: dict[str, int | float] = {}
        out.update(self.data["counters"])
        out.update(self.data["gauges"])
        for section in ("group_counters", "group_gauges"):
            for name, per_group in self.data[section].items():
                for group, value in sorted(per_group.items()):
                    out[f"{name}[g{group}]"] = value
        for name, per_tier in self.data["tier_counters"].items():
            for tier, value in sorted(per_tier.items()):
                out[f"{name}[{tier}]"] = value
        return out


class StatsCollector:
    """Turns cumulative planner counters and worker reports into per-step increments."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._last_groups: dict[str, dict[int, int]] = {}
        self._last_tiers: dict[tuple[str, str], int] = {}
        self._transfer = TransferStats()

    def add_transfer(self, stats: TransferStats) -> None:
        """Add one worker report's bytes and seconds."""
        t = self._transfer
        self._transfer = TransferStats(
            stored_bytes=t.stored_bytes + stats.stored_bytes,
            loaded_bytes=t.loaded_bytes + stats.loaded_bytes,
            store_seconds=t.store_seconds + stats.store_seconds,
            load_seconds=t.load_seconds + stats.load_seconds,
            flushed_jobs=t.flushed_jobs + stats.flushed_jobs,
            flush_wait_seconds=t.flush_wait_seconds + stats.flush_wait_seconds)

    def take(self, planner: PlannerStats, usage: TierUsage,
             by_tier: Mapping[str, Mapping[str, int]]) -> KVOffloadStats | None:
        """The increments since the previous call, or None when no counter moved.

        ``by_tier``: cumulative ``TIER_COUNTERS`` values, ``{name: {tier: count}}``.
        """
        now: dict[str, int] = {
            "lookups": planner.lookups,
            "hit_tokens": planner.lookup_hit_tokens,
            "deferred_lookups": planner.deferred_lookups,
            "load_jobs": planner.load_jobs,
            "store_jobs": planner.store_jobs,
            "failed_loads": planner.failed_loads,
            "abandoned_loads": planner.abandoned_loads,
            "failed_stores": planner.failed_stores,
            "store_retries": planner.store_retries,
            "cold_keys": planner.cold_stored_keys,
        }
        counters: dict[str, int | float] = {}
        for name, value in now.items():
            delta = value - self._last.get(name, 0)
            if delta:
                counters[name] = delta
        self._last = now
        t, self._transfer = self._transfer, TransferStats()
        moved: tuple[tuple[str, int | float], ...] = (
            ("loaded_bytes", t.loaded_bytes), ("stored_bytes", t.stored_bytes),
            ("load_seconds", t.load_seconds), ("store_seconds", t.store_seconds),
            ("flushed_jobs", t.flushed_jobs), ("flush_wait_seconds", t.flush_wait_seconds))
        for name, amount in moved:
            if amount:
                counters[name] = amount
        group_counters: dict[str, dict[str, int]] = {}
        for name, table in (("blocks_loaded", planner.blocks_loaded),
                            ("blocks_stored", planner.blocks_stored)):
            last = self._last_groups.setdefault(name, {})
            for group, value in table.items():
                delta = value - last.get(group, 0)
                if delta:
                    group_counters.setdefault(name, {})[str(group)] = delta
                last[group] = value
        tier_counters: dict[str, dict[str, int]] = {}
        for name, per_tier in by_tier.items():
            for tier, value in per_tier.items():
                delta = value - self._last_tiers.get((name, tier), 0)
                if delta:
                    tier_counters.setdefault(name, {})[tier] = delta
                self._last_tiers[(name, tier)] = value
        if not counters and not group_counters and not tier_counters:
            return None
        return KVOffloadStats(data={
            "counters": counters,
            "gauges": {"host_capacity_slots": usage.capacity_slots,
                       "host_used_slots": usage.used_slots,
                       "host_pinned_slots": usage.pinned_slots},
            "group_counters": group_counters,
            "group_gauges": {"host_bytes": {str(g): b for g, b in
                                            usage.bytes_by_group.items()}},
            "tier_counters": tier_counters,
        })


_LABELED_SECTIONS: tuple[tuple[str, dict[str, str], bool], ...] = (
    ("group_counters", GROUP_COUNTERS, True), ("tier_counters", TIER_COUNTERS, True),
    ("group_gauges", GROUP_GAUGES, False))
"""Payload sections with one child per label value: (section, metrics, counts up)."""


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters and gauges named ``vllm:kvoffload_*``, one child per engine.

    Per-group metrics carry a ``group`` label (the vLLM KV-cache group index); per-tier
    ones a ``tier`` label (``host``, ``disk``, ``remote``).
    """

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls: Any = self._counter_cls
        gauge_cls: Any = self._gauge_cls
        self._metrics: dict[str, Any] = {}
        for name, doc in COUNTERS.items():
            self._metrics[name] = counter_cls(
                name=METRIC_PREFIX + name, documentation=doc, labelnames=labelnames)
        for name, doc in TIER_COUNTERS.items():
            self._metrics[name] = counter_cls(
                name=METRIC_PREFIX + name, documentation=doc,
                labelnames=[*labelnames, "tier"])
        for name, doc in GAUGES.items():
            self._metrics[name] = gauge_cls(
                name=METRIC_PREFIX + name, documentation=doc, labelnames=labelnames,
                multiprocess_mode="mostrecent")
        for name, doc in GROUP_COUNTERS.items():
            self._metrics[name] = counter_cls(
                name=METRIC_PREFIX + name, documentation=doc,
                labelnames=[*labelnames, "group"])
        for name, doc in GROUP_GAUGES.items():
            self._metrics[name] = gauge_cls(
                name=METRIC_PREFIX + name, documentation=doc,
                labelnames=[*labelnames, "group"], multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's (or interval's) increments for engine ``engine_idx``."""
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name in COUNTERS and value > 0:
                self._metrics[name].labels(*labels).inc(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in GAUGES:
                self._metrics[name].labels(*labels).set(value)
        for section, known, adds in _LABELED_SECTIONS:
            for name, per_label in transfer_stats_data.get(section, {}).items():
                if name not in known:
                    continue
                for label, value in per_label.items():
                    child = self._metrics[name].labels(*labels, str(label))
                    if not adds:
                        child.set(value)
                    elif value > 0:
                        child.inc(value)
