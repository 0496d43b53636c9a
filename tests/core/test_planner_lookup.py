"""Planner lookups, story by story: what a request may load, and what it then loads.

Each story sets up the host tier by hand (which offloaded blocks of which group are
readable), asks ``get_num_new_matched_tokens`` as an engine would, and, where a hit is
taken, checks the exact load the planner plans: engine block ids, the first logical index
and which of the request's keys the slots hold. Unless a story says otherwise, groups use
4-token engine blocks, hash blocks of 4 tokens and ``block_size_factor`` 1, so offloaded
block ``k`` covers tokens ``[4k, 4k + 4)``.

The edge cases are those of docs/architecture.md, "Edge cases the design answers".
"""

from __future__ import annotations

import dataclasses

import pytest
from planner_kit import (
    Harness,
    Moved,
    full,
    make_config,
    mamba,
    only,
    prompt,
    three_groups,
    window,
)

from kvoffload.planner.contract import MatchResult
from kvoffload.tiers.base import LookupResult

HIT = LookupResult.HIT


def hit(tokens: int) -> MatchResult:
    return MatchResult(tokens, load_async=True)


MISS = MatchResult(0, load_async=False)
DEFER = MatchResult(None)


# -- per-group rules --------------------------------------------------------------------


def test_full_attention_loads_the_readable_prefix_after_the_device_prefix() -> None:
    h = Harness(make_config(full()))
    tokens = prompt(24)  # 6 blocks
    a = h.request("a", tokens)
    h.put(a, 0, [1, 2, 4, 5])  # block 0 was evicted, block 3 never stored
    # From token 0 the prefix breaks at once: block 0 is missing.
    assert h.lookup(a) == MISS
    # With block 0 on the device, blocks 1-2 extend the hit; 4-5 sit past the gap.
    b = h.request("b", tokens)
    assert h.lookup(b, 4) == hit(8)
    h.alloc(b, [(1, 2, 3, 4, 5, 6)], 8)
    load = only(h.step().loads)
    assert h.moved(load, b) == [Moved(0, (2, 3), 1, (1, 2))]


def test_full_attention_only_layout_may_hit_every_token() -> None:
    # No window or Mamba group: no num_tokens - 1 cap (the engine recomputes the last
    # token itself, as it does for its own full prefix hit).
    h = Harness(make_config(full()))
    a = h.request("a", prompt(24))
    h.put_all(a, 6)
    assert h.lookup(a) == hit(24)


def test_window_group_takes_the_rightmost_window_and_loads_only_it() -> None:
    # Full attention + a window of 8 tokens (2 blocks). The window group's blocks 2-3 and
    # 6-7 are readable, 8 is not, 9 is: the rightmost run of 2 ends at block 8.
    h = Harness(make_config(full(), window(8)))
    a = h.request("a", prompt(41))  # cap 40 = 10 blocks
    h.put(a, 0, range(10))
    h.put(a, 1, [2, 3, 6, 7, 9])
    assert h.lookup(a) == hit(32)
    full_ids = tuple(range(1, 12))
    swa_ids = (0, 0, 0, 0, 0, 0, 21, 22, 23, 24, 25)  # out of window at 32: null
    h.alloc(a, [full_ids, swa_ids], 32)
    load = only(h.step().loads)
    assert h.moved(load, a) == [
        Moved(0, tuple(range(1, 9)), 0, tuple(range(8))),  # every block before 32
        Moved(1, (21, 22), 6, (6, 7)),  # only the window: tokens 24-32
    ]


def test_window_load_covers_only_the_window_even_if_every_position_has_a_block() -> None:
    # An engine that does not null out-of-window positions still gets a window-only load.
    h = Harness(make_config(full(), window(8)))
    a = h.request("a", prompt(25))
    h.put_all(a, 6)
    assert h.lookup(a) == hit(24)
    h.alloc(a, [tuple(range(1, 8)), tuple(range(11, 18))], 24)
    load = only(h.step().loads)
    assert h.moved(load, a)[1] == Moved(1, (15, 16), 4, (4, 5))


