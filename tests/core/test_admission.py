"""Hit-point admission (eviction_policy="hybrid"): store window blocks and Mamba states
only where a likely hit can use them, demote the rest, learn from misses."""

from __future__ import annotations

import pytest
from window_kit import Req, complete, config, prefill, stored_window_blocks

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import StepPlan
from kvoffload.keys import BlockHasher, make_offload_key
from kvoffload.planner.admission import Admit, HitPointAdmission
from kvoffload.planner.contract import ScheduledRequest, StepInput
from kvoffload.planner.planner import Planner
from kvoffload.planner.store_policy import ADMIT_ALL, StorePolicy
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.host import HostTier
from support.offload_kit import host_tier, planner_for


def test_with_free_room_every_window_block_is_stored() -> None:
    hasher = BlockHasher(4)
    planner = planner_for(config(slots=100), host_tier(config(slots=100)))
    plan = prefill(planner, Req("a", list(range(32)), hasher), 1)
    assert stored_window_blocks(plan) == list(range(8))


def test_when_full_only_the_window_at_the_prompt_end_is_stored() -> None:
    """A 32-token prompt's likely hit points are token 28 (a repeat of the prompt: the
    last token is always recomputed), whose window is blocks 5 and 6, and the points from
    32 on, where a next turn extending this one may hit (block 7 is in their window until
    the turn's real end is known). Blocks 0-4 serve no likely hit."""
    hasher = BlockHasher(4)
    cfg = config(slots=12)
    planner = planner_for(cfg, host_tier(cfg))
    filler = prefill(planner, Req("fill", [99] * 24, hasher), 100)  # fills all 12 slots
    complete(planner, filler)
    plan = prefill(planner, Req("a", list(range(32)), hasher), 1)
    assert stored_window_blocks(plan) == [5, 6, 7]


def test_a_learned_branch_point_makes_later_requests_store_windows_there() -> None:
    """Two requests share a 16-token system prompt. The first stored only the window at its
    own prompt end; the second finds the shared full-attention prefix (16 tokens) but no
    window there, so the point is learned, and its own prefill stores the window at 16."""
    hasher = BlockHasher(4)
    cfg = config(slots=30)
    planner = planner_for(cfg, host_tier(cfg))
    complete(planner, prefill(planner, Req("fill", [99] * 60, hasher), 100))  # 30 slots
    system = list(range(16))
    first = Req("a", [*system, 50, 51, 52, 53, 54, 55, 56, 57], hasher)
    complete(planner, prefill(planner, first, 1))
    second = Req("b", [*system, 60, 61, 62, 63, 64, 65, 66, 67], hasher)
    plan = prefill(planner, second, 40)
    # Window of the hit point at 16 = blocks 2 and 3 (3 is already stored: the first
    # request's prompt-end window); prompt end (20) = blocks 3 and 4; block 5 lies on the
    # decode frontier.
    assert stored_window_blocks(plan) == [2, 4, 5]
    complete(planner, plan)
    third = Req("c", [*system, 70, 71, 72, 73, 74, 75], hasher)
    assert planner.get_num_new_matched_tokens(third, 0).num_tokens == 16


def test_decode_blocks_that_miss_the_turn_end_are_demoted_at_finish() -> None:
    hasher = BlockHasher(4)
    cfg = config(slots=100)
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    req = Req("a", list(range(40)), hasher, prompt=8)  # 8 prompt + 32 generated tokens
    complete(planner, prefill(planner, req, 1))
    planner.request_finished(req)
    # The turn ends at token 36 (aligned below 39): its window is blocks 7 and 8. Decode
    # blocks 2..6 are worth little and go to the front of the eviction order.
    order = list(tier)
    window_keys = {make_offload_key(req.block_hashes[k], 1): k for k in range(10)}
    front = [window_keys[k] for k in order[:5]]
    assert sorted(front) == [2, 3, 4, 5, 6]
    assert all(tier.lookup(make_offload_key(req.block_hashes[k], 1)) is LookupResult.HIT
               for k in (7, 8))


