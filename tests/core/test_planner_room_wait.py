"""Deferred lookups that wait for host room to promote into (rule 8 with a tier cascade).

A request whose blocks a lower tier holds waits while host memory has no slot for them,
bounded in seconds, not by ``max_deferred_steps`` (an idle engine spins through those in
milliseconds): while keys in host memory are pinned by loads, it waits; once a load
finishes, its promote starts and it hits; where no slot frees, the cascade ends the wait
after ``room_stall_s`` and the request recomputes. The stories drive the real
``Planner`` over a ``CascadeTier`` (host memory + the disk index, no worker) with one
fake clock for both.
"""

from __future__ import annotations

from pathlib import Path

from planner_kit import Harness, Req, full, make_config, prompt

from kvoffload.jobs import TierOp, WorkerReport
from kvoffload.planner import planner as planner_module
from kvoffload.planner.contract import MatchResult
from kvoffload.policies import cache_policy
from kvoffload.tiers.cascade import CascadeTier
from kvoffload.tiers.config import DiskTierConfig
from kvoffload.tiers.disk import DiskIndex

DEFER = MatchResult(None)
STALL_S = 0.25


class RoomHarness(Harness):
    """``Harness`` whose planner runs over host memory of three blocks + a disk index."""

    def __init__(self, directory: Path, clock: list[float]) -> None:
        config = make_config(full(), max_deferred=3, slots=3)  # blocks of no bytes: 3 slots
        super().__init__(config)
        assert self.tier.capacity == 3
        self.disk = DiskIndex(config, DiskTierConfig(str(directory), 1 << 20), "ns",
                              scan=False)
        self.cascade = CascadeTier(self.tier, [self.disk], room_wait_s=1.0,
                                   room_stall_s=STALL_S, clock=lambda: clock[0])
        self.planner = planner_module.Planner(config, self.cascade,
                                              cache_policy(config.eviction_policy),
                                              clock=lambda: clock[0])

    def on_disk(self, req: Req, blocks: range) -> None:
        for key in self.keys(req, 0, blocks):
            assert self.disk.begin_write(key)
            self.disk.end_write(key, ok=True)

    def host_pinned(self) -> Req:
        """Host memory full of another request's blocks, all pinned by its load."""
        other = self.request("a", prompt(12, base=5000))
        self.put(other, 0, range(3))
        self.cascade.prepare_load(self.keys(other, 0, range(3)))
        return other


def revisit_behind_pinned_host(tmp_path: Path) -> tuple[RoomHarness, list[float], Req, Req]:
    """The harness, its clock, the request whose load pins all of host memory, and a
    request of 12 tokens whose three blocks are on disk only."""
    clock = [100.0]
    h = RoomHarness(tmp_path, clock)
    other = h.host_pinned()
    req = h.request("b", [*prompt(12), 9])
    h.on_disk(req, range(3))
    return h, clock, other, req


def test_a_lookup_waits_for_host_room_past_the_step_bound_then_hits(tmp_path: Path) -> None:
    h, clock, other, req = revisit_behind_pinned_host(tmp_path)
    # The engine asks again every half millisecond: 300 steps (0.15 s), far past
    # max_deferred_steps (3), and no promote can start.
    for _ in range(300):
        assert h.lookup(req) == DEFER
        plan = h.step()
        assert not [job for job in plan.tier_jobs if job.op is TierOp.PROMOTE]
        clock[0] += 0.0005
    assert h.planner.stats.deferral_timeouts == 0
    h.cascade.complete_load(h.keys(other, 0, range(3)))  # the other load finished
    assert h.lookup(req) == DEFER
    promotes = [job for job in h.step().tier_jobs if job.op is TierOp.PROMOTE]
    assert {bytes(job.key) for job in promotes} == set(h.keys(req, 0, range(3)))
    h.planner.update_from_worker_reports(
        [WorkerReport(0, tier_finished=tuple(job.job_id for job in promotes))])
    assert h.lookup(req) == MatchResult(12, load_async=True)
    assert h.cascade.stats.promote_no_room_miss == {}


def test_a_lookup_stops_waiting_when_no_slot_frees_and_recomputes(tmp_path: Path) -> None:
    h, clock, other, req = revisit_behind_pinned_host(tmp_path)
    assert h.lookup(req) == DEFER
    h.step()  # the promote finds no slot: the wait begins
    started = clock[0]
    while clock[0] - started < STALL_S - 0.001:
        clock[0] += 0.0005
        assert h.lookup(req) == DEFER
        h.step()
    clock[0] = started + STALL_S
    h.lookup(req)
    h.step()  # the cascade ends the wait: the keys answer MISS until the next plan
    assert h.lookup(req) == MatchResult(0, load_async=False)
    assert h.cascade.stats.promote_no_room_miss == {"disk": 3}
    assert h.planner.stats.deferral_timeouts == 0  # the cascade ended it, not the planner
    h.cascade.complete_load(h.keys(other, 0, range(3)))