def test_window_group_falls_back_to_the_leading_run_next_to_the_device_prefix() -> None:
    # Window of 16 tokens (4 blocks). The device holds tokens 0-24; blocks 6-7 readable.
    # The window at 32 needs blocks 4-7: the device has 4-5, the tier 6-7.
    h = Harness(make_config(full(), window(16)))
    tokens = prompt(37)  # cap 36 -> 9 blocks
    a = h.request("a", tokens)
    h.put(a, 0, [4, 5, 6, 7, 8])
    h.put(a, 1, [6, 7])
    assert h.lookup(a, 24) == hit(8)
    h.alloc(a, [tuple(range(1, 11)), (0, 0, 13, 14, 15, 16, 17, 18, 19, 20)], 8)
    load = only(h.step().loads)
    assert h.moved(load, a) == [Moved(0, (7, 8), 6, (6, 7)), Moved(1, (17, 18), 6, (6, 7))]
    # With only 16 tokens on the device, the same window needs blocks 4-5 from the tier,
    # which lacks them: no hit at all (full attention alone would reach 36).
    b = h.request("b", tokens)
    assert h.lookup(b, 16) == MISS


def test_mamba_group_loads_one_state_at_an_aligned_point() -> None:
    # Mamba states checkpointed every 8 tokens (2 blocks): the hit must be a multiple of 8.
    # States at block ends 16, 24 and 28 are readable; 28 is not a checkpoint, 32 missing.
    h = Harness(make_config(full(), mamba(alignment=8)))
    a = h.request("a", prompt(37))  # cap 36 -> 32 aligned
    h.put(a, 0, range(9))
    h.put(a, 1, [3, 5, 6])
    assert h.lookup(a) == hit(24)
    h.alloc(a, [tuple(range(1, 11)), (0, 0, 0, 0, 0, 31, 32, 33, 34, 35)], 24)
    load = only(h.step().loads)
    assert h.moved(load, a) == [
        Moved(0, (1, 2, 3, 4, 5, 6), 0, (0, 1, 2, 3, 4, 5)),
        Moved(1, (31,), 5, (5,)),  # the single state after token 24
    ]


def test_fixpoint_smaller_window_shrinks_the_hit_and_the_larger_one_is_rechecked() -> None:
    # Full attention, window A of 12 tokens (3 blocks), window B of 4 tokens (1 block).
    # A accepts 40 (blocks 7-9); B only has blocks 2 and 5, so it pulls the hit to 24;
    # A, re-checked at 24, lacks block 3 and falls to 12; B accepts 12 (block 2).
    h = Harness(make_config(full(), window(12, name="a"), window(4, name="b")))
    a = h.request("a", prompt(41))
    h.put(a, 0, range(10))
    h.put(a, 1, [0, 1, 2, 4, 5, 7, 8, 9])
    h.put(a, 2, [2, 5])
    assert h.lookup(a) == hit(12)
    h.alloc(a, [tuple(range(1, 12)), tuple(range(21, 32)), (0, 0, *range(43, 52))], 12)
    load = only(h.step().loads)
    assert h.moved(load, a) == [
        Moved(0, (1, 2, 3), 0, (0, 1, 2)),
        Moved(1, (21, 22, 23), 0, (0, 1, 2)),
        Moved(2, (43,), 2, (2,)),
    ]


# -- the num_tokens - 1 cap ---------------------------------------------------------------


def test_window_hit_is_capped_at_num_tokens_minus_one() -> None:
    # The tier has the whole 32-token prompt, but the last token is recomputed, so the
    # window must be valid at 31 -> aligned 28; it covers tokens 20-28 (blocks 5-6).
    h = Harness(make_config(full(), window(8)))
    a = h.request("a", prompt(32))
    h.put_all(a, 8)
    assert h.lookup(a) == hit(28)
    h.alloc(a, [tuple(range(1, 9)), (0, 0, 0, 0, 0, 16, 17, 18)], 28)
    load = only(h.step().loads)
    assert h.moved(load, a) == [Moved(0, tuple(range(1, 8)), 0, tuple(range(7))),
                                Moved(1, (16, 17), 5, (5, 6))]


