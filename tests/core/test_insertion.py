"""Bimodal insertion and the duel that chooses it (``kvoffload.planner.insertion``):
shadow directories keep their budget and order, the duel picks the directory that serves
more, and while bimodal insertion is clearly ahead the planner stores the blocks of most
requests cold (not one in ``HOT_EVERY``, not a resume point's); a preemption makes a
request's cold blocks normal; a cyclic pattern that thrashes LRU insertion gets hits."""

from __future__ import annotations

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import WorkerReport
from kvoffload.keys import BlockHash, BlockHasher, OffloadKey, make_offload_key
from kvoffload.planner.contract import RequestControls, ScheduledRequest, StepInput
from kvoffload.planner.insertion import (
    DECAY,
    HOT_EVERY,
    InsertionDuel,
    ShadowDirectory,
    is_hot_request,
)
from kvoffload.tiers.eviction import ValuePolicy
from support.offload_kit import host_tier, planner_for


def test_about_one_request_in_hot_every_is_hot() -> None:
    hot = sum(is_hot_request(f"req-{i}") for i in range(8000))
    assert abs(hot - 8000 / HOT_EVERY) < 150
    # Stable across processes and runs (a CRC of the id, not Python's salted hash).
    assert [i for i in range(64) if is_hot_request(f"req-{i}")] == [5, 10, 27, 33, 38, 46,
                                                                      52, 59]


def k(i: int) -> OffloadKey:
    return make_offload_key(BlockHash(i.to_bytes(16, "big")), 0)


def test_a_shadow_keeps_its_budget_and_evicts_cold_keys_first() -> None:
    shadow = ShadowDirectory(budget=10)
    shadow.insert([(k(1), 4), (k(2), 4)])
    shadow.insert([(k(3), 2)], cold=True)
    assert shadow.used == 10 and list(shadow) == [k(3), k(1), k(2)]
    shadow.insert([(k(4), 2), (k(1), 4)])  # room from the front: the cold k(3)
    assert k(3) not in shadow and shadow.used == 10
    shadow.insert([(k(5), 4)])  # then the least recent normal key
    assert k(1) not in shadow and k(2) in shadow and shadow.used == 10
    shadow.insert([(k(6), 11)])  # larger than the budget: never held
    assert k(6) not in shadow


def test_a_shadow_evicts_normal_keys_first_while_they_are_more_than_their_share() -> None:
    shadow = ShadowDirectory(budget=4, normal_share=0.5)
    shadow.insert([(k(0), 1), (k(1), 1), (k(2), 1)])
    shadow.insert([(k(3), 1)], cold=True)
    assert list(shadow) == [k(0), k(1), k(3), k(2)]  # normal first while more than half
    shadow.insert([(k(4), 1)], cold=True)
    assert k(0) not in shadow
    shadow.demote([k(2)])
    shadow.warm([k(4)])
    assert list(shadow) == [k(2), k(1), k(3), k(4)]


def test_a_shadow_lookup_counts_held_keys_in_a_row_and_refreshes_them() -> None:
    shadow = ShadowDirectory(budget=4)
    shadow.insert([(k(i), 1) for i in range(4)])
    assert shadow.lookup([k(0), k(1), k(9), k(3)], start=1) == 1
    shadow.insert([(k(7), 1), (k(8), 1)])  # evicts 2 and 3, not 0 and 1
    assert [key in shadow for key in (k(0), k(1), k(2), k(3))] == [True, True, False, False]


def cycle(duel: InsertionDuel, prefixes: int, rounds: int) -> None:
    """Requests cycling over ``prefixes`` one-block prefixes, each stored after its
    lookup; every HOT_EVERY-th is stored normally by bimodal insertion."""
    for _ in range(rounds):
        for p in range(prefixes):
            duel.observe_lookup([k(p)], 0, served=0)
            duel.observe_store([(k(p), 1)], cold=p % HOT_EVERY != 0)


def test_bimodal_insertion_wins_where_lru_insertion_thrashes() -> None:
    duel = InsertionDuel(budget=8, block_tokens=16)
    cycle(duel, prefixes=32, rounds=20)  # reuse distance 32 blocks, room for 8
    assert duel.lru_score == 0 and duel.bimodal_ahead


def test_lru_insertion_is_kept_when_everything_fits() -> None:
    duel = InsertionDuel(budget=64, block_tokens=16)
    cycle(duel, prefixes=32, rounds=20)
    assert duel.lru_score > 0 and not duel.bimodal_ahead


