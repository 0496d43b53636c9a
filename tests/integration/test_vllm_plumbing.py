"""The connector's vLLM-facing data: metadata, statistics, Prometheus and events.

Real vLLM classes (its Prometheus metric types, its event structs), no engine.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from integration.markers import VLLM

pytestmark = VLLM


def test_metadata_pickles_and_worker_reports_aggregate_over_ranks() -> None:
    from kvoffload.integrations.vllm.metadata import KVOffloadMetadata, KVOffloadWorkerMetadata
    from kvoffload.jobs import (
        Direction,
        GroupTransfer,
        JobId,
        StepPlan,
        TransferJob,
        WorkerReport,
    )

    job = TransferJob(JobId(3), Direction.LOAD, "r1",
                      (GroupTransfer(0, (5, 6), 2, (9, 10)),))
    meta = KVOffloadMetadata(StepPlan(flush=(JobId(1),), loads=(job,)), (("r2", True),))
    assert pickle.loads(pickle.dumps(meta)) == meta
    a = KVOffloadWorkerMetadata([WorkerReport(0, finished=(JobId(3),))])
    b = KVOffloadWorkerMetadata([WorkerReport(1, finished=(JobId(3),))])
    merged = a.aggregate(b)
    assert [r.rank for r in merged.reports] == [0, 1]
    with pytest.raises(TypeError):
        a.aggregate(object())  # type: ignore[arg-type]


def test_stats_are_increments_and_aggregate() -> None:
    from kvoffload.integrations.vllm.stats import KVOffloadStats, StatsCollector
    from kvoffload.jobs import TransferStats
    from kvoffload.metrics import PlannerStats
    from kvoffload.tiers.base import TierUsage

    usage = TierUsage(100, 10, 1, 0, {0: 4096, 1: 1024})
    collector = StatsCollector()
    stats = PlannerStats(lookups=2, lookup_hit_tokens=64, blocks_loaded={0: 2})
    collector.add_transfer(TransferStats(loaded_bytes=8192, load_seconds=0.5))
    collector.add_transfer(TransferStats(flushed_jobs=2, flush_wait_seconds=0.25))
    loads = {"tier_blocks_loaded": {"host": 2}}
    first = collector.take(stats, usage, loads)
    assert first is not None
    assert first.data["counters"] == {"lookups": 2, "hit_tokens": 64, "loaded_bytes": 8192,
                                      "load_seconds": 0.5, "flushed_jobs": 2,
                                      "flush_wait_seconds": 0.25}
    assert first.data["group_counters"] == {"blocks_loaded": {"0": 2}}
    assert first.data["tier_counters"] == {"tier_blocks_loaded": {"host": 2}}
    assert collector.take(stats, usage, loads) is None  # nothing moved since
    stats.lookups += 3
    stats.cold_stored_keys += 7
    second = collector.take(stats, usage, {"tier_blocks_loaded": {"host": 2, "disk": 5},
                                           "tier_write_failures": {"disk": 1}})
    assert second is not None and second.data["counters"] == {"lookups": 3, "cold_keys": 7}
    assert second.data["tier_counters"] == {"tier_blocks_loaded": {"disk": 5},
                                            "tier_write_failures": {"disk": 1}}
    total = KVOffloadStats().aggregate(first).aggregate(second)
    assert isinstance(total, KVOffloadStats)
    reduced = total.reduce()
    assert reduced["lookups"] == 5 and reduced["hit_tokens"] == 64
    assert reduced["host_used_slots"] == 10 and reduced["host_bytes[g1]"] == 1024
    assert reduced["tier_blocks_loaded[host]"] == 2
    assert reduced["tier_blocks_loaded[disk]"] == 5
    assert KVOffloadStats().is_empty() and not total.is_empty()
    rebuilt = KVOffloadStats(data=pickle.loads(pickle.dumps(total.to_dict())))
    assert rebuilt.reduce() == reduced


def test_prometheus_metrics_per_engine_and_group() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvoffload.integrations.vllm.stats import KVOffloadPromMetrics

    registry = CollectorRegistry()

    class C(Counter):  # registered in a private registry, not the global one
        def __init__(self, *args: Any, **kw: Any) -> None:
            kw.setdefault("registry", registry)
            super().__init__(*args, **kw)

    class G(Gauge):
        def __init__(self, *args: Any, **kw: Any) -> None:
            kw.setdefault("registry", registry)
            super().__init__(*args, **kw)

    class H(Histogram):
        def __init__(self, *args: Any, **kw: Any) -> None:
            kw.setdefault("registry", registry)
            super().__init__(*args, **kw)

    class Cfg:
        kv_transfer_config = None

    prom = KVOffloadPromMetrics(Cfg(), {Counter: C, Gauge: G, Histogram: H},
                                ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"counters": {"hit_tokens": 64}, "gauges": {"host_used_slots": 7},
                  "group_counters": {"blocks_stored": {"1": 3}},
                  "group_gauges": {"host_bytes": {"0": 100}},
                  "tier_counters": {"tier_blocks_loaded": {"remote": 4}}}, engine_idx=1)
    prom.observe({"counters": {"hit_tokens": 32},
                  "tier_counters": {"tier_blocks_loaded": {"remote": 2}}}, engine_idx=1)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("vllm:kvoffload_hit_tokens_total", engine="1") == 96
    assert value("vllm:kvoffload_host_used_slots", engine="1") == 7
    assert value("vllm:kvoffload_blocks_stored_total", engine="1", group="1") == 3
    assert value("vllm:kvoffload_host_bytes", engine="1", group="0") == 100
    assert value("vllm:kvoffload_tier_blocks_loaded_total", engine="1", tier="remote") == 6
    assert value("vllm:kvoffload_hit_tokens_total", engine="0") is None  # never observed


def test_tier_events_become_vllm_events_per_group() -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
    from kvoffload.integrations.vllm.events import to_vllm_events
    from kvoffload.keys import BlockHash, make_offload_key
    from kvoffload.tiers.base import TierEvent

    config = OffloadConfig(
        groups=(GroupSpec(GroupKind.SLIDING_WINDOW, 32, sliding_window=64, page_bytes=8),
                GroupSpec(GroupKind.FULL_ATTENTION, 32, page_bytes=8)),
        hash_block_size=32, host_capacity_bytes=1 << 20, block_size_factor=2, eviction_policy="lru")
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    h1, h2 = BlockHash(b"\x01" * 16), BlockHash(b"\x02" * 16)
    x1, x2 = maybe_convert_block_hash(h1), maybe_convert_block_hash(h2)
    keys = (make_offload_key(h1, 1), make_offload_key(h1, 0), make_offload_key(h2, 1))
    events = to_vllm_events([TierEvent(keys, "host", removed=False),
                             TierEvent(keys[:1], "host", removed=True)], config)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [(e.group_idx, e.block_hashes) for e in stored] == [(0, [x1]), (1, [x1, x2])]
    assert stored[0].kv_cache_spec_kind == "sliding_window"
    assert stored[0].kv_cache_spec_sliding_window == 64
    assert all(e.block_size == 64 and e.medium == "CPU" for e in stored)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [(e.group_idx, e.block_hashes) for e in removed] == [(1, [x1])]
