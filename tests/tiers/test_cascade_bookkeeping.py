"""Scheduler-side bookkeeping of the cascade and the disk index, without a worker.

Stories: a host eviction demotes the victim from the slot it held, as a snapshot; a lookup
of a demoted block is PENDING, its prefetch promotes it into a host slot, and it is a HIT
only once every rank reported; a failed promote is a MISS and the disk copy is deleted;
write-through pins the host key until the demote reports; tier-job reports follow the
planner's rules (exactly once per rank, stale after reset, never-issued is a bug); the disk
index keeps its byte budget, never evicts a block being read or written, and rebuilds
itself from a directory listing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvoffload.blockfile.framing import HEADER_BYTES
from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.jobs import TierJob, TierJobId, TierOp, TierWork, WorkerReport
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.tiers.base import LookupResult, TierHints
from kvoffload.tiers.cascade import CascadeTier
from kvoffload.tiers.config import DiskTierConfig, WriteMode
from kvoffload.tiers.disk import DiskIndex
from kvoffload.tiers.naming import block_path
from support.offload_kit import host_tier

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.PENDING


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(16, "big"), group)  # type: ignore[arg-type]


def config(slots: int = 4, workers: int = 2) -> OffloadConfig:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, 4, page_bytes=100),
              GroupSpec(GroupKind.MAMBA, 4, page_bytes=300))
    return OffloadConfig(groups=groups, hash_block_size=4, host_capacity_bytes=300 * slots,
                         num_workers=workers, eviction_policy="lru")


def cascade(tmp_path: Path, mode: WriteMode = WriteMode.WRITE_BACK, slots: int = 4,
            capacity: int = 1 << 20) -> tuple[CascadeTier, DiskIndex]:
    cfg = config(slots)
    disk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), capacity, write_mode=mode), "ns")
    return CascadeTier(host_tier(cfg), [disk]), disk


def store(tier: CascadeTier, *keys: OffloadKey) -> None:
    result = tier.prepare_store(list(keys))
    assert result is not None
    tier.complete_store(result.keys_to_store)


def report(tier: CascadeTier, jobs: tuple[TierJob, ...], *, ranks: tuple[int, ...] = (0, 1),
           failed: bool = False) -> None:
    ids = tuple(j.job_id for j in jobs)
    tier.update_from_tier_reports([WorkerReport(r, tier_failed=ids) if failed else
                                   WorkerReport(r, tier_finished=ids) for r in ranks])


def only(work: TierWork, op: TierOp) -> tuple[TierJob, ...]:
    return tuple(j for j in work.jobs if j.op is op)


def test_write_back_demotes_a_victim_from_its_old_slot_as_a_snapshot(tmp_path: Path) -> None:
    tier, disk = cascade(tmp_path)
    store(tier, key(0), key(1), key(2), key(3))
    old_slot = tier.host.slot_of(key(0))
    result = tier.prepare_store([key(4)])
    assert result is not None and result.evicted == (key(0),)
    assert result.evicted_slots == (old_slot,) == result.slots  # reused at once
    (demote,) = only(tier.take_tier_work(), TierOp.DEMOTE)
    assert (demote.key, demote.slot, demote.snapshot, demote.tier) == (key(0), old_slot,
                                                                        True, "disk")
    assert tier.lookup(key(0)) is PENDING  # being written to disk: ask again
    report(tier, (demote,), ranks=(0,))
    assert disk.status(key(0)) is PENDING  # rank 1 has not reported
    report(tier, (demote,), ranks=(1,))
    assert disk.status(key(0)) is HIT
    tier.check_integrity()


def test_lower_usage_reports_what_the_disk_holds(tmp_path: Path) -> None:
    tier, disk = cascade(tmp_path)
    assert [(u.name, u.used_bytes, u.blocks) for u in tier.lower_usage()] == [("disk", 0, 0)]
    store(tier, key(0), key(1), key(2), key(3))
    store(tier, key(4))  # evicts key 0, written back to disk
    (demote,) = only(tier.take_tier_work(), TierOp.DEMOTE)
    report(tier, (demote,))
    (usage,) = tier.lower_usage()
    assert (usage.used_bytes, usage.blocks) == (disk.used_bytes, 1) and usage.used_bytes > 0


def test_a_demoted_block_is_promoted_and_hit_once_every_rank_reported(tmp_path: Path) -> None:
    tier, _ = cascade(tmp_path)
    store(tier, key(0), key(1), key(2), key(3))
    store(tier, key(4))
    report(tier, tier.take_tier_work().jobs)  # key 0 now on disk only

    assert tier.lookup(key(0)) is PENDING
    assert tier.take_tier_work().jobs == ()  # a lookup alone promotes nothing
    # key 4 is in host memory: shielded, not promoted
    tier.hint(TierHints(prefetch=(key(0), key(4))))
    work = tier.take_tier_work()
    (promote,) = only(work, TierOp.PROMOTE)
    assert promote.key == key(0) and tier.host.slot_of(key(0)) == promote.slot
    assert key(4) in tier.host
    (victim_demote,) = only(work, TierOp.DEMOTE)  # the promote evicted key 1 (LRU)
    assert victim_demote.key == key(1) and victim_demote.snapshot
    report(tier, (promote,), ranks=(1,))
    assert tier.lookup(key(0)) is PENDING
    report(tier, work.jobs, ranks=(0,))
    report(tier, (victim_demote,), ranks=(1,))
    assert tier.lookup(key(0)) is HIT
    grant = tier.prepare_load([key(0), key(4)])
    assert grant.slots == (promote.slot, tier.host.slot_of(key(4)))
    assert dict(grant.blocks_by_source) == tier.stats.loaded_group_blocks  # the first load
    assert sum(grant.blocks_by_source.values()) == 2
    assert tier.stats.loaded_blocks == {"disk": 1, "host": 1}
    assert tier.stats.hit_shares() == {"disk": 0.5, "host": 0.5}
    tier.complete_load([key(0), key(4)])
    tier.check_integrity()


def test_a_failed_promote_is_a_miss_and_the_disk_copy_is_deleted(tmp_path: Path) -> None:
    tier, disk = cascade(tmp_path)
    store(tier, key(0), key(1), key(2), key(3))
    store(tier, key(4))
    report(tier, tier.take_tier_work().jobs)
    tier.hint(TierHints(prefetch=(key(0),)))
    (promote,) = only(tier.take_tier_work(), TierOp.PROMOTE)
    report(tier, (promote,), ranks=(0,))
    report(tier, (promote,), ranks=(1,), failed=True)  # e.g. rank 1's file was corrupt
    assert key(0) not in tier.host and key(0) not in disk
    assert tier.lookup(key(0)) is MISS
    (delete,) = only(tier.take_tier_work(), TierOp.DELETE)
    assert delete.key == key(0)
    assert tier.stats.promote_failed == {"disk": 1}
    tier.check_integrity()


def test_write_through_pins_the_host_key_until_the_demote_reports(tmp_path: Path) -> None:
    tier, disk = cascade(tmp_path, WriteMode.WRITE_THROUGH)
    store(tier, key(0, group=1))
    (demote,) = tier.take_tier_work().jobs
    assert demote.op is TierOp.DEMOTE and not demote.snapshot and demote.group == 1
    assert tier.host.ref_count(key(0, 1)) == 1 and tier.host.stats.keys_loaded == 0
    store(tier, key(1), key(2), key(3))
    report(tier, tier.take_tier_work().jobs)  # the other three demotes
    result = tier.prepare_store([key(4)])
    assert result is not None and result.evicted == (key(1),)  # never the pinned key
    assert key(0, 1) in tier.host
    report(tier, (demote,))
    assert tier.host.ref_count(key(0, 1)) == 0 and disk.status(key(0, 1)) is HIT
    store(tier, key(0, 1))  # already present everywhere: nothing more to write
    tier.check_integrity()


def test_tier_reports_count_once_per_rank_and_stale_ones_are_ignored(tmp_path: Path) -> None:
    tier, _ = cascade(tmp_path, WriteMode.WRITE_THROUGH)
    store(tier, key(0))
    (demote,) = tier.take_tier_work().jobs
    report(tier, (demote,), ranks=(0,))
    report(tier, (demote,), ranks=(0,))
    assert tier.stats.duplicate_reports == 1 and tier.num_tier_jobs == 1
    with pytest.raises(InvariantError, match="never issued"):
        tier.update_from_tier_reports([WorkerReport(0, tier_finished=(TierJobId(99),))])
    with pytest.raises(InvariantError, match="rank 5"):
        tier.update_from_tier_reports([WorkerReport(5)])

    tier.reset()
    work = tier.take_tier_work()
    assert work.flush == (demote.job_id,)  # the workers wait for it before anything else
    (purge,) = work.jobs
    assert purge.op is TierOp.PURGE
    report(tier, (demote,))
    assert tier.stats.stale_reports == 2
    report(tier, (purge,))
    assert not tier.has_pending_work()
    tier.check_integrity()


def test_a_host_tier_alone_rejects_tier_reports() -> None:
    host = host_tier(config())
    assert host.take_tier_work() == TierWork()
    with pytest.raises(InvariantError):
        host.update_from_tier_reports([WorkerReport(0, tier_finished=(TierJobId(0),))])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def full_host_with_a_pinned_key(tmp_path: Path, stall_s: float = 0.5,
                                ) -> tuple[CascadeTier, Clock]:
    """One host slot: key 1 in it, pinned by a load; key 0 on disk only."""
    clock = Clock()
    cfg = config(slots=1)
    disk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), 1 << 20), "ns")
    tier = CascadeTier(host_tier(cfg), [disk], room_wait_s=0.5, room_stall_s=stall_s,
                       clock=clock)
    store(tier, key(0))
    store(tier, key(1))
    report(tier, tier.take_tier_work().jobs)
    assert tier.host.ref_count(key(1)) == 0 and tier.lookup(key(0)) is PENDING
    tier.prepare_load([key(1)])
    return tier, clock


def want(tier: CascadeTier, *keys: OffloadKey) -> tuple[TierJob, ...]:
    tier.hint(TierHints(prefetch=keys))
    return only(tier.take_tier_work(), TierOp.PROMOTE)


def test_a_promote_without_a_host_slot_waits_while_a_load_holds_one(tmp_path: Path) -> None:
    tier, clock = full_host_with_a_pinned_key(tmp_path)
    assert want(tier, key(0)) == ()
    assert tier.stats.promote_no_room == 1
    assert tier.lookup(key(0)) is PENDING  # the request waits for room ...
    assert tier.answer_wait_s([key(0)]) == 1.0  # ... by time (twice the bound: the tier
    # ends the wait itself), not by steps
    assert tier.answer_wait_s([key(1)]) == 0.0
    clock.now += 0.4
    assert want(tier, key(0)) == ()
    assert tier.lookup(key(0)) is PENDING
    tier.complete_load([key(1)])  # the load finished: its slot can be taken
    (promote,) = want(tier, key(0))
    assert promote.key == key(0)
    assert tier.answer_wait_s([key(0)]) == 0.0  # being promoted: bounded by steps again
    assert tier.stats.promote_no_room_miss == {}
    report(tier, (promote,))
    assert tier.lookup(key(0)) is HIT


def test_a_promote_that_waited_room_wait_s_answers_miss_once(tmp_path: Path) -> None:
    tier, clock = full_host_with_a_pinned_key(tmp_path, stall_s=1.0)  # room_wait_s ends it
    assert want(tier, key(0)) == ()
    clock.now += 0.5
    assert want(tier, key(0)) == ()
    assert tier.stats.promote_no_room_miss == {"disk": 1}
    assert tier.lookup(key(0)) is MISS  # the request proceeds and recomputes
    assert tier.answer_wait_s([key(0)]) == 0.0
    tier.take_tier_work()
    assert tier.lookup(key(0)) is PENDING  # a later request tries again, with a new wait
    assert want(tier, key(0)) == ()
    assert tier.lookup(key(0)) is PENDING
    tier.complete_load([key(1)])


def test_a_wait_for_room_ends_when_no_promote_gets_a_slot_for_room_stall_s(
        tmp_path: Path) -> None:
    tier, clock = full_host_with_a_pinned_key(tmp_path, stall_s=0.25)
    assert want(tier, key(0)) == ()
    clock.now += 0.2
    assert want(tier, key(0)) == ()
    assert tier.lookup(key(0)) is PENDING
    clock.now += 0.05  # a quarter second and no promote started: room is not coming
    assert want(tier, key(0)) == ()
    assert tier.lookup(key(0)) is MISS
    assert tier.stats.promote_no_room_miss == {"disk": 1}
    tier.complete_load([key(1)])


def test_a_promote_that_gets_a_slot_extends_the_others_wait(tmp_path: Path) -> None:
    clock = Clock()
    cfg = config(slots=2)
    disk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), 1 << 20), "ns")
    tier = CascadeTier(host_tier(cfg), [disk], room_wait_s=1.0, room_stall_s=0.25,
                       clock=clock)
    for k in (key(0), key(5), key(2), key(3)):  # keys 0 and 5 end up on disk only
        store(tier, k)
        report(tier, tier.take_tier_work().jobs)
    tier.prepare_load([key(2), key(3)])  # both host slots pinned by loads
    assert want(tier, key(0)) == ()
    clock.now += 0.2
    tier.complete_load([key(3)])
    (promote,) = want(tier, key(5), key(0))  # key 5 takes the slot that freed ...
    assert promote.key == key(5)
    clock.now += 0.2  # ... so key 0, 0.4 s into its wait, waits on
    assert want(tier, key(0)) == ()
    assert tier.lookup(key(0)) is PENDING
    clock.now += 0.1  # a quarter second since a promote last started
    assert want(tier, key(0)) == ()
    assert tier.lookup(key(0)) is MISS
    report(tier, (promote,))
    tier.complete_load([key(2)])


def test_a_promote_without_a_host_slot_answers_miss_at_once_when_nothing_will_free(
        tmp_path: Path) -> None:
    tier, _ = full_host_with_a_pinned_key(tmp_path)
    tier.complete_load([key(1)])
    # key 1 is idle, but the same step's prefetch names it: it may not be evicted, and
    # no key in host memory is being written or loaded, so no slot will come.
    assert want(tier, key(0), key(1)) == ()
    assert tier.lookup(key(0)) is MISS
    assert tier.stats.promote_no_room_miss == {"disk": 1}


def test_a_prefetch_larger_than_host_memory_does_not_wait_for_room(tmp_path: Path) -> None:
    tier, _ = full_host_with_a_pinned_key(tmp_path)
    # One request's hit of two keys, host memory of one slot: it can never come up whole.
    assert want(tier, key(0), key(7)) == ()
    assert tier.lookup(key(0)) is MISS
    assert tier.answer_wait_s([key(0)]) == 0.0
    assert tier.stats.promote_no_room_miss == {"disk": 1}
    tier.complete_load([key(1)])


def test_a_prefetch_over_the_byte_budget_does_not_wait_for_room(tmp_path: Path) -> None:
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, 4, page_bytes=100),
              GroupSpec(GroupKind.MAMBA, 4, page_bytes=300))
    cfg = OffloadConfig(groups=groups, hash_block_size=4, host_capacity_bytes=600,
                        num_workers=2, eviction_policy="lru", host_accounting="bytes")
    disk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), 1 << 20), "ns")
    tier = CascadeTier(host_tier(cfg), [disk], clock=Clock())
    hit = (key(10, 1), key(11, 1), key(12))  # 300 + 300 + 100 bytes: six keys' worth of
    for k in (*hit, key(20, 1), key(21, 1), key(30)):  # slots, but 700 bytes of 600
        store(tier, k)
        report(tier, tier.take_tier_work().jobs)
    assert all(tier.lookup(k) is PENDING for k in hit[:2])  # on disk only
    tier.prepare_load([key(30)])  # a load in flight: something will free
    promoted = {job.key for job in want(tier, *hit)}
    left_out = [k for k in hit if k not in promoted and k not in tier.host]
    assert left_out  # host memory had no room for the whole hit ...
    assert all(tier.lookup(k) is MISS for k in left_out)  # ... and never will: no wait
    assert tier.answer_wait_s(hit) == 0.0
    tier.complete_load([key(30)])


def test_a_wait_for_room_ends_when_its_request_stops_asking(tmp_path: Path) -> None:
    tier, clock = full_host_with_a_pinned_key(tmp_path)
    assert want(tier, key(0)) == ()
    tier.take_tier_work()  # no lookup wanted key 0 this step
    assert tier.answer_wait_s([key(0)]) == 0.0
    clock.now += 0.5
    assert want(tier, key(0)) == ()  # asked again: a new wait begins
    assert tier.lookup(key(0)) is PENDING
    tier.reset()
    assert tier.answer_wait_s([key(0)]) == 0.0


def test_room_wait_s_must_be_seconds(tmp_path: Path) -> None:
    cfg = config()
    disk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), 1 << 20), "ns")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="room_wait_s"):
            CascadeTier(host_tier(cfg), [disk], room_wait_s=bad)
        with pytest.raises(ValueError, match="room_stall_s"):
            CascadeTier(host_tier(cfg), [disk], room_stall_s=bad)


# -- the disk index -------------------------------------------------------------------------


def test_disk_budget_evicts_idle_blocks_only(tmp_path: Path) -> None:
    cfg = config()
    small = 2 * (HEADER_BYTES + 100)  # a full-attention key over two ranks
    big = 2 * (HEADER_BYTES + 300)  # a Mamba key
    disk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), 2 * small + big), "ns", scan=False)
    for k in (key(0), key(1), key(2, 1)):
        assert disk.begin_write(k)
        disk.end_write(k, ok=True)
    assert disk.used_bytes == 2 * small + big
    assert disk.begin_read(key(0))  # pinned while a promote reads it
    assert disk.begin_write(key(3, 1))  # evicts key 1 and key 2 (oldest idle ones)
    assert sorted(disk.take_deletes()) == sorted([key(1), key(2, 1)])
    assert disk.status(key(0)) is HIT
    assert not disk.begin_write(key(4, 1))  # key 0 pinned, key 3 writing: no room
    assert disk.take_deletes() == []
    disk.end_read(key(0), ok=True)
    disk.end_write(key(3, 1), ok=False)
    assert disk.take_deletes() == [key(3, 1)]
    assert disk.used_bytes == small
    disk.check_integrity()


def test_disk_index_rebuilds_from_the_directory(tmp_path: Path) -> None:
    cfg = config()
    sizes = {0: HEADER_BYTES + 100, 1: HEADER_BYTES + 300}

    def put(k: OffloadKey, rank: int, size: int, mtime: int) -> None:
        path = block_path(tmp_path, "ns", rank, k)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Path(path).write_bytes(b"x" * size)
        os.utime(path, ns=(mtime, mtime))

    for i, k in enumerate([key(5), key(6, 1), key(7)]):
        for rank in (0, 1):
            put(k, rank, sizes[k[-1]], mtime=(10 - i) * 10**9)  # key 7 is the oldest
    put(key(8), 0, sizes[0], 10**9)  # rank 1 never wrote it (a crash)
    put(key(9), 0, sizes[0], 10**9)
    put(key(9), 1, sizes[0] - 1, 10**9)  # truncated
    Path(block_path(tmp_path, "ns", 0, key(10)) + ".123.456.tmp").write_bytes(b"partial")

    disk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), 1 << 20), "ns")
    assert all(k in disk for k in (key(5), key(6, 1), key(7))) and len(disk) == 3
    assert disk.status(key(6, 1)) is HIT
    assert sorted(disk.take_deletes()) == sorted([key(8), key(9)])
    # The oldest file is the first victim.
    tight = DiskIndex(cfg, DiskTierConfig(str(tmp_path), disk.used_bytes), "ns")
    tight.take_deletes()
    assert tight.begin_write(key(11))
    assert tight.take_deletes() == [key(7)]
    # A budget below what is on disk drops the oldest at once.
    shrunk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), disk.used_bytes - 1), "ns")
    assert key(7) in shrunk.take_deletes() and key(7) not in shrunk
    shrunk.check_integrity()


def test_accounting_mode_models_both_lower_tiers_without_io(tmp_path: Path) -> None:
    from kvoffload.offload import build_offload
    from kvoffload.tiers.config import RemoteTierConfig, TierConfig

    cfg = config(slots=1)
    missing = tmp_path / "never-created"
    tiers = TierConfig(disk=DiskTierConfig(str(missing), 1 << 20),
                       remote=RemoteTierConfig("redis://nowhere.invalid:1/0"))
    tier = build_offload(cfg, tiers, accounting=True, remote_capacity_bytes=1 << 20).tier
    assert isinstance(tier, CascadeTier)
    assert [lt.name for lt in tier.lowers] == ["disk", "remote"]
    store(tier, key(0))  # write-through to the modelled remote
    (to_remote,) = tier.take_tier_work().jobs
    assert to_remote.tier == "remote"
    report(tier, (to_remote,))
    store(tier, key(1))  # evicts key 0: write-back to disk; key 1 write-through
    work = tier.take_tier_work()
    assert sorted(j.tier for j in work.jobs) == ["disk", "remote"]
    report(tier, work.jobs)
    tier.hint(TierHints(prefetch=(key(0),)))  # disk first in the lookup order
    (promote,) = only(tier.take_tier_work(), TierOp.PROMOTE)
    assert promote.tier == "disk"
    assert not missing.exists()


def test_demotion_and_cold_insertion_hints_reach_host_memory(tmp_path: Path) -> None:
    cfg = OffloadConfig(groups=config().groups, hash_block_size=4,
                        host_capacity_bytes=300 * 4, eviction_policy="value")
    disk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), 1 << 20), "ns")
    tier = CascadeTier(host_tier(cfg), [disk])
    store(tier, key(1), key(2), key(3))
    tier.hint(TierHints(demote=(key(3),)))
    tier.hint(TierHints(cool=(key(2),)))
    assert list(tier.host)[:2] == [key(3), key(2)]
    # cold: normal again; demoted: left demoted
    tier.hint(TierHints(warm=(key(2), key(3))))
    assert list(tier.host) == [key(3), key(1), key(2)]


def test_a_demoted_key_is_not_written_back_when_host_memory_evicts_it(tmp_path: Path) -> None:
    cfg = OffloadConfig(groups=config().groups, hash_block_size=4,
                        host_capacity_bytes=300 * 4, num_workers=2, eviction_policy="value")
    disk = DiskIndex(cfg, DiskTierConfig(str(tmp_path), 1 << 20), "ns")
    tier = CascadeTier(host_tier(cfg), [disk])
    store(tier, key(0), key(1), key(2), key(3))
    tier.hint(TierHints(demote=(key(2),)))
    result = tier.prepare_store([key(4), key(5)])
    assert result is not None and set(result.evicted) == {key(2), key(0)}
    tier.complete_store(result.keys_to_store)
    (demote,) = only(tier.take_tier_work(), TierOp.DEMOTE)
    assert demote.key == key(0)  # the demoted key serves no likely hit: not written
    assert tier.stats.worthless_not_demoted == 1
    report(tier, (demote,))
    store(tier, key(2))  # stored again, then evicted: written back as any other key
    report(tier, tier.take_tier_work().jobs)
    result = tier.prepare_store([key(6), key(7), key(8), key(9)])  # evicts all four
    assert result is not None and key(2) in result.evicted
    assert key(2) in {j.key for j in only(tier.take_tier_work(), TierOp.DEMOTE)}
    tier.check_integrity()


def two_key_value_cascade(tmp_path: Path) -> CascadeTier:
    """Host memory of two keys under the value policy, over a disk tier."""
    cfg = OffloadConfig(groups=config().groups, hash_block_size=4,
                        host_capacity_bytes=300 * 2, num_workers=2, eviction_policy="value")
    return CascadeTier(host_tier(cfg), [DiskIndex(cfg, DiskTierConfig(str(tmp_path), 1 << 20),
                                                 "ns")])


def test_a_demoted_key_that_is_hit_is_written_back_after_all(tmp_path: Path) -> None:
    tier = two_key_value_cascade(tmp_path)
    store(tier, key(0), key(1))
    tier.hint(TierHints(demote=(key(1),)))
    tier.prepare_load([key(1)])  # a request hits it: it has value after all
    tier.complete_load([key(1)])
    result = tier.prepare_store([key(2), key(3)])
    assert result is not None and set(result.evicted) == {key(0), key(1)}
    assert {j.key for j in only(tier.take_tier_work(), TierOp.DEMOTE)} == {key(0), key(1)}
    assert tier.stats.worthless_not_demoted == 0


def test_a_demoted_key_that_is_touched_is_written_back_after_all(tmp_path: Path) -> None:
    tier = two_key_value_cascade(tmp_path)
    store(tier, key(0), key(1))
    tier.hint(TierHints(demote=(key(1),)))
    tier.touch([key(1)])  # used after all: the hint is undone
    result = tier.prepare_store([key(2), key(3)])
    assert result is not None and set(result.evicted) == {key(0), key(1)}
    assert {j.key for j in only(tier.take_tier_work(), TierOp.DEMOTE)} == {key(0), key(1)}
    assert tier.stats.worthless_not_demoted == 0
    tier.check_integrity()
