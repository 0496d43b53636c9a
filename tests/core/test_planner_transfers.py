"""Store and load planning: which engine blocks go where, and when store progress moves.

Stories in hybrid layouts with hand-written block tables (id 0 = null). Store progress
(docs/architecture.md, rule 7) may advance only over blocks stored, found present or
skipped as null; a failed ``prepare_store`` leaves it in place, and a window position the
engine has freed is never stored, whatever id the planner saw there before.
``block_size_factor > 1`` stories check the partial first offloaded block of a load or a
store (docs/architecture.md, "Edge cases the design answers").
"""

from __future__ import annotations

from dataclasses import replace

from planner_kit import (
    Harness,
    Moved,
    full,
    make_config,
    mamba,
    only,
    prompt,
    start_load,
    three_groups,
    window,
)

from kvoffload.planner.contract import LoadFailure, MatchResult
from kvoffload.tiers.base import LookupResult

MISS = MatchResult(0, load_async=False)


def fill_with_strangers(h: Harness, n: int, *, complete: bool) -> None:
    """Store ``n`` blocks of an unrelated request (being written unless ``complete``)."""
    stranger = h.request("stranger", prompt(4 * n, base=90_000))
    result = h.tier.prepare_store(h.keys(stranger, 0, range(n)))
    assert result is not None and len(result.keys_to_store) == n
    if complete:
        h.tier.complete_store(result.keys_to_store)


# -- store planning ------------------------------------------------------------------------


def test_store_skips_null_window_and_mamba_blocks_and_moves_past_them() -> None:
    # The engine's own prefix cache gives 24 tokens; the window group's blocks 0-1 and the
    # Mamba group's blocks 0-4 are null (outside the window / no state kept there).
    h = Harness(three_groups())
    a = h.request("a", prompt(28))
    table = [tuple(range(1, 8)), (0, 0, 13, 14, 15, 16, 17), (0, 0, 0, 0, 0, 26, 27)]
    assert h.admit(a, table, 24) == MISS  # the tier is empty
    store = only(h.step(h.sched(a, table, 24, 4)).stores)
    assert h.moved(store, a) == [
        Moved(0, tuple(range(1, 8)), 0, tuple(range(7))),
        Moved(1, (13, 14, 15, 16, 17), 2, (2, 3, 4, 5, 6)),  # nulls never stored
        Moved(2, (27,), 6, (6,)),  # the state at 28, where the step ends
    ]
    # Nothing is complete beyond block 6 until token 32: no store, and the skipped null
    # blocks are not reconsidered.
    a.append(5)
    assert h.step(h.sched(a, [(), (), ()], 28, 1, freed=(0, 3, 6))).stores == ()
    a.append(6, 7, 8)
    store = only(h.step(h.sched(a, [(8,), (18,), (28,)], 29, 3, freed=(0, 3, 6))).stores)
    assert h.moved(store, a) == [Moved(0, (8,), 7, (7,)), Moved(1, (18,), 7, (7,)),
                                 Moved(2, (28,), 7, (7,))]


def test_failed_prepare_store_is_retried_next_step_without_advancing() -> None:
    h = Harness(three_groups(slots=6))
    fill_with_strangers(h, 6, complete=False)  # every slot being written: none evictable
    a = h.request("a", prompt(8))
    table = [(1, 2), (11, 12), (21, 22)]
    h.admit(a, table)
    assert h.step(h.sched(a, table, 0, 8)).stores == ()
    assert h.planner.stats.store_retries == 1
    a.append(1)
    assert h.step(h.sched(a, [(3,), (13,), (23,)], 8, 1, freed=(0, 0, 1))).stores == ()
    assert h.planner.stats.store_retries == 2
    # The strangers' writes land: their slots become evictable, the retry goes through
    # and still covers blocks 0-1 (Mamba block 0 has been freed meanwhile: skipped).
    h.tier.complete_store(list(h.tier))
    a.append(2)
    store = only(h.step(h.sched(a, [(), (), ()], 9, 1, freed=(0, 0, 1))).stores)
    assert h.moved(store, a) == [Moved(0, (1, 2), 0, (0, 1)), Moved(1, (11, 12), 0, (0, 1)),
                                 Moved(2, (22,), 1, (1,))]


