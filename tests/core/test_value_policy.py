"""The hybrid-aware ``value`` policy: Greedy-Dual-Size eviction by compute saved per byte,
anchor-consistent demotion, per-group byte accounting in the host tier, prefix valuation
and the learned sharing granule of hit-point admission."""

from __future__ import annotations

import pytest

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError, InvariantError
from kvoffload.jobs import StepPlan, WorkerReport
from kvoffload.keys import BlockHash, BlockHasher, OffloadKey, make_offload_key
from kvoffload.planner.admission import HitPointAdmission
from kvoffload.planner.contract import ScheduledRequest, StepInput
from kvoffload.planner.planner import Planner
from kvoffload.planner.valuation import PrefixValuer, proxy_prefill_flops
from kvoffload.policies import cache_policy
from kvoffload.tiers.eviction import BlockState, ValueHint, ValuePolicy
from kvoffload.tiers.eviction.base import NORMAL_SHARE
from support.offload_kit import host_tier, planner_for


def k(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(BlockHash(i.to_bytes(16, "big")), group)


def filled(n: int, capacity: int = 100, weight: float = 0.25) -> ValuePolicy:
    policy = ValuePolicy(capacity, weight=weight)
    for i in range(n):
        policy.insert(k(i), BlockState(slot=i, ref=0))
    return policy


def slots(victims: list[tuple[OffloadKey, BlockState]] | None) -> list[int] | None:
    return None if victims is None else [s.slot for _, s in victims]


# -- the eviction policy ----------------------------------------------------------------


def test_value_is_registered_and_equal_values_evict_like_lru() -> None:
    assert isinstance(cache_policy("value").eviction(4), ValuePolicy)
    policy = filled(4)
    policy.touch([k(0)])  # 0 ends most recent
    assert slots(policy.evict(3, set())) == [1, 2, 3]


def test_touch_processes_in_reverse_so_the_first_key_ends_most_recent() -> None:
    policy = filled(3)
    policy.touch([k(2), k(1), k(0)])
    assert slots(policy.evict(3, set())) == [0, 1, 2]


def test_a_denser_key_outlives_newer_cheap_keys() -> None:
    policy = filled(4, weight=1.0)
    policy.set_values([*(ValueHint(k(i), saved=1.0, nbytes=1.0) for i in (1, 2, 3)),
                       ValueHint(k(0), saved=100.0, nbytes=1.0)])
    assert slots(policy.evict(3, set())) == [1, 2, 3]


def test_weight_zero_is_lru_and_values_never_move_a_key_in_time() -> None:
    policy = filled(4, weight=0.0)
    policy.set_values([ValueHint(k(0), saved=100.0, nbytes=1.0)])
    policy.touch([k(1)])
    policy.set_values([ValueHint(k(2), saved=5.0, nbytes=1.0)])
    assert slots(policy.evict(4, set())) == [0, 2, 3, 1]


def test_recency_wins_back_over_value_as_generations_pass() -> None:
    """A valuable key that is never used again is evicted once enough cheaper keys have
    come and gone (its value is worth a bounded number of generations)."""
    policy = ValuePolicy(100)
    policy.insert(k(0), BlockState(0, ref=0))
    policy.set_values([ValueHint(k(0), 3.0, 1.0)])
    for i in range(1, 60):
        policy.insert(k(i), BlockState(i, ref=0))
        policy.set_values([ValueHint(k(i), 1.0, 1.0)])
        policy.touch([k(i)])
        first = slots(policy.evict(1, set()))
        if first == [0]:
            return
    pytest.fail("the valuable but unused key was never evicted")


def test_demoted_keys_go_first_until_a_touch_shows_the_hint_wrong() -> None:
    policy = filled(4)
    policy.demote([k(2), k(3)])
    policy.touch([k(2)])  # used after all: most recent again
    assert slots(policy.evict(3, set())) == [3, 0, 1]


def test_evicting_an_anchor_demotes_its_dependents() -> None:
    policy = filled(4)
    anchor, window, state = k(0, 0), k(5, 1), k(5, 2)
    for key, slot in ((window, 10), (state, 11)):
        policy.insert(key, BlockState(slot, ref=0))
    policy.set_values([ValueHint(window, 5.0, 1.0, anchor), ValueHint(state, 5.0, 1.0, anchor)])
    policy.touch([window, state])
    assert slots(policy.evict(1, set())) == [0]  # the anchor was least recent
    assert sorted(slots(policy.evict(2, set())) or []) == [10, 11]  # then its dependents
    policy.check_integrity()


def test_a_dependent_whose_anchor_is_gone_is_demoted_on_arrival() -> None:
    policy = filled(2)
    policy.insert(k(9, 1), BlockState(9, ref=0))
    policy.set_values([ValueHint(k(9, 1), 50.0, 1.0, anchor=k(77))])
    policy.touch([k(9, 1)])  # a touch does not bring back a key without its anchor
    assert slots(policy.evict(1, set())) == [9]


def test_a_touch_does_not_bring_back_a_dependent_whose_anchor_left() -> None:
    policy = filled(2)
    policy.insert(k(8, 1), BlockState(8, ref=0))
    policy.set_values([ValueHint(k(8, 1), 50.0, 1.0, anchor=k(1))])
    policy.demote([k(8, 1)])
    policy.remove(k(1))  # its anchor leaves: demoted for good
    policy.touch([k(8, 1)])
    policy.insert(k(7), BlockState(7, ref=0))
    assert slots(policy.evict(1, set())) == [8]
    policy.check_integrity()


def test_evict_never_takes_protected_pinned_or_writing_keys_and_is_atomic() -> None:
    policy = filled(4)
    policy.get(k(0)).ref = 2  # type: ignore[union-attr]
    policy.get(k(1)).ref = -1  # type: ignore[union-attr]
    before = policy.debug_state()
    assert policy.evict(3, {k(2)}) is None
    assert policy.debug_state() == before
    assert slots(policy.evict(1, {k(2)})) == [3]
    policy.check_integrity()


def test_evict_bytes_frees_enough_bytes_in_priority_order() -> None:
    policy = filled(5)
    size = {k(i): b for i, b in enumerate((1, 5, 1, 1, 9))}
    victims = policy.evict_bytes(6, 1, set(), size.__getitem__)
    assert slots(victims) == [0, 1]
    with pytest.raises(InvariantError):
        policy.evict_bytes(100, 1, set(), size.__getitem__)


def test_many_touches_keep_the_heap_linear() -> None:
    policy = filled(50)
    for _ in range(100):
        policy.touch([k(i) for i in range(50)])
    assert len(policy._heap) <= 2 * len(policy) + 64
    policy.check_integrity()


# -- byte accounting in the host tier --------------------------------------------------


def hybrid_config(capacity: int, policy: str = "value", accounting: str = "bytes"
                  ) -> OffloadConfig:
    # Full attention 1 byte per block, a window group 4 bytes per block.
    return OffloadConfig(
        groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4, page_bytes=1),
                GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8, page_bytes=4)),
        hash_block_size=4, host_capacity_bytes=capacity, eviction_policy=policy,
        host_accounting=accounting)


