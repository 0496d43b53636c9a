"""The CUDA backend's staging budget, run on CPU tensors through the real ``StagedCopier``.

A job much larger than the budget is copied chunk by chunk through one buffer per
direction; it must move exactly the bytes an unbounded copier moves, never hold or
allocate more staging than the budget, and refuse at bind a slot image that cannot fit.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from worker_kit import (
    LAYOUTS,
    CacheSet,
    kv_fused_kv_first,
    kv_separate,
    load,
    make_config,
    make_worker,
    mamba_raw_padded,
    mamba_states,
    next_job_id,
    store,
)

from kvoffload.errors import ConfigError, LayoutError
from kvoffload.integrations.vllm.options import ConnectorOptions
from kvoffload.jobs import Direction, GroupTransfer, TransferJob
from kvoffload.worker import CacheLayout, CudaBackend, HostPool, StagedCopier, TransferWorker
from kvoffload.worker.cuda import DEFAULT_STAGING_BYTES, staging_need

SENTINEL = 0xEE
UNBOUNDED = 1 << 40
CacheMaker = Callable[[], list[CacheSet]]


def _setup(caches: list[CacheSet], factor: int, slots: int,
           budget: int | Callable[[CacheLayout], int]) -> tuple[StagedCopier, HostPool]:
    config = make_config(caches, factor=factor, num_slots=slots)
    layout = CacheLayout.build(config, [c.tensors(g) for g, c in enumerate(caches)])
    pool = HostPool(layout, config.num_host_slots, pin=False)
    pool.arena.fill_(SENTINEL)
    staging = budget(layout) if callable(budget) else budget
    return StagedCopier(layout, pool, staging_bytes=staging), pool


def _two_slots(layout: CacheLayout) -> int:
    """A budget of two slot images of the largest group (with their gather pages)."""
    return max(staging_need(g, 2) for g in layout.groups.values())


def _twins(make: CacheMaker, factor: int, slots: int) -> tuple[
        tuple[StagedCopier, HostPool, list[CacheSet]],
        tuple[StagedCopier, HostPool, list[CacheSet]]]:
    """The same caches (same bytes) twice: behind a two-slot budget and an unbounded one."""
    small_caches, big_caches = make(), make()
    small = _setup(small_caches, factor, slots, _two_slots)
    big = _setup(big_caches, factor, slots, UNBOUNDED)
    return (*small, small_caches), (*big, big_caches)


def _assert_holds_at_most(copier: StagedCopier, budget: int) -> None:
    assert set(copier.staging) == set(Direction)
    for buffer in copier.staging.values():
        assert buffer.dtype == torch.uint8 and buffer.numel() <= budget


# Slots with runs of consecutive ids (merged into one host copy, cut at chunk edges) and
# jumps; 12 slots, so a two-slot budget makes six chunks.
SLOTS = [3, 4, 5, 6, 0, 9, 10, 1, 2, 11, 12, 13]


@pytest.mark.parametrize("factor", [1, 3])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_job_much_larger_than_the_budget_moves_the_same_bytes(name: str, factor: int) -> None:
    def make() -> list[CacheSet]:
        return [LAYOUTS[name](80, torch.Generator().manual_seed(7 + factor))]

    (small, small_pool, small_caches), (big, big_pool, big_caches) = _twins(make, factor, 16)
    glayout = small.layout.groups[0]
    assert small.slots_per_chunk(0) == 2 and big.slots_per_chunk(0) == 16
    budget = staging_need(glayout, 2)
    _assert_holds_at_most(small, budget)
    cache = small_caches[0]
    before = {b: cache.block(b).clone() for b in range(1, 80)}
    # A store starting mid-block (partial first slot), then a load starting mid-block and
    # ending mid-block (partial first and last slots).
    n = len(SLOTS) * factor - (1 if factor > 1 else 0)
    src = list(range(1, 1 + n))
    s = store(0, src, SLOTS, first_block_index=1)
    small.copy(s)
    big.copy(s)
    assert torch.equal(small_pool.arena, big_pool.arena)
    for block_id, slot, sub in s.groups[0].pairs(factor):
        got = torch.cat([small_pool.page_view(slot, 0, i, sub)
                         for i in range(len(glayout.segments))])
        assert torch.equal(got, before[block_id])
    m = n - (1 if factor > 1 else 0)
    dst = list(range(79, 79 - m, -1))
    ld = load(0, dst, SLOTS, first_block_index=1)
    small.copy(ld)
    big.copy(ld)
    for b in range(80):
        assert torch.equal(cache.block(b), big_caches[0].block(b))
    for a, b in zip(src, dst, strict=False):
        assert torch.equal(cache.block(b), before[a])
    _assert_holds_at_most(small, budget)


def _hybrid() -> list[CacheSet]:
    gen = torch.Generator().manual_seed(11)
    return [kv_separate(60, gen, layers=2), kv_fused_kv_first(60, gen, layers=1),
            mamba_states(60, gen, layers=2), mamba_raw_padded(60, gen, layers=1)]


def test_several_groups_and_mamba_pages_under_a_two_slot_budget() -> None:
    factor = 2
    (small, small_pool, small_caches), (big, big_pool, big_caches) = _twins(_hybrid, factor, 24)
    largest = max(small.layout.groups.values(), key=lambda g: staging_need(g, 1))
    assert small.slots_per_chunk(largest.group) == 2
    assert any(small.slots_per_chunk(g) > 2 for g in small.layout.groups)  # smaller groups
    budget = _two_slots(small.layout)
    before = [{b: c.block(b).clone() for b in range(1, 60)} for c in small_caches]
    # Each group its own slots; the first group starts mid-block, the Mamba groups too.
    groups = (GroupTransfer(0, tuple(range(1, 12)), 1, (8, 9, 10, 0, 1, 2)),
              GroupTransfer(1, tuple(range(12, 24)), 0, (3, 4, 5, 11, 12, 13)),
              GroupTransfer(2, tuple(range(24, 33)), 1, (14, 15, 16, 17, 18)),
              GroupTransfer(3, tuple(range(33, 43)), 0, (19, 20, 21, 22, 23)))
    s = TransferJob(next_job_id(), Direction.STORE, "r", groups)
    small.copy(s)
    big.copy(s)
    assert torch.equal(small_pool.arena, big_pool.arena)
    back = TransferJob(next_job_id(), Direction.LOAD, "r", tuple(
        GroupTransfer(t.group, tuple(b + 16 for b in t.block_ids), t.first_block_index,
                      t.slots) for t in groups))
    small.copy(back)
    big.copy(back)
    for g, transfer in enumerate(groups):
        for b in range(60):
            assert torch.equal(small_caches[g].block(b), big_caches[g].block(b))
        for a in transfer.block_ids:
            assert torch.equal(small_caches[g].block(a + 16), before[g][a])
    _assert_holds_at_most(small, budget)


def test_a_load_reading_one_slot_more_than_once() -> None:
    """A load may read a slot twice, apart or in a row (the worker allows it; only
    destinations must differ): every page still comes from its own slot and sub-block,
    wherever the chunks are cut."""
    cache = kv_separate(40, torch.Generator().manual_seed(8))
    copier, pool = _setup([cache], 2, 8, _two_slots)
    copier.copy(store(0, list(range(1, 17)), list(range(8))))
    slots = [5, 6, 7, 5, 5, 2]
    ld = load(0, list(range(20, 31)), slots, first_block_index=1)
    pages = ld.groups[0].pairs(2)
    expect = {b: torch.cat([pool.page_view(slot, 0, i, sub)
                            for i in range(len(copier.layout.groups[0].segments))])
              for b, slot, sub in pages}
    copier.copy(ld)
    for b, want in expect.items():
        assert torch.equal(cache.block(b), want)


def test_no_copy_allocates_beyond_its_index_tensors() -> None:
    """The staging lives in the copier's buffers: a big job allocates only its indices
    (24 bytes per engine block), never slot images or gathered pages of its own."""
    cache = kv_separate(200, torch.Generator().manual_seed(3), layers=4, block_size=16,
                        heads=4, head_dim=64)
    copier, _ = _setup([cache], 2, 100, _two_slots)
    block_bytes = copier.layout.groups[0].block_bytes
    pages = 180
    for job in (store(0, list(range(1, 1 + pages)), list(range(90))),
                load(0, list(range(1, 1 + pages)), list(range(90)))):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            copier.copy(job)
        sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
        assert sum(sizes) <= 3 * 8 * pages < block_bytes, sizes
    # The job moved about 40 budgets' worth of bytes.
    assert pages * copier.layout.groups[0].page_bytes > 30 * copier.staging_bytes


def test_the_store_reads_point_comes_after_the_last_gather() -> None:
    """``after_engine_reads`` runs once, after every engine block of the store was read
    and before the last chunk reaches the host: changing the engine blocks then no longer
    changes what is stored."""
    cache = kv_separate(40, torch.Generator().manual_seed(5))
    copier, pool = _setup([cache], 1, 12, _two_slots)
    before = {b: cache.block(b).clone() for b in range(1, 40)}
    slots = list(range(12))
    calls: list[bool] = []

    def reads_done() -> None:
        # Slots 0-9 (five chunks) are on the host, the last chunk's 10-11 not yet.
        calls.append(bool((pool.arena[10:12] == SENTINEL).all())
                     and not bool((pool.arena[9] == SENTINEL).all()))
        for _, pair in cache.layers:
            for t in pair:
                t.zero_()

    s = store(0, list(range(1, 13)), slots)
    copier.copy(s, after_engine_reads=reads_done)
    assert calls == [True]
    for block_id, slot, _ in s.groups[0].pairs(1):
        assert torch.equal(pool.slot_view(slot, 0), before[block_id])
    copier.copy(load(0, [20], [0]), after_engine_reads=lambda: calls.append(False))
    assert calls == [True]  # not for loads


def test_a_slot_image_larger_than_the_budget_is_refused_at_bind() -> None:
    cache = kv_separate(8, torch.Generator().manual_seed(1))
    config = make_config([cache], factor=2, num_slots=4)
    layout = CacheLayout.build(config, [cache.tensors(0)])
    pool = HostPool(layout, config.num_host_slots, pin=False)
    need = staging_need(layout.groups[0], 1)
    with pytest.raises(LayoutError, match=r"group 0: one offloaded block is \d+ bytes.*"
                       r"staging budget of \d+ bytes\. Raise staging_bytes to at least"):
        StagedCopier(layout, pool, staging_bytes=need - 1)
    copier = StagedCopier(layout, pool, staging_bytes=need)
    assert copier.slots_per_chunk(0) == 1
    _assert_holds_at_most(copier, need)


def test_the_default_buffer_is_no_larger_than_the_arena_needs() -> None:
    cache = kv_separate(8, torch.Generator().manual_seed(1))
    copier, pool = _setup([cache], 1, 4, DEFAULT_STAGING_BYTES)
    assert copier.slots_per_chunk(0) == pool.num_slots
    _assert_holds_at_most(copier, staging_need(copier.layout.groups[0], pool.num_slots))


@pytest.mark.parametrize("value", [0, -1, "0", "lots", 1.5, True])
def test_a_bad_staging_budget_is_refused_where_it_is_given(value: object) -> None:
    cache = kv_separate(8, torch.Generator().manual_seed(1))
    with pytest.raises(ConfigError, match="staging_bytes"):
        CudaBackend(staging_bytes=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="staging_bytes"):
        TransferWorker(make_config([cache]), staging_bytes=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config\.staging_bytes"):
        ConnectorOptions.from_extra_config({"host_memory_bytes": "1GiB",
                                            "staging_bytes": value})


def test_the_staging_budget_reaches_the_backend() -> None:
    assert CudaBackend().staging_bytes == DEFAULT_STAGING_BYTES
    assert CudaBackend(staging_bytes="16MiB").staging_bytes == 16 << 20
    opts = ConnectorOptions.from_extra_config({"host_memory_bytes": "1GiB",
                                               "staging_bytes": "256MiB"})
    assert opts.staging_bytes == 256 << 20
    assert ConnectorOptions.from_extra_config({"host_memory_bytes": "1GiB"}).staging_bytes \
        is None
    cache = kv_separate(8, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="CudaBackend"):
        TransferWorker(make_config([cache]), backend=CudaBackend(), staging_bytes="1MiB")
    # CPU caches: the CPU backend stages nothing and ignores the budget.
    worker = make_worker([cache], staging_bytes=1)
    assert not isinstance(worker.backend, CudaBackend)
    worker.shutdown()