def test_mamba_state_at_a_prompt_ending_on_a_boundary_is_not_loaded() -> None:
    # States after tokens 4, 8, ..., 32 are stored. A 32-token prompt must recompute its
    # last token, so it loads the state after token 28, never the one after 32.
    h = Harness(make_config(full(), mamba()))
    a = h.request("a", prompt(32))
    h.put_all(a, 8)
    assert h.lookup(a) == hit(28)
    h.alloc(a, [tuple(range(1, 9)), (0, 0, 0, 0, 0, 0, 27, 28)], 28)
    load = only(h.step().loads)
    assert h.moved(load, a)[1] == Moved(1, (27,), 6, (6,))
    # One token more and the boundary state is exactly what the hit needs.
    b = h.request("b", prompt(33))
    assert h.lookup(b) == hit(32)
    h.alloc(b, [tuple(range(31, 40)), (0, 0, 0, 0, 0, 0, 0, 48, 49)], 32)
    load = only(h.step().loads)
    assert h.moved(load, b)[1] == Moved(1, (48,), 7, (7,))


# -- alignment across groups with different block sizes --------------------------------


def test_groups_with_block_sizes_12_and_16_hit_at_multiples_of_48() -> None:
    h = Harness(make_config(full(12, "a"), full(16, "b")))
    a = h.request("a", prompt(49))
    # 49 tokens give 4 keys of 12 tokens and 3 keys of 16 tokens.
    h.put(a, 0, range(4))
    h.put(a, 1, range(3))
    assert h.lookup(a) == hit(48)
    h.alloc(a, [(1, 2, 3, 4, 5), (11, 12, 13, 14)], 48)
    load = only(h.step().loads)
    assert h.moved(load, a) == [Moved(0, (1, 2, 3, 4), 0, (0, 1, 2, 3)),
                                Moved(1, (11, 12, 13), 0, (0, 1, 2))]
    # Group b missing its block ending at 48: 36 (a) and 32 (b) are not common ends.
    c = h.request("c", prompt(49, base=5000))
    h.put(c, 0, range(4))
    h.put(c, 1, range(2))
    assert h.lookup(c) == MISS


def test_window_group_with_finer_blocks_hits_only_at_the_coarser_alignment() -> None:
    # Full attention in 16-token blocks, a window of 8 tokens in 4-token blocks: hits are
    # multiples of 16; the window group needs its 2 blocks right before such an end.
    h = Harness(make_config(full(16), window(8)))
    a = h.request("a", prompt(41))  # cap 40 -> 32
    h.put(a, 0, [0, 1])
    h.put(a, 1, [6, 7])
    assert h.lookup(a) == hit(32)
    h.alloc(a, [(1, 2, 3), (0, 0, 0, 0, 0, 0, 17, 18, 19, 20, 21)], 32)
    load = only(h.step().loads)
    assert h.moved(load, a) == [Moved(0, (1, 2), 0, (0, 1)), Moved(1, (17, 18), 6, (6, 7))]
    # Window blocks 5-6 would make a window ending at 28, which is not a multiple of 16.
    b = h.request("b", prompt(41, base=5000))
    h.put(b, 0, [0, 1])
    h.put(b, 1, [5, 6])
    assert h.lookup(b) == MISS


# -- deferral ("ask again later") --------------------------------------------------------


