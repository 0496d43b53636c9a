"""Per-request controls (``RequestControls``): caps on what a request stores and loads.

An engine adapter sets them from the request (the vLLM connector from
``kv_transfer_params``); the planner then never stores past ``max_store_tokens`` and never
loads more than ``max_load_tokens`` beyond the engine's own hit. Groups use 4-token blocks.
"""

from __future__ import annotations

import pytest
from planner_kit import Harness, full, make_config, mamba, only, prompt, three_groups

from kvoffload.planner.contract import MatchResult, RequestControls
from kvoffload.tiers.base import LookupResult

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def stored_blocks(h: Harness, tokens: int, *, controls: RequestControls) -> list[LookupResult]:
    """Run one 24-token request with ``controls`` through one prefill step of ``tokens``
    tokens on a full-attention layout; return what the tier holds of its 6 blocks."""
    a = h.request("a", prompt(24))
    h.planner.set_controls(a, controls)
    h.admit(a, [tuple(range(1, 7))])
    plan = h.step(h.sched(a, [tuple(range(1, 7))], 0, tokens))
    for job in plan.stores:
        h.complete(job.job_id)
    return h.status(a, 0, range(6))


def test_a_store_cap_stores_exactly_the_capped_blocks() -> None:
    h = Harness(make_config(full()))
    # 10 tokens rounds down to 2 whole blocks.
    assert stored_blocks(h, 24, controls=RequestControls(max_store_tokens=10)) == (
        [HIT, HIT, MISS, MISS, MISS, MISS])


def test_a_request_that_stores_nothing_leaves_nothing_in_the_tier() -> None:
    h = Harness(make_config(full()))
    assert stored_blocks(h, 24, controls=RequestControls(max_store_tokens=0)) == [MISS] * 6
    assert h.tier.usage().used_slots == 0
    # and a later request with the same prompt finds nothing to load
    b = h.request("b", prompt(24))
    assert h.lookup(b) == MatchResult(0)


def test_no_controls_store_every_complete_block() -> None:
    h = Harness(make_config(full()))
    assert stored_blocks(h, 24, controls=RequestControls()) == [HIT] * 6


def test_a_load_cap_limits_the_hit_beyond_the_engines_own_prefix() -> None:
    h = Harness(make_config(full()))
    a = h.request("a", prompt(24))
    h.put_all(a, 6)
    h.planner.set_controls(a, RequestControls(max_load_tokens=9))
    # 4 tokens on the device, at most 9 more: 13 rounds down to the block end at 12.
    assert h.lookup(a, 4) == MatchResult(8, load_async=True)
    h.alloc(a, [tuple(range(1, 7))], 8)
    load = only(h.step().loads)
    assert [t.block_ids for t in load.groups] == [(2, 3)]


def test_a_zero_load_cap_loads_nothing() -> None:
    h = Harness(make_config(full()))
    a = h.request("a", prompt(24))
    h.put_all(a, 6)
    h.planner.set_controls(a, RequestControls(max_load_tokens=0))
    assert h.lookup(a) == MatchResult(0)


def test_a_load_cap_keeps_every_group_valid_at_the_capped_end() -> None:
    # Window and Mamba groups hold only some positions: the capped end must still be a
    # hit every group accepts (here every block of every group is readable).
    h = Harness(three_groups())
    a = h.request("a", prompt(25))
    h.put_all(a, 6)
    h.planner.set_controls(a, RequestControls(max_load_tokens=14))
    assert h.lookup(a) == MatchResult(12, load_async=True)


def test_a_store_cap_on_mamba_stores_a_state_only_where_a_step_ended() -> None:
    # Chunked prefill ends steps at 8 and 16 tokens; the cap at 12 tokens lies between:
    # full attention stores its 3 blocks, Mamba only the state at 8 (block 1).
    h = Harness(make_config(full(), mamba()))
    a = h.request("a", prompt(24))
    h.planner.set_controls(a, RequestControls(max_store_tokens=12))
    table = [tuple(range(1, 7)), tuple(range(11, 17))]
    h.admit(a, table)
    jobs = [h.step(h.sched(a, table, 0, 8)).stores,
            h.step(h.sched(a, [(), ()], 8, 8)).stores]
    for stores in jobs:
        for job in stores:
            h.complete(job.job_id)
    assert h.status(a, 0, range(6)) == [HIT, HIT, HIT, MISS, MISS, MISS]
    assert h.status(a, 1, range(6)) == [MISS, HIT, MISS, MISS, MISS, MISS]


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_controls_refuse_values_that_are_not_token_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="max_store_tokens must be a whole number >= 0"):
        RequestControls(max_store_tokens=bad)  # type: ignore[arg-type]


def test_controls_of_a_finished_request_are_refused() -> None:
    h = Harness(make_config(full()))
    a = h.request("a", prompt(8))
    h.admit(a, [(1, 2)])
    store = only(h.step(h.sched(a, [(1, 2)], 0, 8)).stores)
    h.planner.request_finished(a)  # its store is still in flight: the state stays
    with pytest.raises(ValueError, match="already finished"):
        h.planner.set_controls(a, RequestControls(max_store_tokens=0))
    h.complete(store.job_id)
    assert h.drained()