def test_store_everything_admits_all() -> None:
    cfg = config(slots=10, policy="lru")
    planner = planner_for(cfg, host_tier(cfg))
    policy = planner.store_policy
    assert policy.admission is None and not policy.learns_points
    req = Req("r", list(range(32)), BlockHasher(4))
    planner.get_num_new_matched_tokens(req, 0)
    st = planner._requests["r"]
    assert policy.select(st, 32).admit(cfg.resolved[1], 0, st.groups[1].keys[0]) is True


def test_a_block_no_likely_hit_needs_is_spare_while_the_tier_has_room() -> None:
    """A 32-token prompt, windows of 2 blocks of 4 tokens: block 6 is in the window of
    the prompt-end point (28); block 0 serves no likely hit. With room, block 0 is
    stored as spare; without, it is refused. A likely block is a plain yes either way."""
    hasher = BlockHasher(4)
    room = [True]
    policy = HitPointAdmission(4, 4, lambda: room[0])
    window = config(slots=10).resolved[1]
    hashes = hasher.hashes(list(range(32)))
    assert policy.admit(window, 6, hashes, 32) is Admit.YES
    assert policy.admit(window, 0, hashes, 32) is Admit.SPARE_ROOM
    room[0] = False
    assert policy.admit(window, 6, hashes, 32) is Admit.YES
    assert policy.admit(window, 0, hashes, 32) is Admit.NO


def test_blocks_stored_only_for_free_room_are_demoted_at_finish() -> None:
    """With room, a 32-token prompt stores all 8 window blocks; 5, 6 (the prompt-end
    window) and 7 (the decode frontier) serve likely hits, 0-4 were spare. Once the
    request finishes, 0-4 lead the eviction order."""
    hasher = BlockHasher(4)
    cfg = config(slots=100)
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    req = Req("a", list(range(32)), hasher)
    complete(planner, prefill(planner, req, 1))
    window_key = {make_offload_key(req.block_hashes[k], 1): k for k in range(8)}
    assert len(window_key.keys() & set(tier)) == 8
    planner.request_finished(req)
    order = list(tier)
    assert sorted(window_key[key] for key in order[:5]) == [0, 1, 2, 3, 4]


def test_learned_points_are_bounded() -> None:
    hasher = BlockHasher(4)
    policy = HitPointAdmission(4, 4, lambda: False, max_learned=2)
    hashes = hasher.hashes(list(range(40)))
    for point in (8, 12, 16):
        policy.learn_miss(hashes, point)
    assert policy.num_learned == 2
    policy.learn_miss(hashes, 9)  # not aligned: ignored
    assert policy.num_learned == 2


def chunk(planner: Planner, req: Req, ids: tuple[int, ...], computed: int,
          scheduled: int) -> StepPlan:
    """One prefill chunk: ``ids`` are the new blocks for tokens [computed, +scheduled)."""
    if computed == 0:
        planner.update_state_after_alloc(req, (ids, ids), 0)
    return planner.build_step_plan(StepInput((ScheduledRequest(
        req, (ids, ids), computed, scheduled, num_freed_blocks=(0, 0)),)))


def window_planner_with_a_full_tier() -> tuple[BlockHasher, HostTier, Planner]:
    """Full attention + a window of 8 tokens (``config``), and a tier of 40 keys filled
    by an 80-token request."""
    hasher = BlockHasher(4)
    cfg = config(slots=40)
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    complete(planner, prefill(planner, Req("fill", [99] * 80, hasher), 100))
    assert tier.is_full()
    return hasher, tier, planner


def looked_up(planner: Planner, req: Req) -> Req:
    """``req`` after its first lookup (which must find nothing)."""
    assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 0
    return req


def test_a_prefill_stores_its_resume_point_and_demotes_it_once_past() -> None:
    """A 32-token prompt computed 12 tokens at a time into a full tier. After the first
    chunk, the window at 12 (blocks 1 and 2) is stored only because a preempted request
    would resume there; after the second, the window at 24 (blocks 4 and 5; 5 also
    serves the prompt end) is, and blocks 1 and 2 go to the front of the eviction order.
    Preempted then, the request finds 24 tokens in the tier instead of none."""
    hasher, tier, planner = window_planner_with_a_full_tier()
    req = looked_up(planner, Req("a", list(range(32)), hasher))
    first = chunk(planner, req, (1, 2, 3), 0, 12)
    assert stored_window_blocks(first) == [1, 2]
    complete(planner, first)
    second = chunk(planner, req, (4, 5, 6), 12, 12)
    assert stored_window_blocks(second) == [4, 5]
    complete(planner, second)
    window_key = {make_offload_key(req.block_hashes[k], 1): k for k in range(8)}
    assert sorted(window_key.get(key, -1) for key in list(tier)[:2]) == [1, 2]
    planner.build_step_plan(StepInput(preempted=("a",)))
    assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 24