def test_config_validates_host_accounting() -> None:
    with pytest.raises(ConfigError, match="host_accounting"):
        hybrid_config(16, accounting="pages")
    assert hybrid_config(16, accounting="slot").num_host_slots == 4
    assert hybrid_config(16).num_host_slots == 16  # the budget over the smallest block
    assert hybrid_config(16).charges_bytes


@pytest.mark.parametrize("policy", ["lru", "arc", "value"])
def test_byte_budget_charges_each_group_its_own_block_bytes(policy: str) -> None:
    tier = host_tier(hybrid_config(12, policy))
    small = [k(i, 0) for i in range(8)]
    result = tier.prepare_store(small)
    assert result is not None and len(result.keys_to_store) == 8
    tier.complete_store(small)
    assert not tier.is_full() and not tier.usage().is_full
    # 8 bytes held; a 4-byte window block fits, a second one needs 4 bytes evicted.
    assert tier.prepare_store([k(100, 1)]) is not None
    tier.complete_store([k(100, 1)])
    assert tier.usage().is_full and tier.is_full()
    result = tier.prepare_store([k(101, 1)])
    assert result is not None and len(result.evicted) >= 4
    assert sum(tier.usage().bytes_by_group.values()) <= 12
    tier.check_integrity()


def test_byte_budget_store_is_all_or_nothing() -> None:
    tier = host_tier(hybrid_config(12))
    keys = [k(i, 1) for i in range(3)]  # 12 bytes: the whole budget
    assert tier.prepare_store(keys) is not None
    # Everything is being written: nothing can be evicted, the store is refused whole.
    before = tier.debug_state()
    assert tier.prepare_store([k(50, 0)]) is None
    assert tier.debug_state() == before
    tier.complete_store(keys)
    tier.prepare_load([keys[0]])
    # Idle: 8 bytes, pinned 4: a 12-byte store cannot fit, a 4-byte one can.
    assert tier.prepare_store([k(60, 1), k(61, 1), k(62, 1)]) is None
    assert tier.prepare_store([k(60, 1)]) is not None
    tier.check_integrity()


