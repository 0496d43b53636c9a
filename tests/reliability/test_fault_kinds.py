"""Every fault kind, injected between a tiny hybrid engine and its real worker on real
tensors (bytes mode): every request is served, no wrong byte reaches the engine, nothing
stays pinned, fenced, pending or parked, and each kind has its own visible outcome."""

from __future__ import annotations

import pytest

from kvoffload.errors import ConfigError
from kvoffload.faults.executor import FaultyExecutor
from kvoffload.faults.plan import ALL_KINDS, FaultKind, FaultPlan
from kvoffload.jobs import Direction
from kvoffload.refengine.engine import ReferenceEngine
from reliability.fault_kit import faulty_engine, req, run, tiny_preset, toks

HANG_S = 2.0
DEADLINE_S = 0.5


def workload(n: int = 36) -> list:
    """Five shared prefixes, each continued by several requests over time: the engine
    (48 blocks) cannot keep them all, so later requests load them from host memory."""
    out = []
    for i in range(n):
        prefix = toks(40, base=10_000 * (i % 5))
        out.append(req(f"q{i}", [*prefix, *toks(8, base=100_000 + 100 * i)], output=6,
                       at=0.25 * i))
    return out


def soak(kind: FaultKind | None, *, rate: float = 0.35, workers: int = 2,
         preset_args: dict | None = None,
         seed: int = 1, hits: bool = True) -> tuple[ReferenceEngine, FaultyExecutor]:
    plan = FaultPlan(rate, (kind,) if kind else ALL_KINDS, seed=seed, hang_s=HANG_S,
                     reorder_s=0.05, min_reset_interval_s=2.0)
    engine, faulty = faulty_engine(tiny_preset(**(preset_args or {"window": 8, "mamba": True})),
                                   plan, num_blocks=48, num_workers=workers,
                                   mirror_ranks=workers, deadline=DEADLINE_S, budget=40)
    run(engine, faulty, workload())
    check_clean(engine, faulty, hits=hits)
    return engine, faulty


def check_clean(engine: ReferenceEngine, faulty: FaultyExecutor, *,
                hits: bool = True) -> None:
    m = engine.metrics
    planner, host = engine.planner, engine.host
    assert planner is not None and host is not None
    assert len(m.records) == 36
    assert m.wrong_bytes == 0
    assert m.audited_host_blocks > 0
    assert m.verified_blocks > 0 or not hits
    assert planner.num_jobs == 0 and planner.fence_size == 0
    assert host.usage().pinned_slots == 0 and host.usage().writing_slots == 0
    assert engine.num_parked_loads == 0 and faulty.next_release() is None
    assert m.max_offload_wait_s <= DEADLINE_S + m.max_step_s


def injected(faulty: FaultyExecutor, kind: FaultKind, direction: Direction) -> int:
    return faulty.log.injected.get(f"{kind.value}/{direction.value}", 0)


def test_without_faults_loads_happen_and_nothing_fails() -> None:
    engine, faulty = soak(None, rate=0.0)
    assert engine.metrics.traffic[0].loaded_blocks > 0
    assert faulty.log.total == 0
    assert engine.planner is not None and engine.planner.stats.failed_loads == 0


def test_failed_transfers_write_garbage_that_is_never_used() -> None:
    engine, faulty = soak(FaultKind.FAIL)
    stats = engine.planner.stats  # type: ignore[union-attr]
    assert injected(faulty, FaultKind.FAIL, Direction.LOAD) > 0
    assert injected(faulty, FaultKind.FAIL, Direction.STORE) > 0
    assert stats.failed_loads == injected(faulty, FaultKind.FAIL, Direction.LOAD)
    assert stats.failed_stores == injected(faulty, FaultKind.FAIL, Direction.STORE)
    assert sum(r.failed_loads for r in engine.metrics.records) == stats.failed_loads


def test_hung_loads_are_given_up_at_the_deadline_and_hung_stores_wait() -> None:
    engine, faulty = soak(FaultKind.HANG)
    assert injected(faulty, FaultKind.HANG, Direction.LOAD) > 0
    assert injected(faulty, FaultKind.HANG, Direction.STORE) > 0
    assert engine.metrics.abandoned_loads > 0
    assert engine.metrics.parked_blocks_peak > 0


def test_duplicate_reports_are_detected_and_ignored() -> None:
    engine, faulty = soak(FaultKind.DUPLICATE)
    jobs = faulty.log.by_kind()["duplicate"]
    assert jobs > 0
    # Each rank reports each duplicated job twice; every second report is counted.
    assert engine.planner.stats.duplicate_reports == 2 * jobs  # type: ignore[union-attr]


def test_jobs_in_flight_across_a_reset_report_late_and_are_ignored() -> None:
    # Every reset drops what was offloaded, so this run may see no hit at all.
    engine, faulty = soak(FaultKind.LATE, rate=0.05, hits=False)
    assert faulty.log.resets > 0 and engine.metrics.cache_resets == faulty.log.resets
    assert engine.planner.stats.stale_reports > 0  # type: ignore[union-attr]


def test_reports_out_of_order_change_nothing() -> None:
    engine, faulty = soak(FaultKind.REORDER)
    assert faulty.log.by_kind()["reorder"] > 0
    assert engine.planner.stats.failed_loads == 0  # type: ignore[union-attr]


def test_a_job_some_ranks_report_late_completes_with_the_last_rank() -> None:
    engine, faulty = soak(FaultKind.PARTIAL)
    assert injected(faulty, FaultKind.PARTIAL, Direction.LOAD) > 0
    assert injected(faulty, FaultKind.PARTIAL, Direction.STORE) > 0
    # A load one rank has not reported is not done: it outlives the deadline, abandoned;
    # a store one rank has not reported keeps its blocks fenced: the next flush waits.
    assert engine.metrics.abandoned_loads > 0
    assert engine.metrics.flush_stall_s > 0
    # The late rank's report completes the job; it is no duplicate of an earlier one.
    assert engine.planner.stats.duplicate_reports == 0  # type: ignore[union-attr]


def test_partial_faults_need_two_ranks() -> None:
    _, faulty = soak(FaultKind.PARTIAL, workers=1)
    assert faulty.log.total == 0


@pytest.mark.parametrize("preset_args", [{"window": 8}, {"mamba": True}, {}],
                         ids=["window", "mamba", "full"])
def test_every_kind_at_once_on_every_layout(preset_args: dict) -> None:
    _, faulty = soak(None, rate=0.3, preset_args=preset_args, seed=7)
    assert len(faulty.log.by_kind()) >= 5


def test_fault_plans_parse_and_refuse_nonsense() -> None:
    plan = FaultPlan.parse("0.05,fail,hang,fail", seed=3)
    assert plan.rate == 0.05 and plan.kinds == (FaultKind.FAIL, FaultKind.HANG)
    assert FaultPlan.parse("0.5").kinds == ALL_KINDS
    for text in ("", "x", "1.5", "0.1,explode", "-0.1"):
        with pytest.raises(ConfigError):
            FaultPlan.parse(text)


def test_a_fault_schedule_is_reproducible() -> None:
    def draws(seed: int) -> list:
        schedule = FaultPlan(0.5, seed=seed).schedule()
        return [schedule.decide() for _ in range(200)]

    assert draws(4) == draws(4)
    assert draws(4) != draws(5)
    assert 60 < sum(d is not None for d in draws(4)) < 140
