"""Worker-side tier I/O on real tensors, a real directory and a real redis-server.

Every block kind -- full attention (separate K/V), sliding window (K/V planes first),
Mamba (conv and SSM states of different page sizes) -- goes engine -> host slot -> lower
tier -> another host slot -> engine, and the bytes that come back are compared with the
bytes that left. Then the damage cases: a corrupt, truncated, foreign or re-keyed block is
a failed promote (a miss), is removed from the tier, and never reaches a slot as data.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvoffload.blockfile.framing import BytesLike
from kvoffload.jobs import StepPlan, TierJob, TierJobId, TierOp, WorkerReport
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.tiers.config import TierConfig
from kvoffload.tiers.naming import block_path, remote_key
from kvoffload.worker import TransferWorker
from kvoffload.worker.block_store import BlockStore
from tiers.tier_kit import RedisServer, disk_tiers, redis_server, remote_tiers
from worker.worker_kit import (
    CacheSet,
    kv_fused_kv_first,
    kv_separate,
    load,
    make_worker,
    mamba_states,
    run_all,
    store,
)

_ids = iter(range(10**6))


def key(i: int, group: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(16, "big"), group)  # type: ignore[arg-type]


def tier_job(op: TierOp, tier: str, k: OffloadKey, slot: int = -1, *,
             snapshot: bool = False) -> TierJob:
    return TierJob(TierJobId(next(_ids)), op, tier, bytes(k), k[-1], slot, snapshot)


def run_tier_jobs(worker: TransferWorker, *jobs: TierJob,
                  plan: StepPlan | None = None) -> WorkerReport:
    plan = plan or StepPlan()
    worker.begin_step(StepPlan(flush=plan.flush, stores=plan.stores, loads=plan.loads,
                               tier_jobs=jobs))
    worker.end_step()
    worker.wait([j.job_id for j in (*plan.stores, *plan.loads)])
    worker.wait_tier_jobs()
    return worker.poll()


def caches() -> list[CacheSet]:
    gen = torch.Generator().manual_seed(7)
    return [kv_separate(10, gen), kv_fused_kv_first(10, gen), mamba_states(10, gen)]


@pytest.fixture
def disk_worker(tmp_path: Path) -> Iterator[tuple[TransferWorker, list[CacheSet], TierConfig]]:
    tiers = disk_tiers(tmp_path / "disk")
    sets = caches()
    worker = make_worker(sets, num_slots=12, tiers=tiers, pin_memory=False)
    yield worker, sets, tiers
    worker.shutdown()


@pytest.fixture
def remote_worker(redis_srv: RedisServer
                  ) -> Iterator[tuple[TransferWorker, list[CacheSet], TierConfig]]:
    tiers = remote_tiers(redis_srv.url)
    sets = caches()
    worker = make_worker(sets, num_slots=12, tiers=tiers, pin_memory=False)
    yield worker, sets, tiers
    worker.shutdown()


def slot_bytes(worker: TransferWorker, slot: int, group: int) -> bytes:
    return worker.host_pool.slot_view(slot, group).numpy().tobytes()


def round_trip(worker: TransferWorker, sets: list[CacheSet], tier: str) -> None:
    """Blocks 1, 2 of every group -> slots -> tier -> other slots -> blocks 5, 6."""
    for group in range(3):
        report = run_all(worker, [store(group, [1], [2 * group]),
                                  store(group, [2], [2 * group + 1])])
        assert not report.failed
    sent = {(g, i): slot_bytes(worker, 2 * g + i, g) for g in range(3) for i in range(2)}
    demotes = [tier_job(TierOp.DEMOTE, tier, key(i, g), 2 * g + i)
               for g in range(3) for i in range(2)]
    report = run_tier_jobs(worker, *demotes)
    assert sorted(report.tier_finished) == sorted(j.job_id for j in demotes)
    worker.host_pool.arena.fill_(0xAB)  # host memory forgets everything
    promotes = [tier_job(TierOp.PROMOTE, tier, key(i, g), 6 + 2 * g + i)
                for g in range(3) for i in range(2)]
    report = run_tier_jobs(worker, *promotes)
    assert sorted(report.tier_finished) == sorted(j.job_id for j in promotes)
    assert report.tier_failed == ()
    for (g, i), data in sent.items():
        assert slot_bytes(worker, 6 + 2 * g + i, g) == data
    for g, cache in enumerate(sets):
        report = run_all(worker, [load(g, [5], [6 + 2 * g]), load(g, [6], [7 + 2 * g])])
        assert not report.failed
        assert torch.equal(cache.block(5), cache.block(1))
        assert torch.equal(cache.block(6), cache.block(2))


def test_every_group_kind_round_trips_through_the_disk(disk_worker: tuple) -> None:
    worker, sets, tiers = disk_worker
    round_trip(worker, sets, "disk")
    files = sorted(Path(tiers.disk.path).rglob("*.kvb"))
    assert len(files) == 6
    assert not list(Path(tiers.disk.path).rglob("*.tmp"))


@pytest.mark.redis
def test_every_group_kind_round_trips_through_redis(remote_worker: tuple,
                                                    redis_srv: RedisServer) -> None:
    worker, sets, _ = remote_worker
    round_trip(worker, sets, "remote")
    assert len(redis_srv.client().keys(b"kvo:*")) == 6  # type: ignore[attr-defined]


def test_a_snapshot_demote_sees_the_victim_before_the_same_plan_overwrites_it(
        disk_worker: tuple) -> None:
    worker, _sets, _ = disk_worker
    run_all(worker, [store(0, [1], [0])])
    victim = slot_bytes(worker, 0, 0)
    # The plan reuses slot 0 for block 3 (flushed: submitted in begin_step) and demotes
    # slot 0's old contents: the demote must write the old bytes -- even when the disk
    # write only starts after the store into slot 0 has finished.
    new_store = store(0, [3], [0])
    plan = StepPlan(flush=(new_store.job_id,), stores=(new_store,))
    io = worker.tier_io
    assert io is not None
    disk = io.stores["disk"]

    class AfterTheStore(BlockStore):
        name = "disk"

        def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
            worker.wait([new_store.job_id])
            return disk.put(items)

        def get_into(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
            return disk.get_into(items)

        def delete(self, keys: Sequence[bytes]) -> None:
            disk.delete(keys)

        def purge(self) -> None:
            disk.purge()

    io.stores["disk"] = AfterTheStore()
    demote = tier_job(TierOp.DEMOTE, "disk", key(1, 0), 0, snapshot=True)
    report = run_tier_jobs(worker, demote, plan=plan)
    assert report.tier_finished == (demote.job_id,) and report.finished == (new_store.job_id,)
    assert slot_bytes(worker, 0, 0) != victim  # slot 0 now holds block 3
    promote = tier_job(TierOp.PROMOTE, "disk", key(1, 0), 5)
    assert run_tier_jobs(worker, promote).tier_finished == (promote.job_id,)
    assert slot_bytes(worker, 5, 0) == victim


def demote_one(worker: TransferWorker, tier: str, k: OffloadKey, slot: int = 0) -> bytes:
    group = k[-1]
    run_all(worker, [store(group, [1], [slot])])
    job = tier_job(TierOp.DEMOTE, tier, k, slot)
    assert run_tier_jobs(worker, job).tier_finished == (job.job_id,)
    return slot_bytes(worker, slot, group)


def promote_fails(worker: TransferWorker, tier: str, k: OffloadKey, slot: int = 9) -> bool:
    worker.host_pool.slot_view(slot, k[-1]).fill_(0x5A)
    job = tier_job(TierOp.PROMOTE, tier, k, slot)
    report = run_tier_jobs(worker, job)
    return report.tier_failed == (job.job_id,) and report.tier_finished == ()


def test_corrupt_truncated_foreign_and_rekeyed_files_are_misses_and_removed(
        disk_worker: tuple, tmp_path: Path) -> None:
    worker, _, tiers = disk_worker
    io = worker.tier_io
    assert io is not None
    path = {i: block_path(tiers.disk.path, io.namespace, 0, key(i, 2)) for i in range(5)}
    for i in range(5):
        demote_one(worker, "disk", key(i, 2))

    data = bytearray(Path(path[0]).read_bytes())
    data[100] ^= 0x01  # one bit of one Mamba state (the payload starts the file)
    Path(path[0]).write_bytes(data)
    with open(path[1], "r+b") as f:
        f.truncate(10)  # a torn write
    shutil.copy(path[3], path[2])  # another block under this block's name

    # A block another layout wrote (another model's engine under a colliding namespace).
    gen = torch.Generator().manual_seed(1)
    alien_sets = [kv_separate(10, gen), kv_fused_kv_first(10, gen),
                  mamba_states(10, gen, layers=2)]
    alien_sets[2].layers.reverse()  # same sizes, other layer order: another slot layout
    # It writes into a directory of its own (one engine per directory: the lock), and
    # its file is copied over path[4].
    alien_tiers = disk_tiers(tmp_path / "alien")
    alien = make_worker(alien_sets, num_slots=12, tiers=alien_tiers, pin_memory=False)
    try:
        assert alien.tier_io is not None and alien.tier_io.fingerprint != io.fingerprint
        assert alien.tier_io.namespace == io.namespace
        demote_one(alien, "disk", key(4, 2))
    finally:
        alien.shutdown()
    shutil.copy(block_path(alien_tiers.disk.path, io.namespace, 0, key(4, 2)), path[4])

    for i in (0, 1, 2, 4):
        assert promote_fails(worker, "disk", key(i, 2)), i
        assert not os.path.exists(path[i]), i
    assert not promote_fails(worker, "disk", key(3, 2))
    assert promote_fails(worker, "disk", key(77, 2))  # never stored: a plain miss
    store_stats = io.stores["disk"].stats
    assert (store_stats.rejected, store_stats.misses) == (4, 1)


@pytest.mark.redis
def test_corrupt_and_foreign_values_in_redis_are_misses_and_removed(
        remote_worker: tuple, redis_srv: RedisServer) -> None:
    worker, _, _ = remote_worker
    io = worker.tier_io
    assert io is not None
    client = redis_srv.client()
    names = {i: remote_key(io.namespace, 0, key(i, 1)) for i in range(4)}
    for i in range(4):
        demote_one(worker, "remote", key(i, 1))
    value = bytearray(client.get(names[0]))  # type: ignore[attr-defined]
    value[-1] ^= 0x80
    client.set(names[0], bytes(value))  # type: ignore[attr-defined]
    client.set(names[1], client.get(names[1])[:-5])  # type: ignore[attr-defined]
    client.set(names[2], client.get(names[3]))  # type: ignore[attr-defined]
    for i in (0, 1, 2):
        assert promote_fails(worker, "remote", key(i, 1)), i
        assert client.exists(names[i]) == 0  # type: ignore[attr-defined]
    assert not promote_fails(worker, "remote", key(3, 1))
    assert io.stores["remote"].stats.rejected == 3


@pytest.mark.redis
def test_an_unreachable_server_fails_jobs_fast_and_is_reported(
        remote_worker: tuple, redis_srv: RedisServer) -> None:
    worker, _, _ = remote_worker
    demote_one(worker, "remote", key(0, 0))
    redis_srv.kill()
    job = tier_job(TierOp.PROMOTE, "remote", key(0, 0), 3)
    report = run_tier_jobs(worker, job)
    assert report.tier_failed == (job.job_id,) and report.tier_unreachable == ("remote",)
    again = tier_job(TierOp.PROMOTE, "remote", key(0, 0), 3)
    report = run_tier_jobs(worker, again)  # within retry_interval_s: refused at once
    assert report.tier_failed == (again.job_id,)
    assert worker.poll().tier_unreachable == ()  # reported once per failure


def test_tier_jobs_without_configured_tiers_fail_cleanly() -> None:
    worker = make_worker(caches(), num_slots=4, pin_memory=False)
    try:
        job = tier_job(TierOp.PROMOTE, "disk", key(0, 0), 1)
        report = run_tier_jobs(worker, job)
        assert report.tier_failed == (job.job_id,)
    finally:
        worker.shutdown()


@pytest.mark.redis
def test_a_full_server_refuses_sets_cleanly() -> None:
    with redis_server(maxmemory="2mb", policy="noeviction") as server:
        tiers = remote_tiers(server.url)
        sets = caches()
        worker = make_worker(sets, num_slots=12, tiers=tiers, pin_memory=False)
        try:
            run_all(worker, [store(0, [1], [0])])
            big = server.client()
            import redis

            with pytest.raises(redis.exceptions.OutOfMemoryError):  # fill it up
                for i in range(100_000):
                    big.set(b"filler%d" % i, b"x" * 1024)  # type: ignore[attr-defined]
            job = tier_job(TierOp.DEMOTE, "remote", key(0, 0), 0)
            report = run_tier_jobs(worker, job)
            assert report.tier_failed == (job.job_id,)
            assert report.tier_unreachable == ()  # refused, not unreachable
            assert worker.tier_io is not None
            assert worker.tier_io.stores["remote"].stats.write_errors == 1
            big.flushdb()  # type: ignore[attr-defined]
            again = tier_job(TierOp.DEMOTE, "remote", key(0, 0), 0)
            assert run_tier_jobs(worker, again).tier_finished == (again.job_id,)
        finally:
            worker.shutdown()