@pytest.mark.parametrize("policy", ["hybrid", "value"])
def test_passed_resume_points_stay_demoted_through_the_requests_own_touches(
        policy: str) -> None:
    """The prefill of ``test_a_prefill_stores_its_resume_point_and_demotes_it_once_past``,
    preempted and resumed, then finished: the lookup after the preemption and the finish
    touch the request's prefix, but the window blocks of the passed resume point (1 and
    2) stay in the demoted front of the eviction order."""
    hasher = BlockHasher(4)
    cfg = config(slots=40, policy=policy)
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    complete(planner, prefill(planner, Req("fill", [99] * 80, hasher), 100))
    assert tier.is_full()
    req = looked_up(planner, Req("a", list(range(32)), hasher))
    complete(planner, chunk(planner, req, (1, 2, 3), 0, 12))
    complete(planner, chunk(planner, req, (4, 5, 6), 12, 12))
    planner.build_step_plan(StepInput(preempted=("a",)))
    assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 24
    complete(planner, chunk(planner, req, (7, 8), 24, 8))
    planner.request_finished(req)
    window_key = {make_offload_key(req.block_hashes[k], 1): k for k in range(8)}
    order = [window_key.get(key, -1) for key in tier]
    demoted = {1, 2, 4}  # 4: the last resume point's block the prompt end does not need
    passed = [i for i, block in enumerate(order) if block in (1, 2)]
    assert passed  # held still (under hybrid the last chunk evicted block 1 first)
    assert all(set(order[:i]) <= demoted for i in passed)


def test_resume_points_lie_inside_the_prompt() -> None:
    policy = HitPointAdmission(4, 8, lambda: False)
    assert [policy.resume_point(f, 40) for f in (4, 8, 13, 38, 39, 44)] == [0, 8, 8, 32, 0, 0]
    # The null store policy has no resume points: it stores every block anyway.
    assert StorePolicy().select(None, 13) is ADMIT_ALL  # type: ignore[arg-type]


def test_a_resume_state_before_a_likely_hit_point_is_kept() -> None:
    """Full attention + Mamba, states only where a step ended. A first request shares 16
    tokens with the second, whose lookup then finds full attention to 16 but no state
    there: 16 becomes a learned hit point. The second request's prefill runs in chunks
    of 12: the state at 12 is the deepest one a hit at 16 can use, so it is kept when
    the prefill moves on to 24, not demoted; a third request sharing 16 tokens hits 12."""
    hasher, tier, planner = mamba_planner_with_a_full_tier()
    shared = list(range(16))
    complete(planner, prefill(planner, Req("s", [*shared, 1, 2, 3, 4], hasher), 300))
    req = Req("a", [*shared, *range(50, 66)], hasher)
    assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 0  # learns 16
    complete(planner, chunk(planner, req, (1, 2, 3), 0, 12))
    complete(planner, chunk(planner, req, (4, 5, 6), 12, 12))
    state_at_12 = make_offload_key(req.block_hashes[2], 1)
    assert state_at_12 in list(tier) and next(iter(tier)) != state_at_12
    third = Req("c", [*shared, 70, 71, 72, 73], hasher)
    assert planner.get_num_new_matched_tokens(third, 0).num_tokens == 12