def test_bimodal_insertion_must_also_beat_what_the_tier_itself_served() -> None:
    """The LRU directory models plain LRU; the tier, inserting normally, also ranks by
    value. What it served while inserting normally is a floor bimodal insertion must beat
    by the same lead; it is only counted while insertion is normal."""
    duel = InsertionDuel(budget=8, block_tokens=16)
    duel.bimodal_score, duel.served_score = 2.0, 3.0
    assert not duel.bimodal_ahead
    duel.observe_lookup([k(0)], 0, served=5)  # normal insertion: counted
    assert duel.served_score == 3.0 * DECAY + 5
    duel.served_score = 1.0
    assert duel.bimodal_ahead
    duel.observe_lookup([k(0)], 0, served=100)  # bimodal insertion now: not counted
    assert duel.served_score == 1.0


def cold_id(prefix: str) -> str:
    return next(f"{prefix}{i}" for i in range(100) if not is_hot_request(f"{prefix}{i}"))


def hot_id(prefix: str) -> str:
    return next(f"{prefix}{i}" for i in range(100) if is_hot_request(f"{prefix}{i}"))


class Req:
    def __init__(self, hasher: BlockHasher, rid: str, tokens: list[int],
                 num_prompt_tokens: int | None = None) -> None:
        self.request_id = rid
        self.num_tokens = len(tokens)
        self.num_prompt_tokens = num_prompt_tokens or len(tokens)
        self.block_hashes = hasher.hashes(tokens)


