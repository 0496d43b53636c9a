"""Client hints (``RequestControls.continues``, ``session_id``) in the hit-point policies.

Full attention + a window of 8 tokens (2 blocks of 4); hits every 4 tokens. A hint changes
only which window blocks are stored and which are demoted (evicted first) when the request
finishes; without one the policy learns as before.
"""

from __future__ import annotations

import pytest
from window_kit import Req, complete, config, prefill, stored_window_blocks

from kvoffload.keys import BlockHasher, OffloadKey, make_offload_key
from kvoffload.planner.admission import Admit, HitPointAdmission
from kvoffload.planner.contract import NO_CONTROLS, RequestControls
from kvoffload.planner.planner import Planner
from kvoffload.planner.selective import HitPointStorePolicy
from kvoffload.tiers.base import TierHints
from kvoffload.tiers.host import HostTier
from support.offload_kit import host_tier, planner_for


class DemoteSpy:
    """Records the keys the planner demotes on a real tier (every hint goes through)."""

    def __init__(self, tier: HostTier) -> None:
        self.demoted: set[OffloadKey] = set()
        real = tier.hint

        def hint(hints: TierHints) -> int:
            self.demoted.update(hints.demote)
            return real(hints)

        tier.hint = hint  # type: ignore[method-assign]


def learn_turn_ends_unreached(planner: Planner, hasher: BlockHasher) -> None:
    """40 exchanges whose next prompt repeats only the prompt, never the output: the
    policy learns that turn ends are not hit points."""
    for i in range(40):
        tokens = [1000 * i + t for t in range(32)]
        turn = Req(f"t{i}", tokens, hasher, prompt=16)
        complete(planner, prefill(planner, turn, 1))
        planner.request_finished(turn)
        again = Req(f"n{i}", [*tokens[:16], 7777, 7778, 7779, 7780], hasher)
        planner.get_num_new_matched_tokens(again, 0)
        planner.request_finished(again)
    admission = planner.store_policy.admission
    assert isinstance(admission, HitPointAdmission) and not admission.turn_ends_hit


def demoted_window_blocks(controls: RequestControls, *, policy: str = "hybrid",
                          rid: str = "last") -> set[int]:
    """Window blocks demoted when a 16-token prompt with 16 tokens of output finishes,
    after the policy learned that turn ends are not reached; its turn ends at 28 (window:
    blocks 5 and 6), its prompt's end points are 12 and 16 (blocks 1, 2 and 3)."""
    hasher = BlockHasher(4)
    cfg = config(slots=10_000, policy=policy)
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    learn_turn_ends_unreached(planner, hasher)
    spy = DemoteSpy(tier)
    turn = Req(rid, [5_000_000 + t for t in range(32)], hasher, prompt=16)
    complete(planner, prefill(planner, turn, 1, controls))
    planner.request_finished(turn)
    window_key = {make_offload_key(turn.block_hashes[k], 1): k for k in range(8)}
    return {window_key[key] for key in spy.demoted if key in window_key}


def test_without_hints_the_learned_policy_demotes_the_turn_end_window() -> None:
    # Today's behaviour, the reference for the hints below: blocks 0 and 7 serve no hit
    # point, 4 is a decode block before the turn end, 5 and 6 the turn end's window.
    assert demoted_window_blocks(NO_CONTROLS) == {0, 4, 5, 6, 7}


def test_continues_true_keeps_the_turn_end_window_learning_would_demote() -> None:
    demoted = demoted_window_blocks(RequestControls(continues=True))
    assert demoted & {5, 6} == set()
    assert 4 in demoted  # a decode block no hit at the turn's end reads: demoted still
    assert demoted & {1, 2, 3} == set()  # the prompt's end stays


def test_continues_false_demotes_the_prompt_end_and_turn_end_windows() -> None:
    demoted = demoted_window_blocks(RequestControls(continues=False))
    # The repeat point 12 (block 1) and the turn end go; the prompt's end at 16 is a
    # multiple of the granule the lookups taught (16 tokens), a point other prompts may
    # share: its window (blocks 2 and 3) stays.
    assert {1, 5, 6} <= demoted and demoted & {2, 3} == set()