def test_a_resume_point_keeps_the_window_blocks_it_shares_with_the_last_one() -> None:
    """Window of 8 tokens (2 blocks), prefill 4 tokens a step into a full tier: each new
    resume point's window shares a block with the previous one's. Only the block the new
    point does not need is demoted, so after other requests store a little, the
    preempted request still resumes from its last point (20 tokens)."""
    hasher, tier, planner = window_planner_with_a_full_tier()
    req = looked_up(planner, Req("a", list(range(32)), hasher))
    for step in range(5):
        complete(planner, chunk(planner, req, (1 + step,), 4 * step, 4))
    window_key = {make_offload_key(req.block_hashes[k], 1): k for k in range(8)}
    held = [window_key.get(key) for key in tier]
    assert held[0] == 2 and 3 in held[1:] and 4 in held[1:]  # 3 and 4: the window at 20
    complete(planner, prefill(planner, Req("other", [98] * 12, hasher), 200))  # evicts 3+
    planner.build_step_plan(StepInput(preempted=("a",)))
    assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 20


def mamba_planner_with_a_full_tier() -> tuple[BlockHasher, HostTier, Planner]:
    """Full attention + Mamba (states only where steps end) under hit-point admission,
    and a tier of 40 keys filled by 39 full-attention blocks and a state."""
    hasher = BlockHasher(4)
    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),
                                GroupSpec(GroupKind.MAMBA, 4)),
                        hash_block_size=4, host_capacity_bytes=40, eviction_policy="hybrid")
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    complete(planner, prefill(planner, Req("fill", [99] * 156, hasher), 100))
    assert tier.is_full()
    return hasher, tier, planner


def test_the_last_resume_state_before_the_prompt_end_point_is_kept_at_finish() -> None:
    """Full attention + Mamba, a 32-token prompt computed in steps ending at 12, 24 and
    32. A repeat of the prompt hits at 28, where no step ended: the state at 24 is the
    deepest one it can use, so finishing the request does not demote it."""
    hasher, tier, planner = mamba_planner_with_a_full_tier()
    req = looked_up(planner, Req("a", list(range(32)), hasher))
    complete(planner, chunk(planner, req, (1, 2, 3), 0, 12))
    complete(planner, chunk(planner, req, (4, 5, 6), 12, 12))
    complete(planner, chunk(planner, req, (7, 8), 24, 8))
    planner.request_finished(req)
    state_at_24 = make_offload_key(req.block_hashes[5], 1)
    state_at_12 = make_offload_key(req.block_hashes[2], 1)
    assert state_at_24 in list(tier) and next(iter(tier)) != state_at_24
    assert state_at_12 not in list(tier)  # superseded: demoted, then evicted first
    again = Req("b", list(range(32)), hasher)
    assert planner.get_num_new_matched_tokens(again, 0).num_tokens == 24


def test_a_resume_point_needs_a_state_where_a_step_ended() -> None:
    """Full attention + Mamba, steps ending at 12 and 18. There is no state at 16 (the
    aligned point below 18), so 12 stays the resume point: its state is not demoted,
    and the preempted request resumes from 12."""
    hasher, tier, planner = mamba_planner_with_a_full_tier()
    req = looked_up(planner, Req("a", list(range(32)), hasher))
    complete(planner, chunk(planner, req, (1, 2, 3), 0, 12))
    complete(planner, chunk(planner, req, (4, 5), 12, 6))
    state_at_12 = make_offload_key(req.block_hashes[2], 1)
    assert state_at_12 in list(tier) and next(iter(tier)) != state_at_12
    planner.build_step_plan(StepInput(preempted=("a",)))
    assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 12


def test_reset_cache_starts_the_insertion_duel_afresh() -> None:
    cfg = config(slots=40, policy="value")
    planner = planner_for(cfg, host_tier(cfg))
    duel = planner.insertion
    assert duel is not None
    duel.bimodal_score = 5.0
    duel.lru.insert([(make_offload_key(BlockHasher(4).hashes([1, 2, 3, 4])[0], 0), 1)])
    planner.reset_cache()
    fresh = planner.insertion
    assert fresh is not None and fresh.bimodal_score == 0 and len(fresh.lru) == 0