class Harness:
    """A planner over a host tier of ``capacity`` keys (``groups`` of 4-token blocks,
    ``policy``), whose jobs complete at the end of every step."""

    def __init__(self, capacity: int, policy: str = "value", window: bool = True) -> None:
        groups = [GroupSpec(GroupKind.FULL_ATTENTION, 4)]
        if window:
            groups.append(GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8))
        cfg = OffloadConfig(groups=tuple(groups), hash_block_size=4,
                            host_capacity_bytes=capacity, eviction_policy=policy)
        self.hasher = BlockHasher(4)
        self.tier = host_tier(cfg)
        self.planner = planner_for(cfg, self.tier)
        self.num_groups = len(groups)

    def bimodal_ahead(self, ahead: bool = True) -> None:
        """Make the duel say bimodal insertion is (or is not) clearly ahead."""
        duel = self.planner.insertion
        assert duel is not None
        duel.lru_score, duel.bimodal_score = (0.0, 1e9) if ahead else (1e9, 1e9)

    def step(self, step: StepInput) -> None:
        plan = self.planner.build_step_plan(step)
        self.planner.update_from_worker_reports(
            [WorkerReport(0, tuple(j.job_id for j in plan.stores + plan.loads))])

    def compute(self, req: Req, ids: tuple[int, ...], computed: int, scheduled: int) -> None:
        self.step(StepInput((ScheduledRequest(req, (ids,) * self.num_groups, computed,
                                              scheduled,
                                              num_freed_blocks=(0,) * self.num_groups),)))

    def run(self, req: Req, first_id: int, finish: bool = True) -> int:
        """Look ``req`` up, load its hit, compute the rest; the tokens it hit."""
        hit = self.planner.get_num_new_matched_tokens(req, 0).num_tokens
        assert hit is not None
        ids = tuple(range(first_id, first_id + -(-req.num_tokens // 4)))
        self.planner.update_state_after_alloc(req, (ids,) * self.num_groups, hit)
        if hit:
            self.step(StepInput())  # the load
        self.compute(req, ids, hit, req.num_tokens - hit)
        if finish:
            self.planner.request_finished(req)
        return hit

    def cold(self) -> set[OffloadKey]:
        policy = self.tier.policy
        assert isinstance(policy, ValuePolicy)
        return {key for key in self.tier if policy.is_cold(key)}


def full_keys(req: Req) -> set[OffloadKey]:
    return {make_offload_key(h, 0) for h in req.block_hashes}


def test_a_cold_request_stores_cold_and_a_hot_one_normally() -> None:
    """A cold request's blocks are cold as soon as they are stored and stay cold when it
    finishes; a hot request's are normal; a hit by another request makes cold blocks
    normal, and that request's own new blocks are cold again."""
    h = Harness(200)
    h.bimodal_ahead()
    cold = Req(h.hasher, cold_id("c"), list(range(16)))
    h.run(cold, 100, finish=False)
    assert full_keys(cold) <= h.cold()
    assert h.planner.stats.cold_stored_keys == len(h.cold()) >= 4
    h.planner.request_finished(cold)
    assert full_keys(cold) <= h.cold()
    hot = Req(h.hasher, hot_id("h"), list(range(1000, 1016)))
    h.run(hot, 200)
    assert not full_keys(hot) & h.cold()
    again = Req(h.hasher, cold_id("a"), [*range(16), *range(2000, 2016)])
    assert h.run(again, 300) == 16
    assert not full_keys(cold) & h.cold()  # hit
    assert full_keys(again) - full_keys(cold) <= h.cold()


def test_nothing_is_stored_cold_without_a_clear_lead() -> None:
    h = Harness(200)
    h.bimodal_ahead(False)
    h.run(Req(h.hasher, cold_id("c"), list(range(16))), 100)
    assert h.planner.stats.cold_stored_keys == 0 and not h.cold()


def test_lru_and_arc_store_nothing_cold() -> None:
    for policy in ("lru", "arc"):
        h = Harness(200, policy=policy)
        assert h.planner.insertion is None  # no duel: nothing ever goes cold
        h.run(Req(h.hasher, cold_id("c"), list(range(16))), 100)
        assert h.planner.stats.cold_stored_keys == 0


def test_a_resume_point_is_not_stored_cold_and_a_preemption_warms_the_rest() -> None:
    """A full tier (room for 8 cold keys); a cold request is computed 12 tokens at a
    time: its resume point's window blocks are stored normally, its full-attention blocks
    cold. When it is preempted its cold blocks become normal, in the tier and in the
    bimodal directory (it reloads them on resuming); what it stores after resuming is
    cold again."""
    h = Harness(80)
    h.bimodal_ahead()
    h.run(Req(h.hasher, hot_id("f"), list(range(500, 660))), 100)  # 80 keys: full
    assert len(h.tier) == 80 and not h.cold()
    rid = cold_id("c")
    req = Req(h.hasher, rid, list(range(32)))
    assert h.planner.get_num_new_matched_tokens(req, 0).num_tokens == 0
    h.planner.update_state_after_alloc(req, ((1, 2, 3), (1, 2, 3)), 0)
    h.compute(req, (1, 2, 3), 0, 12)
    resume_window = {make_offload_key(req.block_hashes[k], 1) for k in (1, 2)}
    assert resume_window <= set(h.tier) and not resume_window & h.cold()
    first_three = {make_offload_key(req.block_hashes[k], 0) for k in range(3)}
    assert h.cold() == first_three
    duel = h.planner.insertion
    assert duel is not None and all(duel.bimodal.is_cold(key) for key in first_three)
    assert resume_window <= set(duel.bimodal)
    assert not any(duel.bimodal.is_cold(key) for key in resume_window)
    h.step(StepInput(preempted=(rid,)))
    assert not h.cold() and first_three <= set(h.tier)
    assert not any(duel.bimodal.is_cold(key) for key in first_three)
    assert h.planner.get_num_new_matched_tokens(req, 0).num_tokens == 12
    h.planner.update_state_after_alloc(req, ((1, 2, 3), (1, 2, 3)), 12)
    h.step(StepInput())  # the load
    h.compute(req, (1, 2, 3, 4, 5, 6, 7, 8), 12, 20)
    h.planner.request_finished(req)
    later = {make_offload_key(req.block_hashes[k], 0) for k in range(3, 7)}
    assert later & set(h.tier) and later & set(h.tier) <= h.cold()


def test_a_preemption_warms_cold_blocks_another_request_stored() -> None:
    """Two cold requests with a 16-token prefix in common run side by side: the first
    stores the prefix cold, the second finds it being stored and stores only its own
    blocks. When the second is preempted, the shared blocks it will reload become normal,
    in the tier and in the bimodal directory."""
    h = Harness(200, window=False)
    h.bimodal_ahead()
    first = Req(h.hasher, cold_id("a"), [*range(16), 100, 101, 102, 103])
    second = Req(h.hasher, cold_id("b"), [*range(16), *range(200, 216)])
    for req in (first, second):
        assert h.planner.get_num_new_matched_tokens(req, 0).num_tokens == 0
    h.planner.update_state_after_alloc(first, (tuple(range(1, 6)),), 0)
    h.planner.update_state_after_alloc(second, (tuple(range(11, 19)),), 0)
    h.compute(first, tuple(range(1, 6)), 0, 20)
    h.compute(second, tuple(range(11, 19)), 0, 32)
    shared = {make_offload_key(first.block_hashes[k], 0) for k in range(4)}
    assert shared <= h.cold()
    duel = h.planner.insertion
    assert duel is not None and all(duel.bimodal.is_cold(key) for key in shared)
    h.step(StepInput(preempted=(second.request_id,)))
    assert not shared & h.cold()
    assert not any(duel.bimodal.is_cold(key) for key in shared)
    own = {make_offload_key(first.block_hashes[k], 0) for k in range(4, 5)}
    assert own <= h.cold()  # the first request's own block stays cold


def test_bimodal_insertion_gets_hits_where_lru_insertion_thrashes() -> None:
    """32 two-block prefixes requested in turn, 12 rounds, room for 8 prefixes: LRU
    evicts every prefix before it comes back; bimodal insertion keeps the hot ones."""
    def hits(policy: str) -> int:
        h = Harness(16, policy=policy, window=False)
        total = 0
        for r in range(12):
            for p in range(32):
                tokens = [p * 100 + i for i in range(8)] + [r]
                total += h.run(Req(h.hasher, f"r{r}-p{p}", tokens, 8), 1 + 3 * p)
        return total

    assert hits("lru") == 0
    assert hits("value") >= 8 * 20


def test_the_directories_evict_first_what_the_planner_demotes() -> None:
    """A request with 8 prompt and 32 generated tokens finishes: the decode blocks no
    likely hit uses are demoted in the tier and in both shadow directories alike."""
    h = Harness(100)
    req = Req(h.hasher, "a", list(range(40)), num_prompt_tokens=8)
    h.run(req, 1)
    demoted = set(list(h.tier)[:5])
    assert {make_offload_key(req.block_hashes[k], 1) for k in range(2, 7)} == demoted
    duel = h.planner.insertion
    assert duel is not None
    assert set(list(duel.lru)[:5]) == demoted == set(list(duel.bimodal)[:5])


def hinted(h: Harness, rid: str, tokens: list[int], continues: bool | None,
           session_id: str | None = None) -> Req:
    req = Req(h.hasher, rid, tokens)
    h.planner.set_controls(req, RequestControls(continues=continues, session_id=session_id))
    return req


def test_a_continues_hint_decides_the_insertion_whatever_the_duel_says() -> None:
    """A request whose client says the conversation ends stores cold even while LRU
    insertion leads and the request is hot; one that goes on stores normally even while
    bimodal insertion leads and it is a cold candidate; without a hint the duel decides."""
    h = Harness(400)
    h.bimodal_ahead(False)
    ends = hinted(h, hot_id("e"), list(range(16)), continues=False)
    h.run(ends, 100)
    assert full_keys(ends) <= h.cold()
    h.bimodal_ahead()
    goes_on = hinted(h, cold_id("g"), list(range(1000, 1016)), continues=True)
    h.run(goes_on, 200)
    assert not full_keys(goes_on) & h.cold()
    learned = hinted(h, cold_id("n"), list(range(2000, 2016)), continues=None)
    h.run(learned, 300)
    assert full_keys(learned) <= h.cold()


def test_a_later_turn_of_a_known_session_stores_normally() -> None:
    """A session seen before is taken as continuing (``continues_hint``): its next turn's
    new blocks are not stored cold while bimodal insertion leads."""
    h = Harness(400)
    h.bimodal_ahead()
    first = hinted(h, cold_id("s1-"), list(range(16)), None, session_id="chat-1")
    h.run(first, 100)
    assert full_keys(first) <= h.cold()  # the first turn is learned: a cold candidate
    second = hinted(h, cold_id("s2-"), [*range(16), *range(500, 516)], None,
                    session_id="chat-1")
    assert h.run(second, 200) == 16
    assert not full_keys(second) & h.cold()


def test_hints_keep_the_conversation_that_comes_back() -> None:
    """Host memory for five requests' blocks (20); a conversation's first turn, then six
    one-off requests, then its second turn. With the clients' ``continues`` hints the
    one-offs go in cold and are evicted first, so the second turn hits its whole first
    turn; the same requests without hints (insertion by the duel, which has seen no
    lookup to prefer bimodal insertion) evict the first turn before it comes back."""
    def second_turn_hit(with_hints: bool) -> int:
        h = Harness(20, window=False)
        h.bimodal_ahead(False)
        hint = (lambda c: c) if with_hints else (lambda c: None)
        h.run(hinted(h, "turn-1", list(range(16)), hint(True)), 100)
        for i in range(6):
            h.run(hinted(h, f"once-{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 16)),
                         hint(False)), 200 + 10 * i)
        return h.run(hinted(h, "turn-2", [*range(16), *range(90, 94)], hint(False)), 400)

    assert second_turn_hit(with_hints=True) == 16
    assert second_turn_hit(with_hints=False) == 0


def test_a_hint_set_after_the_first_lookup_counts_for_later_stores() -> None:
    """``set_controls`` applies to what comes after it: a request looked up without a hint
    (the duel says normal) whose client then says the conversation ends stores what it
    computes from then on cold."""
    h = Harness(400)
    h.bimodal_ahead(False)
    req = Req(h.hasher, hot_id("late"), list(range(16)))
    assert h.planner.get_num_new_matched_tokens(req, 0).num_tokens == 0
    ids = tuple(range(100, 104))
    h.planner.update_state_after_alloc(req, (ids,) * h.num_groups, 0)
    h.compute(req, ids, 0, 8)
    first = {make_offload_key(hash_, 0) for hash_ in req.block_hashes[:2]}
    assert first <= set(h.tier) and not first & h.cold()
    h.planner.set_controls(req, RequestControls(continues=False))
    h.compute(req, ids, 8, 8)
    assert full_keys(req) - first <= h.cold() and not first & h.cold()