def test_stale_window_ids_after_a_failed_prepare_store_are_never_stored() -> None:
    # Brief 4.7, test_stale_sliding_window_block_after_prepare_store_failure: the store of
    # a 16-token prefill fails; the next step the engine frees window positions 0-1 (ids
    # 11, 12) and hands those very ids back to the same request for positions 4-5. The
    # retried store must take window blocks 2-5 only, never "positions 0-1 = ids 11, 12".
    h = Harness(make_config(full(), window(8), slots=12))
    fill_with_strangers(h, 12, complete=False)
    a = h.request("a", prompt(24))
    table = [(1, 2, 3, 4), (11, 12, 13, 14)]
    h.admit(a, table)
    assert h.step(h.sched(a, table, 0, 16)).stores == ()
    h.tier.complete_store(list(h.tier))
    store = only(h.step(h.sched(a, [(5, 6), (11, 12)], 16, 8, freed=(0, 2))).stores)
    assert h.moved(store, a) == [
        Moved(0, (1, 2, 3, 4, 5, 6), 0, (0, 1, 2, 3, 4, 5)),
        Moved(1, (13, 14, 11, 12), 2, (2, 3, 4, 5)),
    ]


def test_present_blocks_advance_store_progress() -> None:
    # b shares a's stored prompt but the engine declines the load (e.g. it prefers to
    # recompute). b finds every key present: no job, progress moves on. After a's keys
    # are evicted, b's next store covers only its new block, not the old ones again.
    h = Harness(three_groups(slots=12))
    tokens = prompt(16)
    a = h.request("a", tokens)
    h.put_all(a, 4)
    b = h.request("b", tokens)
    assert h.lookup(b) == MatchResult(12, load_async=True)
    table = [(1, 2, 3, 4), (11, 12, 13, 14), (21, 22, 23, 24)]
    h.alloc(b, table, 0)
    assert h.step(h.sched(b, table, 0, 16)).stores == ()
    fill_with_strangers(h, 12, complete=True)  # evicts all of a's (= b's) keys
    assert h.status(b, 0, range(4)) == [LookupResult.MISS] * 4
    b.append(*prompt(4, base=50))
    store = only(h.step(h.sched(b, [(5,), (15,), (25,)], 16, 4, freed=(0, 0, 3))).stores)
    assert h.moved(store, b) == [Moved(0, (5,), 4, (4,)), Moved(1, (15,), 4, (4,)),
                                 Moved(2, (25,), 4, (4,))]


def test_groups_with_different_block_sizes_store_each_block_when_it_completes() -> None:
    # Block sizes 12 and 16 (mixed block sizes per group): each group stores its own
    # blocks at its own boundaries, whatever the other group does in that step.
    h = Harness(make_config(full(12, "a"), full(16, "b")))
    a = h.request("a", prompt(48))
    h.admit(a, [(), ()])
    stored = []
    ids = {0: iter(range(1, 10)), 1: iter(range(11, 20))}
    for computed in range(0, 48, 4):
        new = [(next(ids[g]),) if computed % bs == 0 else () for g, bs in ((0, 12), (1, 16))]
        plan = h.step(h.sched(a, new, computed, 4))
        stored.append([(m.group, m.key_indices) for job in plan.stores
                       for m in h.moved(job, a)])
        for job in plan.stores:
            h.complete(job.job_id)
    assert stored == [[], [], [(0, (0,))], [(1, (0,))], [], [(0, (1,))],
                      [], [(1, (1,))], [(0, (2,))], [], [], [(0, (3,)), (1, (2,))]]