def test_a_resume_point_whose_window_was_never_stored_is_not_taken() -> None:
    """Full attention in 8-token blocks, a window of 8 tokens in 4-token blocks: hits
    every 8 tokens. Steps end at 14 (resume point 8, window blocks 0 and 1) and at 17:
    the point 16 needs window block 2, which was passed over when the step ended at 14,
    so 8 stays the resume point and its blocks stay; the request resumes from 8."""
    hasher = BlockHasher(4)
    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 8),
                                GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8)),
                        hash_block_size=4, host_capacity_bytes=30, eviction_policy="hybrid")
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    fill = looked_up(planner, Req("fill", [99] * 80, hasher))
    fa, sw = tuple(range(100, 110)), tuple(range(200, 220))
    planner.update_state_after_alloc(fill, (fa, sw), 0)
    complete(planner, planner.build_step_plan(StepInput((ScheduledRequest(
        fill, (fa, sw), 0, 80, num_freed_blocks=(0, 0)),))))
    assert tier.is_full()
    req = looked_up(planner, Req("a", list(range(64)), hasher))
    fa, sw = (1, 2), (11, 12, 13, 14)
    planner.update_state_after_alloc(req, (fa, sw), 0)
    complete(planner, planner.build_step_plan(StepInput((ScheduledRequest(
        req, (fa, sw), 0, 14, num_freed_blocks=(0, 0)),))))
    complete(planner, planner.build_step_plan(StepInput((ScheduledRequest(
        req, ((3,), (15,)), 14, 3, num_freed_blocks=(0, 0)),))))
    window = {make_offload_key(req.block_hashes[k], 1) for k in (0, 1)}
    assert window <= set(tier) and not window & set(list(tier)[:2])
    planner.build_step_plan(StepInput(preempted=("a",)))
    assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 8


def test_with_a_state_at_every_block_a_passed_resume_point_is_demoted() -> None:
    """With ``mamba_states_every_block`` every block boundary has a state, so the state
    at the last resume point (24) is demoted at finish: the state at 28 serves the
    prompt's end."""
    hasher = BlockHasher(4)
    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),
                                GroupSpec(GroupKind.MAMBA, 4)),
                        hash_block_size=4, host_capacity_bytes=40, eviction_policy="hybrid",
                        mamba_states_every_block=True)
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    for i in range(6):
        complete(planner, prefill(planner, Req(f"fill{i}", [90 + i] * 32, hasher), 100 + 10 * i))
    assert tier.is_full()
    req = looked_up(planner, Req("a", list(range(32)), hasher))
    complete(planner, chunk(planner, req, (1, 2, 3), 0, 12))
    complete(planner, chunk(planner, req, (4, 5, 6), 12, 12))
    complete(planner, chunk(planner, req, (7, 8), 24, 8))
    planner.request_finished(req)
    assert next(iter(tier)) == make_offload_key(req.block_hashes[5], 1)  # the state at 24


def cheap_window_planner(slots: int = 40, fill: bool = True
                         ) -> tuple[BlockHasher, HostTier, Planner]:
    """Full attention + a window of 4 tokens (1 block of 4: a hit point's window charges
    as much as 4 tokens of full attention), and a tier of ``slots`` keys, filled by an
    80-token request if ``fill``."""
    hasher = BlockHasher(4)
    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),
                                GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=4)),
                        hash_block_size=4, host_capacity_bytes=slots, eviction_policy="hybrid")
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    if fill:
        complete(planner, prefill(planner, Req("fill", [99] * 80, hasher), 100))
        assert tier.is_full()
    return hasher, tier, planner


def test_a_cheap_resume_point_is_kept_as_a_checkpoint() -> None:
    """A 120-token prompt computed 48 tokens a step. Its resume point at 48 has a
    one-block window, a twelfth of the 12 full-attention blocks before it (at most
    ``CHECKPOINT_SHARE``, 0.1): when the prefill moves on it stays, behind the filler's
    blocks in the eviction order instead of ahead of them, and a request that shares 60
    tokens of the prompt hits there once the prompt is done.

    The window-of-8 tier in ``test_a_prefill_stores_its_resume_point_and_demotes_it_once_
    past`` shows the opposite: 2 blocks against 3 full-attention blocks are demoted."""
    hasher, tier, planner = cheap_window_planner()
    req = looked_up(planner, Req("a", list(range(120)), hasher))
    complete(planner, chunk(planner, req, tuple(range(1, 13)), 0, 48))
    complete(planner, chunk(planner, req, tuple(range(13, 25)), 48, 48))
    at_48 = make_offload_key(req.block_hashes[11], 1)
    filler = {make_offload_key(h, g) for h in hasher.hashes([99] * 80) for g in (0, 1)}
    order = list(tier)
    assert at_48 in order
    assert any(key in filler for key in order[:order.index(at_48)])
    complete(planner, chunk(planner, req, tuple(range(25, 31)), 96, 24))
    planner.request_finished(req)
    branch = Req("b", [*range(60), *range(500, 520)], hasher)
    assert planner.get_num_new_matched_tokens(branch, 0).num_tokens == 48