def test_lookup_defers_on_a_key_being_written_and_the_wait_is_bounded() -> None:
    # Request a stores its 24-token prompt in two jobs: blocks 0-3 land, 4-5 stay in
    # flight. Request b shares the prompt: 16 tokens are readable now, 24 once a's second
    # store lands, so b is told to ask again -- but only max_deferred (3) times in a row.
    h = Harness(three_groups(max_deferred=3))
    tokens = prompt(24)
    a = h.request("a", tokens)
    assert h.lookup(a) == MISS
    table = [tuple(range(1, 7)), tuple(range(11, 17)), tuple(range(21, 27))]
    h.alloc(a, table, 0)
    first = only(h.step(h.sched(a, table, 0, 16)).stores)
    h.complete(first.job_id)
    second = only(h.step(h.sched(a, [(), (), ()], 16, 8)).stores)
    assert h.status(a, 0, range(6)) == [HIT] * 4 + [LookupResult.PENDING] * 2

    b = h.request("b", [*tokens, 7, 7, 7, 7])  # 28 tokens: cap 27 -> 24
    assert [h.lookup(b) for _ in range(3)] == [DEFER] * 3
    assert h.lookup(b) == hit(16)  # timed out: what is readable now
    assert h.planner.stats.deferral_timeouts == 1

    # A request that defers once and then sees the write land gets the whole hit.
    c = h.request("c", [*tokens, 8, 8, 8, 8])
    assert h.lookup(c) == DEFER
    h.complete(second.job_id)
    assert h.lookup(c) == hit(24)


def test_min_deferral_keeps_a_fast_stepping_engine_waiting_for_the_write() -> None:
    # The same wait with min_deferral_s=0.5: an engine whose steps take microseconds
    # gets "ask again" past max_deferred (3) answers until half a second has passed
    # (on the planner's clock, a fake one here: no step takes any time unless told).
    clock = [100.0]
    h = Harness(dataclasses.replace(three_groups(max_deferred=3), min_deferral_s=0.5),
                clock=lambda: clock[0])
    tokens = prompt(24)
    a = h.request("a", tokens)
    assert h.lookup(a) == MISS
    table = [tuple(range(1, 7)), tuple(range(11, 17)), tuple(range(21, 27))]
    h.alloc(a, table, 0)
    store = only(h.step(h.sched(a, table, 0, 24)).stores)  # in flight: keys PENDING
    b = h.request("b", [*tokens, 7, 7, 7, 7])
    assert [h.lookup(b) for _ in range(10)] == [DEFER] * 10  # well past 3 steps
    clock[0] += 0.49
    assert h.lookup(b) == DEFER
    clock[0] += 0.02  # 0.51 s since the first deferral: settle for what is readable
    assert h.lookup(b) == MISS
    assert h.planner.stats.deferral_timeouts == 1
    h.complete(store.job_id)


def test_a_pending_key_in_a_window_a_miss_already_broke_does_not_defer() -> None:
    # Window of 2 blocks: block 5 is being written, block 4 is missing. Even once 5
    # lands, no window can end at 6 or 5, so waiting cannot help: the lookup answers at
    # once with the window at 4 (vLLM #56486).
    h = Harness(make_config(full(), window(8)))
    a = h.request("a", prompt(25))  # cap 24 = 6 blocks
    h.put(a, 0, range(6))
    h.put(a, 1, range(4))
    assert h.tier.prepare_store([h.key(a, 1, 5)]) is not None  # being written
    assert h.lookup(a) == hit(16)
    assert h.planner.stats.deferred_lookups == 0
    # Whereas with block 4 readable, the pending block 5 is worth waiting for.
    b = h.request("b", prompt(25))
    h.put(b, 1, [4])
    assert h.lookup(b) == DEFER


# -- concurrent loads of one prefix -------------------------------------------------------