def test_finer_window_blocks_store_only_what_an_aligned_hit_can_use() -> None:
    # Full attention in 16-token blocks, a window of 8 tokens in 4-token blocks: hits are
    # multiples of 16, and each needs window blocks 2-3 of its 16 tokens. Blocks 0-1 of
    # every 16 can serve no hit and are not stored (the alignment skip of window groups).
    h = Harness(make_config(full(16), window(8)))
    a = h.request("a", prompt(32))
    table = [(1, 2), tuple(range(11, 19))]
    h.admit(a, table)
    store = only(h.step(h.sched(a, table, 0, 32)).stores)
    # Blocks 2-3 and 6-7 are not adjacent: one transfer per run, so each transfer's
    # first_block_index + i names the position of its i-th block.
    assert h.moved(store, a) == [Moved(0, (1, 2), 0, (0, 1)),
                                 Moved(1, (13, 14), 2, (2, 3)),
                                 Moved(1, (17, 18), 6, (6, 7))]


def test_mamba_states_are_stored_only_at_checkpoints() -> None:
    # States checkpointed every 8 tokens: of the 4 Mamba blocks of a 16-token prefill
    # in 4-token chunks only those ending at 8 and 16 can ever serve a hit.
    h = Harness(make_config(full(), mamba(alignment=8)))
    a = h.request("a", prompt(16))
    table = [(1, 2, 3, 4), (11, 12, 13, 14)]
    h.admit(a, table)
    moved = []
    for chunk in range(4):
        new = [(1 + chunk,), (11 + chunk,)]
        for job in h.step(h.sched(a, new, 4 * chunk, 4)).stores:
            moved += h.moved(job, a)
    assert moved == [Moved(0, (1,), 0, (0,)), Moved(0, (2,), 1, (1,)),
                     Moved(1, (12,), 1, (1,)), Moved(0, (3,), 2, (2,)),
                     Moved(0, (4,), 3, (3,)), Moved(1, (14,), 3, (3,))]


def test_a_mamba_state_a_step_crossed_is_never_stored() -> None:
    # One 16-token step crosses the state boundary at 8 without ever producing that
    # state (the engine writes a state only where a step ends): only the state at 16,
    # where the step ends, may be stored -- the block at 8 holds no such state.
    h = Harness(make_config(full(), mamba(alignment=8)))
    a = h.request("a", prompt(16))
    table = [(1, 2, 3, 4), (11, 12, 13, 14)]
    h.admit(a, table)
    store = only(h.step(h.sched(a, table, 0, 16)).stores)
    assert h.moved(store, a) == [Moved(0, (1, 2, 3, 4), 0, (0, 1, 2, 3)),
                                 Moved(1, (14,), 3, (3,))]


def test_a_state_the_engine_checkpointed_inside_a_step_is_stored() -> None:
    # The same 16-token step, but the engine reports that it also left the state after
    # token 8 in its block (vLLM's Mamba2 writes in-chunk checkpoints): that state is
    # stored beside the one at the step's end. A claimed end off the alignment (4) or
    # past the step (20) is not a checkpoint and stores nothing.
    h = Harness(make_config(full(), mamba(alignment=8)))
    a = h.request("a", prompt(16))
    table = [(1, 2, 3, 4), (11, 12, 13, 14)]
    h.admit(a, table)
    sched = replace(h.sched(a, table, 0, 16), state_ends=(4, 8, 20))
    store = only(h.step(sched).stores)
    assert h.moved(store, a) == [Moved(0, (1, 2, 3, 4), 0, (0, 1, 2, 3)),
                                 Moved(1, (12,), 1, (1,)), Moved(1, (14,), 3, (3,))]