def test_a_cheap_checkpoint_stored_while_the_tier_had_room_is_kept_too() -> None:
    """The same 120-token prompt into a tier with room for all of it: every window block
    is stored, those no likely hit needs as spare. The one at the resume point 48 is the
    resume point's, so the checkpoint rule keeps it; the other spare blocks are demoted
    at the finish and go first when a later request fills the tier."""
    hasher, tier, planner = cheap_window_planner(slots=64, fill=False)
    req = looked_up(planner, Req("a", list(range(120)), hasher))
    complete(planner, chunk(planner, req, tuple(range(1, 13)), 0, 48))
    complete(planner, chunk(planner, req, tuple(range(13, 25)), 48, 48))
    complete(planner, chunk(planner, req, tuple(range(25, 31)), 96, 24))
    planner.request_finished(req)
    assert not tier.is_full()
    complete(planner, prefill(planner, Req("fill", [99] * 40, hasher), 100))  # evicts 16
    window_key = {make_offload_key(req.block_hashes[k], 1): k for k in range(30)}
    held = sorted(window_key[key] for key in tier if key in window_key)
    # Kept: the checkpoints at 48 (block 11) and 96 (23), and the prompt end's window
    # (block 28; block 29 lies on the decode frontier). The 16 evicted were spare.
    assert {11, 23, 28, 29} <= set(held) and len(held) == 30 - 16
    branch = Req("b", [*range(60), *range(500, 520)], hasher)
    assert planner.get_num_new_matched_tokens(branch, 0).num_tokens == 48


def test_turn_ends_stop_being_hit_points_once_later_prompts_never_reach_them() -> None:
    """Turns of an 8-token prompt and 32 tokens of output end at 36, past the prompt. Once
    enough turn ends were recorded (a decayed count) and none was reached, decode points
    are only spare; the prompt's end stays a hit point. Later prompts that reach turn
    ends make them hit points again; a turn end counts once however often it is reached."""
    hasher = BlockHasher(4)
    room = [False]
    policy = HitPointAdmission(4, 4, lambda: room[0])
    window = config(slots=10).resolved[1]
    turns = [hasher.hashes([1000 * i + t for t in range(40)]) for i in range(80)]
    assert policy.admit(window, 8, turns[0], 8) is Admit.YES  # decode: a hit point at first
    decay = HitPointAdmission.TURN_END_DECAY
    flips = []
    for i, hashes in enumerate(turns[:40]):
        policy.record_turn_end(hashes, 8, 40)
        recorded, reached = policy.turn_end_counts
        assert recorded == pytest.approx((1 - decay ** (i + 1)) / (1 - decay)) and reached == 0
        flips.append(policy.turn_ends_hit)
    # 35 decayed records are the first to reach TURN_END_EVIDENCE (32).
    assert flips.index(False) == 34 and not any(flips[34:])
    assert policy.admit(window, 8, turns[0], 8) is Admit.NO
    room[0] = True
    assert policy.admit(window, 8, turns[0], 8) is Admit.SPARE_ROOM
    assert policy.admit(window, 0, turns[0], 8) is Admit.YES  # the prompt end (4) still is
    for _ in range(5):
        policy.observe_lookup(36, 36, turns[0])
    assert policy.turn_end_counts[1] == 1  # counted once
    assert not policy.turn_ends_hit
    for hashes in turns[40:44]:
        policy.record_turn_end(hashes, 8, 40)
        policy.observe_lookup(40, 0, hashes)  # reached (the frontier is one point past it)
    assert policy.turn_ends_hit
    counts = policy.turn_end_counts
    policy.observe_lookup(36, 36, turns[50])  # never recorded: not counted
    assert policy.turn_end_counts == counts
    policy.record_turn_end(turns[60], 39, 40)  # ends at the prompt-end point: not a turn end
    policy.record_turn_end(turns[61], 36, 40)  # ends at the prompt's own (aligned) end
    assert policy.turn_end_counts == counts


