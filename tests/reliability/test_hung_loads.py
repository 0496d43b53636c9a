"""A load that hangs past the deadline: the request recomputes elsewhere, and the blocks
the late copy writes stay parked until it reports (never handed to another request)."""

from __future__ import annotations

import pytest

from kvoffload.faults.plan import FaultKind, FaultPlan
from kvoffload.jobs import Direction
from kvoffload.refengine.engine import ReferenceEngine
from reliability.fault_kit import faulty_engine, nth, req, run, tiny_preset, toks

HANG_S = 2.0
DEADLINE_S = 0.5


def story() -> list:
    """A stores a prefix; B pushes it out of the engine's cache; C hits it in host memory
    (its load hangs) and recomputes; D and E fill the engine while the load is stuck;
    F, G and H adopt D's, E's and C's blocks from the engine's prefix cache after the late
    copy has landed, so a block it overwrote would be compared."""
    prefix = toks(32)
    return [
        req("A", prefix, output=1, at=0.0),
        req("B", toks(244, base=5000), output=1, at=0.1),
        req("C", [*prefix, *toks(8, base=9000)], output=1, at=1.0),
        req("D", toks(60, base=20000), output=40, at=1.5),
        req("E", toks(60, base=30000), output=40, at=1.5),
        req("F", [*toks(60, base=20000), *toks(4, base=40000)], output=1, at=HANG_S + 3.0),
        req("G", [*toks(60, base=30000), *toks(4, base=50000)], output=1, at=HANG_S + 3.0),
        req("H", [*prefix, *toks(8, base=9000), *toks(4, base=60000)], output=1,
            at=HANG_S + 3.0),
    ]


def build() -> ReferenceEngine:
    engine, _ = faulty_engine(
        tiny_preset(), FaultPlan(1.0, hang_s=HANG_S), num_blocks=64,
        deadline=DEADLINE_S, choose=nth(FaultKind.HANG, Direction.LOAD))
    return engine


def test_a_hung_load_is_given_up_and_its_blocks_stay_parked_until_it_lands() -> None:
    engine = build()
    run(engine, engine.executor, story())  # type: ignore[arg-type]
    m = engine.metrics
    assert m.abandoned_loads == 1
    assert m.parked_blocks_peak > 0
    assert engine.num_parked_loads == 0  # released once the late copy reported
    assert m.wrong_bytes == 0 and m.verified_blocks > 0
    records = {r.request_id: r for r in m.records}
    assert records["C"].failed_loads == 1 and records["C"].host_hit_tokens == 0
    assert len(records) == 8
    assert m.max_offload_wait_s <= DEADLINE_S + m.max_step_s
    assert engine.planner is not None and engine.planner.stats.abandoned_loads == 1
    assert engine.host is not None and engine.host.usage().pinned_slots == 0


def unpark(engine: ReferenceEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Free an abandoned request's blocks at once, and hand them out first."""
    pool = engine.pool
    pool.avoid = None

    def free_now(rid: str, new_id: str) -> None:
        table = pool.block_table(rid)
        pool.free(rid)
        for ids in table:
            for block in ids:
                if block and block in pool._free:
                    pool._free.move_to_end(block, last=False)
        pool.allocate(new_id, 0, 0)  # an empty owner, so the later free finds it

    monkeypatch.setattr(pool, "rename", free_now)


def test_without_parking_the_fence_makes_reuse_wait_for_the_late_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that frees the blocks at once still gets no wrong byte: the planner
    fences them, so reusing one flushes the hung job and the step waits for it."""
    engine = build()
    unpark(engine, monkeypatch)
    run(engine, engine.executor, story())  # type: ignore[arg-type]
    m = engine.metrics
    assert m.abandoned_loads == 1 and m.wrong_bytes == 0
    assert m.flush_stall_s >= HANG_S - DEADLINE_S - 0.1


def test_without_parking_or_fence_the_late_copy_corrupts_another_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: neither parked nor fenced, the late copy lands in blocks another
    request took, and the byte checks see it."""
    engine = build()
    unpark(engine, monkeypatch)
    planner = engine.planner
    assert planner is not None
    abandon = planner.abandon_load

    def abandon_unfenced(request: object) -> object:
        job_id = abandon(request)  # type: ignore[arg-type]
        if job_id is not None:
            js = planner._jobs[job_id]
            planner._jobs.fence.remove(job_id, js.other_block_ids)
            js.fenced_other = False
        return job_id

    monkeypatch.setattr(planner, "abandon_load", abandon_unfenced)
    monkeypatch.setattr(planner, "check_integrity", lambda: None)
    run(engine, engine.executor, story())  # type: ignore[arg-type]
    assert engine.metrics.abandoned_loads == 1
    assert engine.metrics.wrong_bytes > 0
