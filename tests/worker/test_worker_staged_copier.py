"""The CUDA backend's copy logic (device staging, slot images), run on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from worker_kit import (
    LAYOUTS,
    CacheSet,
    kv_fused_kv_first,
    load,
    make_config,
    mamba_states,
    next_job_id,
    store,
)

from kvoffload.jobs import Direction, GroupTransfer, TransferJob
from kvoffload.worker import CacheLayout, HostPool, StagedCopier

SENTINEL = 0xEE


def _setup(caches: list[CacheSet], factor: int, slots: int) -> tuple[StagedCopier, HostPool]:
    config = make_config(caches, factor=factor, num_slots=slots)
    layout = CacheLayout.build(config, [c.tensors(g) for g, c in enumerate(caches)])
    pool = HostPool(layout, config.num_host_slots, pin=False)
    pool.arena.fill_(SENTINEL)
    return StagedCopier(layout, pool), pool


@pytest.mark.parametrize("factor", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_staged_round_trip_with_merged_and_partial_slots(name: str, factor: int) -> None:
    cache = LAYOUTS[name](30, torch.Generator().manual_seed(factor))
    copier, pool = _setup([cache], factor, slots=8)
    before = {b: cache.block(b).clone() for b in range(1, 30)}
    # Slots 2,3,4 are consecutive (merged into one copy), 0 is not; start mid-block.
    n = 4 * factor - 1
    src = list(range(1, 1 + n))
    s = store(0, src, [2, 3, 4, 0], first_block_index=1)
    copier.copy(s)
    glayout = copier.layout.groups[0]
    for block_id, slot, sub in s.groups[0].pairs(factor):
        got = torch.cat([pool.page_view(slot, 0, i, sub) for i in range(len(glayout.segments))])
        assert torch.equal(got, before[block_id])
    if factor > 1:  # the skipped sub-block 0 of slot 2 is untouched
        assert bool((pool.page_view(2, 0, 0, 0) == SENTINEL).all())
    dst = list(range(29, 29 - n, -1))
    copier.copy(load(0, dst, [2, 3, 4, 0], first_block_index=1))
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(cache.block(b), before[a])


def test_staged_hybrid_job_with_a_group_smaller_than_the_slot() -> None:
    gen = torch.Generator().manual_seed(4)
    caches = [kv_fused_kv_first(12, gen, layers=1), mamba_states(12, gen, layers=1)]
    copier, pool = _setup(caches, factor=2, slots=6)
    assert copier.layout.groups[0].block_bytes < pool.slot_bytes
    before = [{b: c.block(b).clone() for b in range(1, 12)} for c in caches]
    job = TransferJob(next_job_id(), Direction.STORE, "r", (
        GroupTransfer(0, (1, 2, 3, 4), 0, (0, 1)), GroupTransfer(1, (5, 6, 7, 8), 0, (2, 3))))
    copier.copy(job)
    # Bytes past the (smaller) attention block inside its slots stay untouched.
    assert bool((pool.arena[0:2, copier.layout.groups[0].block_bytes :] == SENTINEL).all())
    back = TransferJob(next_job_id(), Direction.LOAD, "r", (
        GroupTransfer(0, (8, 9, 10, 11), 0, (0, 1)), GroupTransfer(1, (1, 2, 3, 4), 0, (2, 3))))
    copier.copy(back)
    for a, b in zip((1, 2, 3, 4), (8, 9, 10, 11), strict=True):
        assert torch.equal(caches[0].block(b), before[0][a])
    for a, b in zip((5, 6, 7, 8), (1, 2, 3, 4), strict=True):
        assert torch.equal(caches[1].block(b), before[1][a])