def test_an_aligned_prompt_end_stays_a_hit_point_when_turn_ends_are_not() -> None:
    """A 16-token prompt: a later prompt extending it hits at 16 (its window: blocks 2 and
    3), a repeat of it at 12. Both stay hit points; 20 (decode) follows the turn ends."""
    hasher = BlockHasher(4)
    policy = HitPointAdmission(4, 4, lambda: False)
    window = config(slots=10).resolved[1]
    for i in range(40):
        policy.record_turn_end(hasher.hashes([1000 * i + t for t in range(40)]), 8, 40)
    assert not policy.turn_ends_hit
    hashes = hasher.hashes(list(range(24)))
    assert [policy.admit(window, k, hashes, 16) for k in (1, 2, 3, 4)] == [
        Admit.YES, Admit.YES, Admit.YES, Admit.NO]


def test_turn_ends_are_bounded_and_a_cache_reset_forgets_those_not_reached() -> None:
    hasher = BlockHasher(4)
    policy = HitPointAdmission(4, 4, lambda: False, max_learned=2)
    turns = [hasher.hashes([1000 * i + t for t in range(40)]) for i in range(4)]
    for hashes in turns[:3]:
        policy.record_turn_end(hashes, 8, 40)
    policy.observe_lookup(36, 0, turns[0])  # forgotten (the oldest of three): not counted
    assert policy.turn_end_counts[1] == 0
    policy.observe_lookup(36, 0, turns[1])
    assert policy.turn_end_counts[1] == 1
    policy.record_turn_end(turns[3], 8, 40)
    recorded, reached = policy.turn_end_counts
    policy.forget_cached()  # turns 2 and 3 were not reached, and now never will be
    assert policy.turn_end_counts == (pytest.approx(recorded - 2), reached)
    policy.observe_lookup(36, 0, turns[2])
    assert policy.turn_end_counts[1] == reached


def test_turn_ends_are_learned_only_in_hybrid_layouts() -> None:
    """Without window or Mamba groups there is nothing to admit: no turn end is kept."""
    hasher = BlockHasher(4)
    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),), hash_block_size=4,
                        host_capacity_bytes=100, eviction_policy="value")
    planner = planner_for(cfg, host_tier(cfg))
    hybrid = config(slots=100, policy="value")
    hybrid_planner = planner_for(hybrid, host_tier(hybrid))
    for p in (planner, hybrid_planner):
        req = Req("a", list(range(40)), hasher, prompt=8)
        assert p.get_num_new_matched_tokens(req, 0).num_tokens == 0
        p.request_finished(req)
    assert isinstance(planner.store_policy.admission, HitPointAdmission)
    assert isinstance(hybrid_planner.store_policy.admission, HitPointAdmission)
    assert planner.store_policy.admission.turn_end_counts == (0.0, 0.0)
    assert hybrid_planner.store_policy.admission.turn_end_counts == (1.0, 0.0)


def finish_turns(planner: Planner, hasher: BlockHasher, count: int, *,
                 next_extends_output: bool) -> Req:
    """``count`` two-turn exchanges: a 16-token prompt, 16 generated tokens, then a next
    prompt that repeats the whole turn (prompt and output) or only the prompt."""
    last = None
    for i in range(count):
        tokens = [1000 * i + t for t in range(32)]
        turn = Req(f"t{i}", tokens, hasher, prompt=16)
        complete(planner, prefill(planner, turn, 1))
        planner.request_finished(turn)
        repeated = tokens if next_extends_output else tokens[:16]
        last = Req(f"n{i}", [*repeated, 7777, 7778, 7779, 7780], hasher)
        planner.get_num_new_matched_tokens(last, 0)
        planner.request_finished(last)
    assert last is not None
    return last