def test_two_requests_load_one_prefix_concurrently_with_exact_ref_counts() -> None:
    # vLLM's offloading connector defers the second request until the first load lands
    # (a convoy, vLLM #44294). kvoffload lets both load: each pins the keys once.
    h = Harness(three_groups())
    tokens = prompt(24)
    h.put_all(h.request("writer", tokens), 6)
    b = h.request("b", [*tokens, 1])
    c = h.request("c", [*tokens, 2])
    assert h.lookup(b) == hit(24)
    assert h.lookup(c) == hit(24)  # not deferred
    h.alloc(b, [tuple(range(1, 8)), (0, 0, 11, 12, 13, 14, 15), (0, 0, 0, 0, 0, 21, 22)], 24)
    h.alloc(c, [tuple(range(31, 38)), (0, 0, 41, 42, 43, 44, 45), (0, 0, 0, 0, 0, 51, 52)],
            24)
    loads = h.step().loads
    assert [job.request_id for job in loads] == ["b", "c"]
    assert h.moved(loads[0], b) == [Moved(0, (1, 2, 3, 4, 5, 6), 0, (0, 1, 2, 3, 4, 5)),
                                    Moved(1, (11, 12, 13, 14), 2, (2, 3, 4, 5)),
                                    Moved(2, (21,), 5, (5,))]
    assert h.moved(loads[1], c) == [Moved(0, (31, 32, 33, 34, 35, 36), 0, (0, 1, 2, 3, 4, 5)),
                                    Moved(1, (41, 42, 43, 44), 2, (2, 3, 4, 5)),
                                    Moved(2, (51,), 5, (5,))]
    assert h.ref(b, 0, range(6)) == [2] * 6
    assert h.ref(b, 1, range(6)) == [0, 0, 2, 2, 2, 2]
    assert h.ref(b, 2, range(6)) == [0] * 5 + [2]
    outcome = h.complete(loads[0].job_id)
    assert outcome.finished_loads == ("b",) and outcome.failed_loads == ()
    assert h.ref(b, 0, range(6)) == [1] * 6
    assert h.ref(b, 1, range(6)) == [0, 0, 1, 1, 1, 1]
    h.complete(loads[1].job_id)
    assert h.ref(b, 0, range(6)) == [0] * 6
    assert h.tier.usage().pinned_slots == 0


# -- touch --------------------------------------------------------------------------------


@pytest.mark.parametrize("on_device", [0, 8])
def test_touch_keeps_every_full_attention_block_but_only_the_hit_window_warm(
        on_device: int) -> None:
    # Full attention + a window of 2 blocks. A 3-block hit (device prefix included)
    # touches 3 full-attention keys but only window blocks 1-2: block 0 cannot serve any
    # hit this prefix may get again.
    h = Harness(make_config(full(), window(8), slots=6))
    a = h.request("a", prompt(13))
    h.put(a, 1, range(3))  # window keys first: the oldest in the tier
    h.put(a, 0, range(3))
    w0, w1, w2 = h.keys(a, 1, range(3))
    f0, f1, f2 = h.keys(a, 0, range(3))
    assert list(h.tier) == [w0, w1, w2, f0, f1, f2]
    assert h.lookup(a, on_device) == hit(12 - on_device)
    # Touched keys move to the recent end, the first one given ending most recent.
    assert list(h.tier) == [w0, w2, w1, f2, f1, f0]
    # So a full tier gives up window block 0 first.
    stranger = h.request("x", prompt(4, base=9000))
    result = h.tier.prepare_store([h.key(stranger, 0, 0)])
    assert result is not None and result.evicted == (w0,)


def test_touch_at_finish_refreshes_every_window_and_mamba_block_stored() -> None:
    # Full attention in 16-token blocks makes every hit a multiple of 16. The window
    # group (4-token blocks, 2-block window) stores only blocks 2-3 of each 16 tokens and
    # the Mamba group only the state at each 16. A store inserts its keys in key order;
    # when the request finishes, the touch of its whole prefix keeps exactly those warm,
    # first key most recent.
    h = Harness(make_config(full(16), window(8), mamba()))
    a = h.request("a", prompt(32))
    table = [(1, 2), tuple(range(11, 19)), tuple(range(21, 29))]
    h.admit(a, table)  # nothing in the tier: the first hit is 0 blocks
    h.step(h.sched(a, table, 0, 16))  # two chunks: a Mamba state exists at 16 and 32
    h.step(h.sched(a, [(), (), ()], 16, 16))
    f0, f1 = h.keys(a, 0, range(2))
    w2, w3, w6, w7 = h.keys(a, 1, [2, 3, 6, 7])
    m3, m7 = h.keys(a, 2, [3, 7])
    assert list(h.tier) == [f0, w2, w3, m3, f1, w6, w7, m7]
    h.planner.request_finished(a)
    assert list(h.tier) == [m7, m3, w7, w6, w3, w2, f1, f0]