# -- prefix values ---------------------------------------------------------------------


def test_prefix_value_counts_compute_over_all_groups_bytes() -> None:
    cfg = hybrid_config(1 << 20)
    valuer = PrefixValuer(cfg, prefill_flops=lambda end, start: float(end - start))
    # A hit at 16 needs 4 full blocks (4 B) and the last 2 window blocks (8 B).
    assert valuer.bytes_needed(16) == 12
    assert valuer.density(16) == pytest.approx(16 / 12)
    hasher = BlockHasher(4)
    hashes = hasher.hashes(list(range(16)))
    keys = [[make_offload_key(h, g) for h in hashes] for g in (0, 1)]
    hints = valuer.hints(16, [[(0, keys[0][0])], [(3, keys[1][3])]], keys, reuse=0.5)
    assert [h.anchor for h in hints] == [None, keys[0][3]]
    assert hints[0].saved == pytest.approx(16 * (1 + valuer.reuse_bonus * 0.5))


def test_proxy_flops_grow_faster_than_linearly_with_full_attention() -> None:
    flops = proxy_prefill_flops(hybrid_config(1 << 20))
    assert flops(2000, 1000) > flops(1000, 0) > 0
    assert flops(10, 10) == 0.0


# -- admission -------------------------------------------------------------------------


def test_the_sharing_granule_is_learned_from_prefix_ends() -> None:
    policy = HitPointAdmission(4, 4, lambda: False, granule_points=2)
    assert policy.granule == 4
    for i in range(1, 33):
        policy.observe_prefix_end(64 * i)
    assert policy.granule == 64
    hashes = BlockHasher(4).hashes(list(range(300)))
    # Prompt of 300 tokens: granule multiples 256 and 192 are hit points, 128 is not.
    assert policy.is_hit_point(256, hashes, 300)
    assert policy.is_hit_point(192, hashes, 300)
    assert not policy.is_hit_point(128, hashes, 300)
    assert policy.is_hit_point(296, hashes, 300)  # the prompt's end


def prompt_hashes(i: int, length: int = 40) -> list[BlockHash]:
    """Hashes (4-token blocks) of prompt ``i``: no two prompts share a block."""
    return BlockHasher(4).hashes([1000 * i + t for t in range(length)])