@pytest.mark.parametrize("reached", [True, False])
def test_turn_end_windows_are_kept_only_where_later_prompts_reach_turn_ends(
        reached: bool) -> None:
    """After 40 exchanges whose next prompts repeat the output, a finished turn's window
    at its end (token 28: blocks 5 and 6) stays; where next prompts repeat only the
    prompt, that window is demoted like the decode block before it (4)."""
    hasher = BlockHasher(4)
    cfg = config(slots=10_000)
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    finish_turns(planner, hasher, 40, next_extends_output=reached)
    turn = Req("last", [5_000_000 + t for t in range(32)], hasher, prompt=16)
    complete(planner, prefill(planner, turn, 1))
    planner.request_finished(turn)
    window_key = {make_offload_key(turn.block_hashes[k], 1): k for k in range(8)}
    demoted = {window_key[key] for key in list(tier)[:8] if key in window_key}
    assert 4 in demoted  # a decode block no turn-end hit can use: demoted either way
    assert demoted & {5, 6} == (set() if reached else {5, 6})


def test_a_turn_end_is_reached_where_the_engines_cache_ends_between_hit_points() -> None:
    """Hits every 8 tokens, hash blocks of 4: a turn of 40 tokens ends at 32. A later
    prompt whose full-attention prefix ends at 32, 36 (the engine's cache ending between
    hit points) or 40 continues it; one ending at 28 does not."""
    hasher = BlockHasher(4)
    policy = HitPointAdmission(4, 8, lambda: False)
    for i, frontier in enumerate((32, 36, 40, 28)):
        hashes = hasher.hashes([1000 * i + t for t in range(48)])
        policy.record_turn_end(hashes, 8, 40)
        before = policy.turn_end_counts[1]
        policy.observe_lookup(frontier, 0, hashes)
        assert (policy.turn_end_counts[1] > before) is (frontier != 28), frontier


def test_the_planner_learns_how_far_below_a_prompts_end_continuations_branch() -> None:
    """80 prompts of 40 tokens are stored and finish; each is continued by a prompt that
    shares its first 28 tokens, two granule multiples below its end point (36). Under
    `value` the planner marks every finished prompt, so the granule points grow from 2
    to 3 and keep 28; under `hybrid` (no granule points) nothing is marked."""
    hasher = BlockHasher(4)
    for policy, expected in (("value", 3), ("hybrid", 0)):
        cfg = config(slots=10_000, policy=policy)
        planner = planner_for(cfg, host_tier(cfg))
        for i in range(80):
            tokens = [1000 * i + t for t in range(40)]
            first = Req(f"p{i}", tokens, hasher)
            complete(planner, prefill(planner, first, 1))
            planner.request_finished(first)
            branch = Req(f"b{i}", [*tokens[:28], *[7] * 8], hasher)
            planner.get_num_new_matched_tokens(branch, 0)
            planner.request_finished(branch)
        assert isinstance(planner.store_policy.admission, HitPointAdmission)
        assert planner.store_policy.admission.granule_points == expected


def test_a_deferred_lookup_counts_the_depth_its_answer_will_have() -> None:
    """A 40-token prompt's stores are still in flight when a prompt branching at its end
    point (36) looks up: the lookup is deferred, yet it counts depth 0 (where the prefix
    will reach), once; the lookup asked again after the stores land counts nothing more."""
    hasher = BlockHasher(4)
    cfg = config(slots=10_000, policy="value")
    planner = planner_for(cfg, host_tier(cfg))
    admission = planner.store_policy.admission
    assert isinstance(admission, HitPointAdmission)
    first = Req("a", list(range(40)), hasher)
    assert planner.get_num_new_matched_tokens(first, 0).num_tokens == 0
    # Distinct engine blocks per group (a finished request's in-flight stores are fenced).
    tables = (tuple(range(1, 11)), tuple(range(101, 111)))
    planner.update_state_after_alloc(first, tables, 0)
    plan = planner.build_step_plan(StepInput((ScheduledRequest(
        first, tables, 0, 40, num_freed_blocks=(0, 0)),)))
    planner.request_finished(first)  # marks its granule points; stores not reported yet
    branch = Req("b", [*range(36), 7, 7, 7, 7], hasher)
    assert planner.get_num_new_matched_tokens(branch, 0).is_deferred
    assert admission._depth_counts[:3] == pytest.approx([1.0, 0.0, 0.0])
    complete(planner, plan)
    assert planner.get_num_new_matched_tokens(branch, 0).num_tokens == 36
    assert admission._depth_counts[:3] == pytest.approx([1.0, 0.0, 0.0])