def test_store_progress_jumps_past_a_loaded_prefix() -> None:
    # After a load, the loaded blocks are not stored again, even once they have been
    # evicted meanwhile: store progress starts at the end of the hit (as in vLLM's
    # offloading connector).
    h = Harness(three_groups(slots=18))
    a = h.request("a", prompt(21))
    h.put_all(a, 5)
    assert h.lookup(a) == MatchResult(20, load_async=True)
    table = [tuple(range(1, 7)), (0, 12, 13, 14, 15, 16), (0, 0, 0, 0, 25, 26)]
    h.alloc(a, table, 20)
    h.complete(only(h.step().loads).job_id)
    fill_with_strangers(h, 18, complete=True)  # the tier forgets a's blocks
    a.append(*prompt(3, base=60))
    store = only(h.step(h.sched(a, table, 20, 4, freed=(0, 1, 4))).stores)
    assert h.moved(store, a) == [Moved(0, (6,), 5, (5,)), Moved(1, (16,), 5, (5,)),
                                 Moved(2, (26,), 5, (5,))]


# -- loads ---------------------------------------------------------------------------------


def test_a_key_evicted_between_lookup_and_allocation_fails_the_load_to_recompute() -> None:
    h = Harness(three_groups(slots=18))
    a = h.request("a", prompt(25))
    h.put_all(a, 6)
    assert h.lookup(a) == MatchResult(24, load_async=True)
    # The tier is full. The lookup touched what the hit needs, so 8 new blocks evict the
    # 7 keys it does not need (window 0-1, Mamba 0-4) and then Mamba state 5.
    fill_with_strangers(h, 8, complete=True)
    assert h.status(a, 1, range(6)) == [LookupResult.MISS] * 2 + [LookupResult.HIT] * 4
    assert h.status(a, 2, range(6)) == [LookupResult.MISS] * 6
    table = [tuple(range(1, 8)), (0, 0, 11, 12, 13, 14, 15), (0, 0, 0, 0, 0, 21, 22)]
    h.alloc(a, table, 24)
    assert h.step().loads == ()
    outcome = h.report()
    assert outcome.finished_loads == ("a",)
    assert outcome.failed_loads == (LoadFailure("a", 0),)
    assert h.tier.usage().pinned_slots == 0


# -- block_size_factor > 1 ----------------------------------------------------------------


def test_factor_2_load_starts_mid_offloaded_block() -> None:
    # Engine blocks of 4, offloaded blocks of 8; a window of 10 tokens (2 offloaded blocks).
    # The device holds tokens 0-4, half of offloaded block 0: the load skips sub-block 0.
    h = Harness(make_config(full(), window(10), factor=2))
    a = h.request("a", prompt(33))  # cap 32 = 4 offloaded blocks
    h.put_all(a, 4)
    assert h.lookup(a, 4) == MatchResult(28, load_async=True)
    h.alloc(a, [tuple(range(1, 10)), (0, 0, 0, 0, 0, 16, 17, 18, 19)], 28)
    load = only(h.step().loads)
    assert h.moved(load, a) == [
        Moved(0, (2, 3, 4, 5, 6, 7, 8), 1, (0, 1, 2, 3)),
        # The window needs tokens 22-32: engine blocks 5-7, entering key 2 at sub-block 1.
        Moved(1, (16, 17, 18), 5, (2, 3)),
    ]


def test_factor_2_store_of_a_block_straddling_the_window_edge() -> None:
    # Window of 4 tokens, offloaded blocks of 8 (2 engine blocks). The engine's prefix hit
    # of 16 tokens left window positions 0-2 null: offloaded block 1 is [null, live].
    # A hit at 16 needs only tokens 12-16 (position 3): block 1 is stored from its live
    # half, and a later load of it fills only that half.
    h = Harness(make_config(full(), window(4), factor=2))
    tokens = prompt(24)
    a = h.request("a", tokens)
    table = [(1, 2, 3, 4, 5, 6), (0, 0, 0, 14, 15, 16)]
    assert h.admit(a, table, 16) == MISS
    store = only(h.step(h.sched(a, table, 16, 8)).stores)
    assert h.moved(store, a) == [Moved(0, (1, 2, 3, 4, 5, 6), 0, (0, 1, 2)),
                                 Moved(1, (14, 15, 16), 3, (1, 2))]
    h.complete(store.job_id)
    b = h.request("b", [*tokens[:16], 99])
    assert h.lookup(b) == MatchResult(16, load_async=True)
    h.alloc(b, [(31, 32, 33, 34, 35), (0, 0, 0, 44, 45)], 16)
    load = only(h.step().loads)
    assert h.moved(load, b) == [Moved(0, (31, 32, 33, 34), 0, (0, 1)),
                                Moved(1, (44,), 3, (1,))]


