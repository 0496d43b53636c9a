"""Bytes stored and loaded back, byte for byte, for every layout, factor and rank."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from worker_kit import (
    LAYOUTS,
    CacheSet,
    kv_fused_block_major,
    kv_fused_kv_first,
    kv_separate,
    load,
    make_worker,
    mamba_raw_padded,
    mamba_states,
    next_job_id,
    run_all,
    store,
)

from kvoffload.jobs import Direction, GroupTransfer, TransferJob, merge_reports
from kvoffload.worker import TransferWorker

SENTINEL = 0xEE


def expected_slot_pages(worker: TransferWorker, cache: CacheSet, group: int,
                        pairs: list[tuple[int, int, int]]) -> None:
    """Assert that each (block, slot, sub-block) page sits where the slot layout says."""
    glayout = worker.layout.groups[group]
    pool = worker.host_pool
    sizes = [s.page_bytes for s in glayout.segments]
    for block_id, slot, sub in pairs:
        engine = cache.block(block_id)
        start = 0
        for index, size in enumerate(sizes):
            host = pool.page_view(slot, group, index, sub)
            assert torch.equal(host, engine[start : start + size]), (block_id, slot, sub, index)
            start += size


@pytest.mark.parametrize("factor", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_store_then_load_into_other_blocks(name: str, factor: int) -> None:
    rng = random.Random(f"{name}-{factor}")
    cache = LAYOUTS[name](41, torch.Generator().manual_seed(factor))
    worker = make_worker([cache], factor=factor, num_slots=9)
    ids = rng.sample(range(1, 41), 6 * factor)
    src, dst = ids[: 3 * factor], ids[3 * factor :]
    slots = rng.sample(range(9), 3)
    before = {b: cache.block(b).clone() for b in range(1, 41)}

    s = store(0, src, slots)
    report = run_all(worker, [s])
    assert report.finished == (s.job_id,) and not report.failed
    expected_slot_pages(worker, cache, 0, list(s.groups[0].pairs(factor)))

    ld = load(0, dst, slots)
    report = run_all(worker, [ld])
    assert report.finished == (ld.job_id,)
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(cache.block(b), before[a]), f"block {b} != stored block {a}"
    for other in set(range(1, 41)) - set(dst):
        assert torch.equal(cache.block(other), before[other]), f"block {other} was touched"
    assert report.stats.loaded_bytes == len(dst) * worker.layout.groups[0].page_bytes
    worker.shutdown()


def hybrid_caches(num_blocks: int, seed: int) -> list[CacheSet]:
    gen = torch.Generator().manual_seed(seed)
    return [kv_separate(num_blocks, gen), kv_fused_kv_first(num_blocks, gen),
            mamba_states(num_blocks, gen), mamba_raw_padded(num_blocks, gen),
            kv_fused_block_major(num_blocks, gen, layers=1)]


def test_hybrid_model_all_groups_in_one_job() -> None:
    caches = hybrid_caches(20, seed=3)
    factor = 2
    worker = make_worker(caches, factor=factor, num_slots=12)
    slot_of = [(0, 1), (2, 3), (4,), (5,), (6, 7)]
    blocks = [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10), (11, 12), (13, 14, 15, 16)]
    targets = [(17, 18, 19, 2), (3, 4, 14, 15), (16, 1), (5, 6), (7, 8, 9, 10)]
    before = [{b: c.block(b).clone() for b in range(1, 20)} for c in caches]
    s = TransferJob(next_job_id(), Direction.STORE, "r", tuple(
        GroupTransfer(g, blocks[g], 0, slot_of[g]) for g in range(len(caches))))
    assert run_all(worker, [s]).finished == (s.job_id,)
    for g, cache in enumerate(caches):
        expected_slot_pages(worker, cache, g, list(s.groups[g].pairs(factor)))
    ld = TransferJob(next_job_id(), Direction.LOAD, "r", tuple(
        GroupTransfer(g, targets[g], 0, slot_of[g]) for g in range(len(caches))))
    report = run_all(worker, [ld])
    assert report.finished == (ld.job_id,)
    for g, cache in enumerate(caches):
        for a, b in zip(blocks[g], targets[g], strict=True):
            assert torch.equal(cache.block(b), before[g][a]), (g, a, b)
    worker.shutdown()


def test_partial_first_block_store_leaves_the_skipped_sub_blocks_alone() -> None:
    """A window store whose first offloaded block straddles the window edge: logical
    blocks 4..8 with factor 3 start at sub-block 1 of the first slot."""
    cache = kv_fused_kv_first(16, torch.Generator().manual_seed(1))
    worker = make_worker([cache], factor=3, num_slots=4)
    worker.host_pool.arena.fill_(SENTINEL)
    s = store(0, [3, 9, 4, 12, 6], slots=[2, 0], first_block_index=4)
    assert run_all(worker, [s]).finished == (s.job_id,)
    pairs = list(s.groups[0].pairs(3))
    assert [(slot, sub) for _, slot, sub in pairs] == [(2, 1), (2, 2), (0, 0), (0, 1), (0, 2)]
    expected_slot_pages(worker, cache, 0, pairs)
    for segment in range(len(worker.layout.groups[0].segments)):
        assert bool((worker.host_pool.page_view(2, 0, segment, 0) == SENTINEL).all())
    worker.shutdown()


def test_load_starting_mid_block_copies_only_the_listed_blocks() -> None:
    """A load whose first engine blocks are already cached: logical blocks 5..10 with
    factor 4 start at sub-block 1 of the first slot and stop at sub-block 2 of the second."""
    cache = mamba_states(24, torch.Generator().manual_seed(2))
    worker = make_worker([cache], factor=4, num_slots=3)
    src = list(range(1, 9))
    s = store(0, src, slots=[1, 2])
    assert run_all(worker, [s]).finished == (s.job_id,)
    before = {b: cache.block(b).clone() for b in range(1, 24)}
    dst = [20, 13, 17, 11, 14, 22]
    ld = load(0, dst, slots=[1, 2], first_block_index=5)
    assert run_all(worker, [ld]).finished == (ld.job_id,)
    # Logical 5..10 -> slot 1 sub 1..3 (blocks 2,3,4), slot 2 sub 0..2 (blocks 5,6,7).
    for block, source in zip(dst, [2, 3, 4, 5, 6, 7], strict=True):
        assert torch.equal(cache.block(block), before[source])
    for other in set(range(1, 24)) - set(dst):
        assert torch.equal(cache.block(other), before[other])
    worker.shutdown()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), factor=st.integers(1, 4), layout=st.sampled_from(sorted(LAYOUTS)))
def test_any_store_load_pair_round_trips(data: st.DataObject, factor: int, layout: str) -> None:
    num_blocks, num_slots = 30, 8
    cache = LAYOUTS[layout](num_blocks, torch.Generator().manual_seed(factor))
    worker = make_worker([cache], factor=factor, num_slots=num_slots)
    try:
        store_skip = data.draw(st.integers(0, factor - 1), "store skip")
        n = data.draw(st.integers(1, 3 * factor - store_skip), "blocks")
        need = -(-(store_skip + n) // factor)
        slots = data.draw(st.permutations(range(num_slots)), "slots")[:need]
        ids = data.draw(st.permutations(range(1, num_blocks)), "ids")
        src, dst = ids[:n], ids[n : 2 * n]
        before = {b: cache.block(b).clone() for b in range(1, num_blocks)}
        first = store_skip + factor * data.draw(st.integers(0, 5), "first offloaded block")
        s = store(0, src, slots, first_block_index=first)
        assert run_all(worker, [s]).finished == (s.job_id,)
        # Load back a sub-range of what was stored, possibly starting mid-block.
        lo = data.draw(st.integers(0, n - 1), "load from")
        hi = data.draw(st.integers(lo + 1, n), "load to")
        load_first = first + lo
        first_slot = (load_first // factor) - (first // factor)
        last_slot = (first + hi - 1) // factor - (first // factor)
        ld = load(0, dst[lo:hi], slots[first_slot : last_slot + 1], first_block_index=load_first)
        assert run_all(worker, [ld]).finished == (ld.job_id,)
        for a, b in zip(src[lo:hi], dst[lo:hi], strict=True):
            assert torch.equal(cache.block(b), before[a])
        for other in set(range(1, num_blocks)) - set(dst[lo:hi]):
            assert torch.equal(cache.block(other), before[other])
    finally:
        worker.shutdown()


@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_ranks_move_their_own_shards_into_the_same_slots(ranks: int) -> None:
    factor = 2
    shards = [hybrid_caches(18, seed=100 + r)[:3] for r in range(ranks)]
    workers = [make_worker(shards[r], factor=factor, num_slots=10, rank=r, num_workers=ranks)
               for r in range(ranks)]
    befores = [[{b: c.block(b).clone() for b in range(1, 18)} for c in shard] for shard in shards]
    transfers = [GroupTransfer(0, (1, 2, 3, 4), 0, (0, 1)), GroupTransfer(1, (5, 6), 0, (2,)),
                 GroupTransfer(2, (7, 8), 0, (3,))]
    s = TransferJob(next_job_id(), Direction.STORE, "r", tuple(transfers))
    targets = [(9, 10, 11, 12), (13, 14), (15, 16)]
    ld = TransferJob(next_job_id(), Direction.LOAD, "r", tuple(
        GroupTransfer(t.group, targets[t.group], 0, t.slots) for t in transfers))
    reports = [run_all(w, [s]) for w in workers]
    counts, failed = merge_reports(reports)
    assert counts == {s.job_id: ranks} and not failed
    assert [r.rank for r in reports] == list(range(ranks))
    reports = [run_all(w, [ld]) for w in workers]
    assert merge_reports(reports) == ({ld.job_id: ranks}, set())
    for r in range(ranks):
        for g, cache in enumerate(shards[r]):
            for a, b in zip(transfers[g].block_ids, targets[g], strict=True):
                assert torch.equal(cache.block(b), befores[r][g][a]), (r, g, a, b)
        # Each rank's arena holds its own shard, not another rank's.
        if r:
            assert not torch.equal(workers[r].host_pool.slot_view(0, 0),
                                   workers[0].host_pool.slot_view(0, 0))
    for w in workers:
        w.shutdown()
