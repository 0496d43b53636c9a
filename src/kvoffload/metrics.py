"""Counters the planner keeps, as plain data (exporters live at the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PlannerStats:
    """Cumulative planner counters. Read them; never rely on them for control flow."""

    lookups: int = 0
    lookup_hit_tokens: int = 0
    deferred_lookups: int = 0
    deferral_timeouts: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    store_retries: int = 0
    failed_loads: int = 0
    failed_stores: int = 0
    stale_reports: int = 0
    duplicate_reports: int = 0
    abandoned_loads: int = 0
    cold_stored_keys: int = 0
    """Keys stored cold (bimodal insertion, or a ``continues=False`` hint; see
    ``kvoffload.planner.insertion``)."""
    blocks_loaded: dict[int, int] = field(default_factory=dict)
    blocks_stored: dict[int, int] = field(default_factory=dict)

    def add_blocks(self, table: dict[int, int], group: int, count: int) -> None:
        table[group] = table.get(group, 0) + count