@pytest.mark.parametrize(("policy", "prompt", "learned", "told_false"), [
    ("hybrid", 30, [5, 6], []),
    ("hybrid", 32, [5, 6, 7], [6, 7]),
    ("value", 30, [4, 5, 6], [4, 5, 6]),
])
def test_when_full_continues_false_stores_only_shared_points(
        policy: str, prompt: int, learned: list[int], told_false: list[int]) -> None:
    """A prompt into a full tier. Its end point (28) needs blocks 5 and 6, the decode
    frontier (32 on) blocks 6 and 7. ``continues=False`` drops them under ``hybrid``, but
    a prompt ending on a granule multiple (32, the granule being 4 tokens here) keeps
    that point, where other prompts may share it; under ``value`` the last two granule
    multiples (24 and 28: blocks 4, 5, 6) stay. True stores what learning does while turn
    ends are hit points."""
    def stored(controls: RequestControls) -> list[int]:
        hasher = BlockHasher(4)
        cfg = config(slots=12, policy=policy)
        planner = planner_for(cfg, host_tier(cfg))
        complete(planner, prefill(planner, Req("fill", [99] * 24, hasher), 100))
        return stored_window_blocks(prefill(planner, Req("a", list(range(prompt)), hasher),
                                            1, controls))

    assert stored(NO_CONTROLS) == learned
    assert stored(RequestControls(continues=True)) == learned
    assert stored(RequestControls(continues=False)) == told_false


def test_continues_false_leaves_end_blocks_spare_while_the_tier_has_room() -> None:
    hasher = BlockHasher(4)
    room = [True]
    admission = HitPointAdmission(4, 4, lambda: room[0], granule_points=0)
    window = config(slots=10).resolved[1]
    hashes = hasher.hashes(list(range(40)))
    # A 30-token prompt: block 6 is in the window of its end point (28); block 8 lies
    # past the prompt (points 36, 40).
    assert admission.admit(window, 6, hashes, 30) is Admit.YES
    assert admission.admit(window, 6, hashes, 30, continues=False) is Admit.SPARE_ROOM
    assert admission.admit(window, 8, hashes, 30, continues=False) is Admit.SPARE_ROOM
    room[0] = False
    assert admission.admit(window, 6, hashes, 30, continues=False) is Admit.NO
    assert admission.admit(window, 8, hashes, 30, continues=True) is Admit.YES
    assert admission.admit(window, 0, hashes, 30, continues=True) is Admit.NO


def test_a_learned_miss_point_stays_a_hit_point_under_continues_false() -> None:
    hasher = BlockHasher(4)
    admission = HitPointAdmission(4, 4, lambda: False, granule_points=0)
    window = config(slots=10).resolved[1]
    hashes = hasher.hashes(list(range(32)))
    assert admission.admit(window, 1, hashes, 30, continues=False) is Admit.NO
    admission.learn_miss(hashes, 12)  # another prompt branched at 12: shared
    assert admission.admit(window, 1, hashes, 30, continues=False) is Admit.YES


def test_a_later_request_of_a_seen_session_is_taken_as_continuing() -> None:
    """The first request of session "s" is learned (its turn end demoted); the second is
    taken as continuing (kept); an explicit ``continues=False`` overrides the session."""
    first = demoted_window_blocks(RequestControls(session_id="s"))
    assert first == demoted_window_blocks(NO_CONTROLS)

    hasher = BlockHasher(4)
    cfg = config(slots=10_000)
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier)
    learn_turn_ends_unreached(planner, hasher)
    spy = DemoteSpy(tier)
    policy = planner.store_policy
    assert isinstance(policy, HitPointStorePolicy)
    hints = []
    for i, controls in enumerate([RequestControls(session_id="s"),
                                  RequestControls(session_id="s"),
                                  RequestControls(session_id="s", continues=False),
                                  RequestControls(session_id="other")]):
        turn = Req(f"s{i}", [6_000_000 + 1000 * i + t for t in range(32)], hasher, prompt=16)
        complete(planner, prefill(planner, turn, 1, controls))
        hints.append(policy.continues_hint(planner._requests[turn.request_id]))
        planner.request_finished(turn)
        window_key = {make_offload_key(turn.block_hashes[k], 1): k for k in range(8)}
        demoted = {window_key[key] for key in spy.demoted if key in window_key}
        assert (demoted & {5, 6} == set()) == (hints[-1] is True)
    assert hints == [None, True, False, None]


def test_lru_ignores_hints() -> None:
    hasher = BlockHasher(4)
    for controls in (NO_CONTROLS, RequestControls(continues=False)):
        cfg = config(slots=100, policy="lru")
        planner = planner_for(cfg, host_tier(cfg))
        plan = prefill(planner, Req("a", list(range(32)), hasher), 1, controls)
        assert stored_window_blocks(plan) == list(range(8))


@pytest.mark.parametrize(("field", "value"), [
    ("continues", 1), ("continues", "yes"), ("session_id", ""), ("session_id", 7),
    ("session_id", b"s")])
def test_bad_hints_are_refused_with_the_field_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        RequestControls(**{field: value})  # type: ignore[arg-type]


def test_good_hints_are_taken() -> None:
    controls = RequestControls(continues=False, session_id="chat-1")
    assert controls.has_hints and controls.continues is False
    assert not NO_CONTROLS.has_hints and not RequestControls(max_store_tokens=3).has_hints
