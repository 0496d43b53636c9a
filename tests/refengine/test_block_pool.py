"""Hand-computed scenarios for the reference engine's hybrid block pool.

Block size 4 everywhere unless said otherwise; ``toks(n, base)`` gives ``n`` distinct tokens
so that prompts with the same ``base`` share a prefix.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvoffload.config import GroupKind, GroupSpec
from kvoffload.errors import InvariantError
from kvoffload.keys import BlockHash, BlockHasher
from kvoffload.refengine.block_pool import CacheHit, HybridBlockPool

FA = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=4, name="fa")
SW8 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=8, name="sw8")
SW16 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=16, name="sw16")
MAMBA = GroupSpec(kind=GroupKind.MAMBA, block_size=4, name="mamba")

HASHER = BlockHasher(4)


def toks(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def hashes(tokens: Sequence[int]) -> list[BlockHash]:
    return HASHER.hashes(tokens)


def step(pool: HybridBlockPool, rid: str, hs: Sequence[BlockHash], num_computed: int,
         end: int, *, hit: CacheHit | None = None) -> tuple[tuple[int, ...], ...]:
    """One engine step: allocate, compute, cache. Returns the new block ids per group."""
    alloc = pool.allocate(rid, end, num_computed, hit=hit)
    assert alloc is not None
    pool.cache_blocks(rid, hs, end)
    pool.check_integrity()
    return alloc.new_block_ids


# ------------------------------------------------------------------ full attention


def test_full_attention_prefix_hit_cap_and_lru_eviction() -> None:
    pool = HybridBlockPool([FA], num_blocks=8)
    a = toks(14)
    ha = hashes(a)  # 3 full blocks; the last 2 tokens are a partial block
    assert step(pool, "a", ha, 0, 14) == ((1, 2, 3, 4),)
    assert [pool.is_cached(b) for b in (1, 2, 3, 4)] == [True, True, True, False]
    pool.free("a")
    # Initial queue 1..7; 1-4 taken; freed tail first: 4, 3, 2, 1 join the tail.
    assert pool.free_queue() == (5, 6, 7, 4, 3, 2, 1)

    b = toks(8) + toks(6, base=5000)  # shares 2 blocks with a
    hb = hashes(b)
    hit = pool.get_computed_blocks(hb, len(b))
    assert hit == CacheHit(num_tokens=8, block_ids=((1, 2),))
    # The first allocation appends the adopted hit blocks, then new ones.
    assert step(pool, "b", hb, 8, 14, hit=hit) == ((1, 2, 5, 6),)
    assert pool.block_table("b") == ((1, 2, 5, 6),)
    assert (pool.ref_count(1), pool.ref_count(2), pool.ref_count(3)) == (1, 1, 0)
    assert pool.free_queue() == (7, 4, 3)

    # A prompt exactly 3 blocks long hits 2 blocks only: the last token is recomputed.
    assert pool.get_computed_blocks(ha[:3], 12).num_tokens == 8
    assert pool.get_computed_blocks(ha[:3], 13).block_ids == ((1, 2, 3),)

    # Allocating 3 blocks takes 7, 4, 3 from the front and evicts block 3 (a's block 2).
    step(pool, "c", hashes(toks(12, base=9000)), 0, 12)
    assert pool.stats().num_evictions == 1
    assert pool.get_computed_blocks(ha, 14).num_tokens == 8
    for rid in ("b", "c"):
        pool.free(rid)
    pool.check_integrity()
    assert pool.num_free_blocks == 7


def test_tail_blocks_are_evicted_before_the_prefix() -> None:
    pool = HybridBlockPool([FA], num_blocks=5)
    ha = hashes(toks(8))
    step(pool, "a", ha, 0, 8)  # blocks 1, 2
    pool.free("a")
    step(pool, "b", hashes(toks(8, base=2000)), 0, 8)  # blocks 3, 4
    assert pool.free_queue() == (2, 1)
    step(pool, "c", hashes(toks(4, base=3000)), 0, 4)  # takes block 2: a's tail
    hit = pool.get_computed_blocks(ha, 9)
    assert hit == CacheHit(num_tokens=4, block_ids=((1,),))
    pool.free("b")
    pool.free("c")
    assert pool.free_queue() == (1, 4, 3, 2)
    # A hit on a free cached block takes it out of the free queue.
    assert step(pool, "d", ha, 4, 8, hit=hit) == ((1, 4),)
    assert pool.free_queue() == (3, 2) and pool.ref_count(1) == 1


def test_failed_allocation_changes_nothing() -> None:
    pool = HybridBlockPool([FA], num_blocks=4)
    ha = hashes(toks(12))
    step(pool, "a", ha, 0, 12)
    before = (pool.stats(), pool.free_queue())
    assert pool.allocate("b", 8, 0) is None
    assert not pool.has_request("b")
    assert (pool.stats(), pool.free_queue()) == before
    pool.free("a")
    # A hit of 3 free blocks plus 2 new blocks needs 5 > 3 free: refused, nothing pinned.
    hit = pool.get_computed_blocks(hashes(toks(16)), 16)
    assert hit.num_tokens == 12
    queue = pool.free_queue()
    assert pool.allocate("c", 20, 12, hit=hit) is None
    assert pool.free_queue() == queue and pool.ref_count(1) == 0
    pool.check_integrity()


def test_stale_hit_is_refused() -> None:
    pool = HybridBlockPool([FA], num_blocks=3)
    ha = hashes(toks(8))
    step(pool, "a", ha, 0, 8)
    pool.free("a")
    hit = pool.get_computed_blocks(ha, 9)
    assert hit.num_tokens == 8
    step(pool, "x", hashes(toks(8, base=7000)), 0, 8)  # evicts both
    pool.free("x")
    with pytest.raises(ValueError, match="stale hit"):
        pool.allocate("b", 9, 8, hit=hit)


def test_null_block_is_never_allocated() -> None:
    pool = HybridBlockPool([FA], num_blocks=4)
    assert step(pool, "a", hashes(toks(12)), 0, 12) == ((1, 2, 3),)
    assert pool.allocate("b", 1, 0) is None
    pool.free("a")
    assert 0 not in pool.free_queue()


# ------------------------------------------------------------------ sliding window


def test_window_freeing_leaves_a_null_prefix_and_hits_use_only_the_window() -> None:
    pool = HybridBlockPool([SW8], num_blocks=16)
    a = toks(25)
    ha = hashes(a)
    assert step(pool, "a", ha, 0, 24) == ((1, 2, 3, 4, 5, 6),)
    # Decode from 24: tokens before 24 - 8 + 1 = 17 are out of the window, so blocks
    # 0..3 (tokens 0..15) are freed, tail first.
    alloc = pool.allocate("a", 25, 24)
    assert alloc is not None
    assert alloc.freed_block_ids == ((4, 3, 2, 1),)
    assert alloc.new_block_ids == ((7,),)
    assert pool.block_table("a") == ((0, 0, 0, 0, 5, 6, 7),)
    assert pool.num_freed_blocks("a") == (4,)
    assert pool.free_queue()[-4:] == (4, 3, 2, 1)
    pool.check_integrity()

    # W=8 needs ceil(7/4) = 2 contiguous blocks ending at the hit.
    hit = pool.get_computed_blocks(ha, 25)
    assert hit == CacheHit(num_tokens=24, block_ids=((0, 0, 0, 0, 5, 6),))
    assert step(pool, "b", ha, 24, 25, hit=hit) == ((0, 0, 0, 0, 5, 6, 8),)
    assert pool.ref_count(5) == 2 and pool.ref_count(4) == 0

    # Without block 6 the rightmost run is positions 3-4 (block 4 is free but cached).
    pool.free("b")
    pool.free("a")
    assert pool.evict_blocks([6]) == 1
    assert pool.get_computed_blocks(ha, 25) == CacheHit(num_tokens=20,
                                                        block_ids=((0, 0, 0, 4, 5),))
    pool.check_integrity()


def test_window_lookup_falls_back_to_the_leading_run() -> None:
    pool = HybridBlockPool([SW16], num_blocks=16)  # needs ceil(15/4) = 4 blocks
    a = toks(20)
    ha = hashes(a)
    step(pool, "a", ha, 0, 12)  # 3 blocks only
    pool.free("a")
    assert pool.get_computed_blocks(ha, 20) == CacheHit(num_tokens=12,
                                                        block_ids=((1, 2, 3),))
    pool.evict_blocks([2])
    assert pool.get_computed_blocks(ha, 20) == CacheHit(num_tokens=4, block_ids=((1,),))


def test_window_needs_w_minus_one_tokens_not_w() -> None:
    """W=5, block 4: the next token attends to 4 previous ones, so one block suffices."""
    sw5 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=4, sliding_window=5)
    pool = HybridBlockPool([sw5], num_blocks=16)
    ha = hashes(toks(16))
    step(pool, "a", ha, 0, 12)  # blocks 1, 2, 3
    pool.free("a")
    pool.evict_blocks([1, 2])
    assert pool.get_computed_blocks(ha, 16) == CacheHit(num_tokens=12,
                                                        block_ids=((0, 0, 3),))
    # At 12 computed tokens, tokens < 12 - 5 + 1 = 8 are out: blocks 0 and 1 are dead.
    hit = pool.get_computed_blocks(ha, 16)
    assert step(pool, "b", ha, 12, 16, hit=hit) == ((0, 0, 3, 4),)
    assert pool.num_freed_blocks("b") == (2,)


def test_window_run_must_end_on_the_hit_alignment() -> None:
    fa8 = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=8)
    pool = HybridBlockPool([fa8, SW8], num_blocks=32)
    assert pool.hit_alignment == 8
    ha = hashes(toks(28))
    new = step(pool, "a", ha, 0, 24)
    fa_ids, sw_ids = new
    pool.free("a")
    pool.evict_blocks([sw_ids[5]])
    # SW position 4 ends at token 20, not a multiple of 8: the run must end at 16.
    hit = pool.get_computed_blocks(ha, 25)
    assert hit == CacheHit(num_tokens=16, block_ids=(fa_ids[:2], (0, 0, *sw_ids[2:4])))


def test_window_allocation_with_external_tokens_nulls_dead_hit_positions() -> None:
    pool = HybridBlockPool([SW8], num_blocks=32)
    ha = hashes(toks(40))
    step(pool, "a", ha, 0, 16)
    pool.free("a")
    hit = pool.get_computed_blocks(ha, 40)
    assert hit.num_tokens == 16 and hit.block_ids == ((0, 0, 3, 4),)
    # 16 local + 8 external tokens: at 24 only positions >= (24-7)//4 = 4 are live.
    alloc = pool.allocate("b", 30, 24, hit=hit)
    assert alloc is not None
    assert alloc.new_block_ids[0][:4] == (0, 0, 0, 0)
    assert alloc.new_block_ids == ((0, 0, 0, 0, 5, 6, 7, 8),)
    assert pool.ref_count(3) == 0 and pool.ref_count(4) == 0
    pool.check_integrity()


# --------------------------------------------------------------------------- Mamba


def test_mamba_keeps_one_state_and_caches_boundary_states() -> None:
    pool = HybridBlockPool([MAMBA], num_blocks=16)
    ha = hashes(toks(30))
    assert step(pool, "a", ha, 0, 8) == ((0, 1),)  # state at 8 in position 1
    assert pool.cache_key(1) == (0, ha[1])
    assert step(pool, "a", ha, 8, 16) == ((0, 2),)  # input state kept during the step
    assert pool.block_table("a") == ((0, 1, 0, 2),)
    alloc = pool.allocate("a", 22, 16)
    assert alloc is not None
    assert alloc.freed_block_ids == ((1,),) and alloc.new_block_ids == ((0, 3),)
    pool.cache_blocks("a", ha, 22)  # 22 is not a boundary: nothing cached
    assert not pool.is_cached(3)
    # 22 -> 24 updates the running state in place and lands on a boundary.
    alloc = pool.allocate("a", 24, 22)
    assert alloc is not None
    assert alloc.new_block_ids == ((),) and alloc.freed_block_ids == ((2,),)
    pool.cache_blocks("a", ha, 24)
    assert pool.block_table("a") == ((0, 0, 0, 0, 0, 3),)  # exactly one state
    assert pool.cache_key(3) == (0, ha[5])
    assert pool.is_cached(1) and pool.is_cached(2)  # released but still cached
    pool.check_integrity()

    # The hit is the rightmost cached state below num_tokens.
    hit = pool.get_computed_blocks(ha, 30)
    assert hit == CacheHit(num_tokens=24, block_ids=((0, 0, 0, 0, 0, 3),))
    # A prompt ending exactly on a boundary never loads that state (cap at n - 1).
    assert pool.get_computed_blocks(ha[:6], 24).num_tokens == 16
    # Adopting the hit shares the state; the next state goes to a new block.
    assert step(pool, "b", ha, 24, 30, hit=hit) == ((0, 0, 0, 0, 0, 3, 0, 4),)
    assert pool.ref_count(3) == 2


def test_mamba_with_external_tokens_does_not_adopt_the_local_state() -> None:
    pool = HybridBlockPool([MAMBA], num_blocks=16)
    ha = hashes(toks(32))
    step(pool, "a", ha, 0, 16)
    pool.free("a")
    hit = pool.get_computed_blocks(ha, 32)
    assert hit.num_tokens == 16
    # 16 local + 8 external tokens: the state to load goes to position 5, the output to 7.
    alloc = pool.allocate("b", 30, 24, hit=hit)
    assert alloc is not None
    assert alloc.new_block_ids == ((0, 0, 0, 0, 0, 2, 0, 3),)
    assert pool.ref_count(1) == 0
    pool.check_integrity()


def test_mamba_state_alignment_skips_unaligned_states() -> None:
    spec = GroupSpec(kind=GroupKind.MAMBA, block_size=4, state_alignment=8)
    pool = HybridBlockPool([spec], num_blocks=16)
    ha = hashes(toks(20))
    for start, end in ((0, 4), (4, 8), (8, 12)):
        step(pool, "a", ha, start, end)
    cached = [b for b in range(1, 16) if pool.is_cached(b)]
    assert [pool.cache_key(b) for b in cached] == [(0, ha[1])]  # only the state at 8
    assert pool.get_computed_blocks(ha, 20).num_tokens == 8


# ----------------------------------------------------------------- hybrid fixpoint


def test_fixpoint_shrinks_until_every_group_agrees() -> None:
    pool = HybridBlockPool([FA, SW8, MAMBA], num_blocks=64)
    ha = hashes(toks(36))
    ids: list[dict[int, int]] = [{}, {}, {}]
    done = 0
    for end in (8, 16, 28, 32):  # Mamba states at 8, 16, 28, 32 (none at 24)
        new = step(pool, "a", ha, done, end)
        for g, blocks in enumerate(new):
            start = len(pool.block_table("a")[g]) - len(blocks)
            ids[g].update({start + i: b for i, b in enumerate(blocks) if b})
        done = end
    pool.evict_blocks([ids[1][2], ids[1][7], ids[2][6], ids[2][7]])
    # Round 1: FA 32; SW run at positions 5-6 -> 28; Mamba at 28 -> state at 16.
    # Round 2: SW at 16 -> position 2 missing -> run 0-1 -> 8; Mamba at 8 -> state at 8.
    # Round 3: both accept 8.
    hit = pool.get_computed_blocks(ha, 36)
    assert hit == CacheHit(num_tokens=8, block_ids=(
        (ids[0][0], ids[0][1]), (ids[1][0], ids[1][1]), (0, ids[2][1])))
    pool.check_integrity()


def test_mixed_block_sizes_align_hits_to_the_lcm() -> None:
    mamba8 = GroupSpec(kind=GroupKind.MAMBA, block_size=8)
    pool = HybridBlockPool([FA, mamba8], num_blocks=32)
    assert pool.hash_block_size == 4 and pool.hit_alignment == 8
    ha = hashes(toks(24))
    for start, end in ((0, 8), (8, 16), (16, 20)):
        step(pool, "a", ha, start, end)
    hit = pool.get_computed_blocks(ha, 21)  # FA has 5 blocks (20 tokens), aligned to 16
    assert hit.num_tokens == 16
    assert len(hit.block_ids[0]) == 4 and hit.block_ids[1][0] == 0
    assert pool.cache_key(hit.block_ids[1][1]) == (1, ha[3])


# --------------------------------------------------------------- housekeeping


def test_integrity_check_catches_corruption() -> None:
    pool = HybridBlockPool([FA], num_blocks=8)
    step(pool, "a", hashes(toks(8)), 0, 8)
    pool._ref[1] += 1  # deliberate corruption
    with pytest.raises(InvariantError, match="block 1"):
        pool.check_integrity()


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = HybridBlockPool([FA], num_blocks=8)
    ha = hashes(toks(8))
    step(pool, "a", ha, 0, 8)
    assert not pool.reset_prefix_cache()
    pool.free("a")
    assert pool.reset_prefix_cache()
    assert pool.get_computed_blocks(ha, 9).num_tokens == 0
    assert pool.stats().num_cached_blocks == 0
    pool.check_integrity()


def test_misuse_raises() -> None:
    pool = HybridBlockPool([FA], num_blocks=8)
    with pytest.raises(KeyError):
        pool.free("nope")
    with pytest.raises(ValueError, match="num_computed_tokens"):
        pool.allocate("a", 4, 8)
    step(pool, "a", hashes(toks(8)), 0, 8)
    assert pool.allocate("a", 12, 8) is not None
    with pytest.raises(ValueError, match="do not cover"):
        pool.cache_blocks("a", hashes(toks(8)), 12)
    with pytest.raises(ValueError, match="first allocation"):
        pool.allocate("a", 16, 12, hit=CacheHit(num_tokens=4, block_ids=((1,),)))


def _check_hit_is_servable(pool: HybridBlockPool, hit: CacheHit,
                           hs: Sequence[BlockHash], num_tokens: int) -> None:
    assert hit.num_tokens <= max(0, num_tokens - 1)
    assert hit.num_tokens % pool.hit_alignment == 0
    for g, (spec, ids) in enumerate(zip(pool.groups, hit.block_ids, strict=True)):
        r = spec.block_size // pool.hash_block_size
        n = hit.num_tokens // spec.block_size
        assert len(ids) == n
        if spec.kind is GroupKind.FULL_ATTENTION:
            need = range(n)
        elif spec.kind is GroupKind.SLIDING_WINDOW:
            assert spec.sliding_window is not None
            need = range(max(0, hit.num_tokens - spec.sliding_window + 1) // spec.block_size,
                         n)
        else:
            need = range(max(0, n - 1), n)
        for pos in need:
            assert pool.cache_key(ids[pos]) == (g, hs[(pos + 1) * r - 1])


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_every_invariant(seed: int) -> None:
    """Many requests over a few shared prefixes, random chunking, random frees."""
    rng = random.Random(seed)
    pool = HybridBlockPool([FA, SW8, MAMBA], num_blocks=60)
    prefixes = [toks(rng.randint(4, 40), base=10_000 * i) for i in range(4)]
    running: dict[str, tuple[list[int], list[BlockHash], int]] = {}
    for i in range(300):
        if running and (rng.random() < 0.3 or len(running) > 4):
            rid = rng.choice(sorted(running))
            pool.free(rid)
            del running[rid]
        elif rng.random() < 0.5 or not running:
            tokens = rng.choice(prefixes) + toks(rng.randint(1, 20), base=100 * i)
            hs = hashes(tokens)
            hit = pool.get_computed_blocks(hs, len(tokens))
            _check_hit_is_servable(pool, hit, hs, len(tokens))
            end = min(len(tokens), hit.num_tokens + rng.randint(1, 16))
            if pool.allocate(f"r{i}", end, hit.num_tokens, hit=hit) is not None:
                pool.cache_blocks(f"r{i}", hs, end)
                running[f"r{i}"] = (tokens, hs, end)
        else:
            rid = rng.choice(sorted(running))
            tokens, hs, done = running[rid]
            if done < len(tokens):
                end = min(len(tokens), done + rng.randint(1, 12))
                if pool.allocate(rid, end, done) is not None:
                    pool.cache_blocks(rid, hs, end)
                    running[rid] = (tokens, hs, end)
                    mamba = [b for b in pool.block_table(rid)[2] if b]
                    assert len(mamba) <= 2
        pool.check_integrity()
    for rid in list(running):
        pool.free(rid)
    pool.check_integrity()
    assert pool.num_free_blocks == 59