def test_factor_2_partial_block_a_hit_needs_whole_is_not_stored() -> None:
    # Window of 12 tokens (2 offloaded blocks): a hit at 8 needs all of tokens 0-8, so
    # offloaded block 0 with its first half null is useless and skipped.
    h = Harness(make_config(full(), window(12), factor=2))
    a = h.request("a", prompt(24))
    table = [(1, 2, 3, 4, 5, 6), (0, 12, 13, 14, 15, 16)]
    h.admit(a, table)
    store = only(h.step(h.sched(a, table, 4, 20)).stores)
    assert h.moved(store, a) == [Moved(0, (1, 2, 3, 4, 5, 6), 0, (0, 1, 2)),
                                 Moved(1, (13, 14, 15, 16), 2, (1, 2))]


def test_factor_2_mamba_stores_and_loads_the_last_state_of_an_offloaded_block() -> None:
    h = Harness(make_config(full(), mamba(), factor=2))
    tokens = prompt(16)
    a = h.request("a", tokens)
    table = [(1, 2, 3, 4), (11, 12, 13, 14)]
    h.admit(a, table)
    first = only(h.step(h.sched(a, [(1, 2), (11, 12)], 0, 8)).stores)
    second = only(h.step(h.sched(a, [(3, 4), (13, 14)], 8, 8)).stores)
    assert h.moved(first, a) + h.moved(second, a) == [
        Moved(0, (1, 2), 0, (0,)), Moved(1, (12,), 1, (0,)),  # state after token 8
        Moved(0, (3, 4), 2, (1,)), Moved(1, (14,), 3, (1,))]  # state after token 16
    h.complete(first.job_id, second.job_id)
    b = h.request("b", [*tokens, 1])
    assert h.lookup(b) == MatchResult(16, load_async=True)
    h.alloc(b, [(21, 22, 23, 24, 25), (0, 0, 0, 34, 35)], 16)
    load = only(h.step().loads)
    assert h.moved(load, b) == [Moved(0, (21, 22, 23, 24), 0, (0, 1)),
                                Moved(1, (34,), 3, (1,))]


def test_a_request_whose_load_failed_is_offered_no_load_again() -> None:
    """The engine recomputes a failed load; offering the same blocks again could fail
    the same way forever, so the planner answers 0 for the request from then on, though
    its blocks are still readable. Another request sharing the prefix still hits."""
    h = Harness(three_groups(slots=40))
    a, load = start_load(h)
    outcome = h.complete(failed=(load.job_id,))
    assert outcome.failed_loads == (LoadFailure("a", 0),)
    assert h.status(a, 0, range(6)) == [LookupResult.HIT] * 6
    assert h.lookup(a) == MatchResult(0)
    b = h.request("b", prompt(25))
    assert h.lookup(b) == MatchResult(24, load_async=True)


def test_an_abandoned_load_and_a_refused_request_are_offered_no_load_again() -> None:
    h = Harness(three_groups(slots=40))
    a, load = start_load(h)
    assert h.planner.abandon_load(a) == load.job_id
    assert h.lookup(a) == MatchResult(0)
    c = h.request("c", prompt(25))
    assert h.lookup(c) == MatchResult(24, load_async=True)
    h.planner.refuse_loads(c)  # the engine found a load's bytes wrong
    assert h.lookup(c) == MatchResult(0)