def continue_at(policy: HitPointAdmission, i: int, depth: int) -> None:
    """Prompt ``i`` (40 tokens) finishes; a later prompt branches ``depth`` granule
    multiples below its end point (36), where its full-attention prefix ends."""
    hashes = prompt_hashes(i)
    policy.record_prompt_end(hashes, 40)
    point = 36 - 4 * depth
    policy.observe_lookup(point, 0, hashes[:point // 4])


def test_the_granule_points_follow_where_continuations_branch() -> None:
    policy = HitPointAdmission(4, 4, lambda: False, granule_points=2, max_granule_points=4)
    # Until 64 continuations are counted (decayed by 1/256 each), the initial count holds.
    for i in range(73):
        continue_at(policy, i, 2)
        assert policy.granule_points == 2
    continue_at(policy, 73, 2)  # the 74th: (1 - (255/256)**74) * 256 >= 64
    assert policy.granule_points == 3  # depth 2 is kept, with 0 and 1
    hashes = prompt_hashes(99)
    assert policy.is_hit_point(28, hashes, 40)
    assert not policy.is_hit_point(24, hashes, 40)
    # Continuations at the prompt's end only: depth 2 falls below 1/4 of the count, and
    # the count goes back to the initial 2, never below.
    i = 100
    while policy.granule_points == 3:
        continue_at(policy, i, 0)
        i += 1
    counts = policy._depth_counts
    assert counts[2] < HitPointAdmission.GRANULE_DEPTH_SHARE * sum(counts)
    assert policy.granule_points == 2
    for j in range(300):
        continue_at(policy, 500 + j, 0)
    assert policy.granule_points == 2
    assert policy.is_hit_point(32, hashes, 40)
    assert not policy.is_hit_point(28, hashes, 40)
    # Depth 3 (the deepest marked) at 1 in 2: kept again, with everything above it.
    for j in range(300):
        continue_at(policy, 1000 + j, 3 if j % 2 == 0 else 0)
    assert policy.granule_points == 4


def test_a_granule_mark_counts_once_and_only_where_a_prompt_marked_it() -> None:
    policy = HitPointAdmission(4, 4, lambda: False, granule_points=2, max_granule_points=4)
    hashes = prompt_hashes(1)
    policy.record_prompt_end(hashes, 40)
    policy.observe_lookup(28, 0, hashes[:7])
    policy.observe_lookup(28, 0, hashes[:7])  # the same mark again: not counted
    policy.observe_lookup(20, 0, prompt_hashes(1)[:5])  # depth 4: beyond the marks
    policy.observe_lookup(28, 0, prompt_hashes(2)[:7])  # a prompt that never finished
    assert sum(policy._depth_counts) == pytest.approx(1.0)
    assert policy._depth_counts[2] == pytest.approx(1.0)
    # A mark made under another granule does not count.
    policy.record_prompt_end(prompt_hashes(3), 40)
    policy.granule = 8
    policy.observe_lookup(32, 0, prompt_hashes(3)[:8])
    assert sum(policy._depth_counts) == pytest.approx(1.0)


def test_branches_at_an_aligned_prompt_end_count_but_never_raise_the_points() -> None:
    """A 44-token prompt ends on a granule multiple: a later prompt sharing all of it
    counts (at the end), so depth 2 (point 32) at one branch in five stays below a
    quarter. (Odd multiples at the end keep the granule at 4.)"""
    policy = HitPointAdmission(4, 4, lambda: False, granule_points=2, max_granule_points=4)
    for i in range(400):
        hashes = prompt_hashes(i, 44)
        policy.record_prompt_end(hashes, 44)
        point = 32 if i % 5 == 0 else 44
        policy.observe_lookup(point, 0, hashes[:point // 4])
    counts = policy._depth_counts
    assert counts[0] == counts[1] == 0.0
    assert counts[2] == pytest.approx(0.2 * (sum(counts) + policy._at_end_count), rel=0.1)
    assert policy.granule_points == 2


def test_a_point_two_prompts_mark_keeps_the_shallower_depth() -> None:
    """Prompt A (40 tokens) ends at point 36 (depth 0); prompt B extends it to 48, where 36
    is depth 2. A branch at 36 is counted at depth 0: A's own end point serves it."""
    policy = HitPointAdmission(4, 4, lambda: False, granule_points=2, max_granule_points=4)
    longer = BlockHasher(4).hashes(list(range(48)))
    policy.record_prompt_end(longer[:10], 40)
    policy.record_prompt_end(longer, 48)
    policy.observe_lookup(36, 0, longer[:9])
    assert policy._depth_counts == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_a_new_granule_starts_the_depth_counts_again() -> None:
    policy = HitPointAdmission(4, 4, lambda: False, granule_points=2, max_granule_points=4)
    for i in range(80):
        continue_at(policy, i, 2)
    assert policy.granule_points == 3
    for i in range(1, 401):  # the 80 branch points above were at 28, an odd multiple
        policy.observe_prefix_end(64 * i)
    assert policy.granule == 64
    assert policy.granule_points == 2
    assert sum(policy._depth_counts) == 0.0


def test_granule_marks_are_bounded_forgotten_on_reset_and_absent_when_fixed() -> None:
    policy = HitPointAdmission(4, 4, lambda: False, max_learned=10, granule_points=2,
                               max_granule_points=4)
    for i in range(5):
        policy.record_prompt_end(prompt_hashes(i), 40)
    assert len(policy._granule_marks) == 10
    policy.forget_cached()
    assert not policy._granule_marks
    fixed = HitPointAdmission(4, 4, lambda: False, granule_points=2)
    for i in range(40):
        continue_at(fixed, i, 3)
    assert not fixed._granule_marks
    assert fixed.granule_points == 2


def test_value_and_hybrid_admit_selectively_lru_stores_everything() -> None:
    for policy, selective in (("value", True), ("hybrid", True), ("lru", False),
                              ("arc", False)):
        config = hybrid_config(64, policy)
        store_policy = planner_for(config, host_tier(config)).store_policy
        assert isinstance(store_policy.admission, HitPointAdmission) is selective
        assert store_policy.learns_points is selective


def stored(plan: StepPlan, group: int) -> list[int]:
    return [t.first_block_index + i for job in plan.stores for t in job.groups
            if t.group == group for i in range(len(t.block_ids))]


class Req:
    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id = rid
        self.tokens = tokens
        self.num_prompt_tokens = len(tokens)
        self.block_hashes = BlockHasher(4).hashes(tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def run_prefill(planner: Planner, req: Req, first_id: int) -> StepPlan:
    assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 0
    table = tuple(range(first_id, first_id + req.num_tokens // 4))
    planner.update_state_after_alloc(req, (table, table), 0)
    plan = planner.build_step_plan(StepInput((ScheduledRequest(
        req, (table, table), 0, req.num_tokens, num_freed_blocks=(0, 0)),)))
    planner.update_from_worker_reports([WorkerReport(0, tuple(j.job_id for j in plan.stores))])
    return plan


def test_planner_values_stored_keys_and_anchors_window_blocks() -> None:
    cfg = hybrid_config(1 << 20)
    tier = host_tier(cfg)
    planner = planner_for(cfg, tier, prefill_flops=lambda end, start: float(end - start))
    req = Req("a", list(range(32)))
    run_prefill(planner, req, 1)
    planner.request_finished(req)
    policy = tier.policy
    assert isinstance(policy, ValuePolicy)
    window = make_offload_key(req.block_hashes[6], 1)
    anchor = make_offload_key(req.block_hashes[6], 0)
    assert policy.debug_state()["anchors"] and (window, anchor) in policy.debug_state()["anchors"]
    assert policy.reference_density > 0
    tier.check_integrity()


def test_when_full_value_stores_windows_only_at_likely_hit_points() -> None:
    cfg = hybrid_config(60)
    planner = planner_for(cfg, host_tier(cfg))
    # Fill the budget with another prompt (12 full + 12 window blocks = 60 bytes).
    run_prefill(planner, Req("fill", [99] * 48), 100)
    plan = run_prefill(planner, Req("a", list(range(64))), 1)
    window = stored(plan, 1)
    assert stored(plan, 0) == list(range(16))
    # Prompt end point 60: window blocks 13, 14; the granule (4 tokens, nothing learned
    # yet) adds point 56 (blocks 12, 13); decode frontier: block 15.
    assert window == [12, 13, 14, 15]


def test_cold_keys_go_before_normal_ones_oldest_first_until_touched() -> None:
    policy = filled(6)
    policy.cool([k(4), k(1)])
    policy.demote([k(5)])
    assert [s.slot for _, s in policy.items()][:3] == [5, 1, 4]
    policy.touch([k(1)])  # used: normal again, and the most recent
    assert slots(policy.evict(6, set())) == [5, 4, 0, 2, 3, 1]


def test_normal_keys_go_first_while_they_are_more_than_their_share() -> None:
    """normal_share 0.5: six normal keys and two cold ones; normal keys go first while
    they are more than half of the keys left, then the two kinds take turns. A pinned
    cold key is passed over for the next cold one, or a normal one when none is left."""
    policy = ValuePolicy(100, weight=0.0, normal_share=0.5)
    for i in range(8):
        policy.insert(k(i), BlockState(slot=i, ref=1 if i == 6 else 0))
    policy.cool([k(6), k(7)])
    assert [s.slot for _, s in policy.items()] == [0, 1, 2, 3, 6, 4, 7, 5]
    assert slots(policy.evict(5, set())) == [0, 1, 2, 3, 7]  # 6 is pinned
    policy.check_integrity()
    assert slots(policy.evict(1, set())) == [4]  # 2 normal of 3: more than half
    assert slots(policy.evict(1, set())) == [5]  # no cold key is free
    assert slots(policy.evict(1, set())) is None


def test_the_normal_share_must_be_a_share() -> None:
    assert ValuePolicy(10).normal_share == NORMAL_SHARE
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="normal_share"):
            ValuePolicy(10, normal_share=bad)


def test_a_key_used_since_its_insertion_is_not_made_cold() -> None:
    policy = filled(3)
    policy.touch([k(1)])
    assert policy.cool([k(0), k(1)]) == 1
    assert policy.is_cold(k(0)) and not policy.is_cold(k(1))
