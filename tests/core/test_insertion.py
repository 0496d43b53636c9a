"""Bimodal insertion and the duel that chooses it (``kvoffload.planner.insertion``):
shadow directories keep their budget and order, bimodal insertion survives a cyclic
pattern that thrashes LRU insertion, the duel picks the directory that serves more, and
the planner inserts a request's blocks cold only while bimodal insertion is clearly ahead,
never the blocks a preempted request would resume from."""

from __future__ import annotations

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import WorkerReport
from kvoffload.keys import BlockHash, BlockHasher, OffloadKey, make_offload_key
from kvoffload.planner.contract import ScheduledRequest, StepInput
from kvoffload.planner.insertion import (
    DECAY,
    HOT_EVERY,
    InsertionDuel,
    ShadowDirectory,
    is_hot_request,
)
from kvoffload.planner.planner import Planner
from kvoffload.tiers.cpu import HostTier


def k(i: int) -> OffloadKey:
    return make_offload_key(BlockHash(i.to_bytes(16, "big")), 0)


def test_a_shadow_keeps_its_budget_and_evicts_cold_keys_first() -> None:
    shadow = ShadowDirectory(budget=10)
    assert shadow.insert([(k(1), 4), (k(2), 4), (k(3), 2)]) == [k(1), k(2), k(3)]
    shadow.cool([k(3)])
    assert shadow.used == 10
    assert shadow.insert([(k(4), 2), (k(1), 4)]) == [k(4)]  # room from the front: k(3)
    assert k(3) not in shadow and shadow.used == 10
    shadow.insert([(k(5), 4)])  # then the least recent normal key
    assert k(1) not in shadow and k(2) in shadow and shadow.used == 10
    assert shadow.insert([(k(6), 11)]) == []  # larger than the budget: never held


def test_a_shadow_lookup_counts_held_keys_in_a_row_and_refreshes_them() -> None:
    shadow = ShadowDirectory(budget=4)
    shadow.insert([(k(i), 1) for i in range(4)])
    assert shadow.lookup([k(0), k(1), k(9), k(3)], start=1) == 1
    shadow.insert([(k(7), 1), (k(8), 1)])  # evicts 2 and 3, not 0 and 1
    assert [key in shadow for key in (k(0), k(1), k(2), k(3))] == [True, True, False, False]


def cycle(duel: InsertionDuel, prefixes: int, rounds: int) -> None:
    """Requests cycling over ``prefixes`` one-block prefixes, each stored after its
    lookup and finishing right after; request ids make every HOT_EVERY-th request hot
    under bimodal insertion."""
    n = 0
    for _ in range(rounds):
        for p in range(prefixes):
            rid = next(f"r{n}-{j}" for j in range(10**6) if is_hot_request(f"r{n}-{j}")
                       == (p % HOT_EVERY == 0))
            n += 1
            duel.observe_lookup([k(p)], 0, served=0)
            duel.observe_store([(k(p), 1)], rid)
            duel.observe_finish(rid)


def test_bimodal_insertion_wins_where_lru_insertion_thrashes() -> None:
    duel = InsertionDuel(budget=8, block_tokens=16)
    cycle(duel, prefixes=32, rounds=20)  # reuse distance 32 blocks, room for 8
    assert duel.lru_score == 0
    assert duel.bimodal_ahead
    assert not duel.inserts_hot(next(f"x{i}" for i in range(100)
                                     if not is_hot_request(f"x{i}")))


def test_lru_insertion_is_kept_when_everything_fits() -> None:
    duel = InsertionDuel(budget=64, block_tokens=16)
    cycle(duel, prefixes=32, rounds=20)
    assert duel.lru_score > 0 and not duel.bimodal_ahead
    assert all(duel.inserts_hot(f"x{i}") for i in range(50))


def test_about_one_request_in_hot_every_is_hot() -> None:
    hot = sum(is_hot_request(f"req-{i}") for i in range(8000))
    assert abs(hot - 8000 / HOT_EVERY) < 150
    # Stable across processes and runs (a CRC of the id, not Python's salted hash).
    assert [i for i in range(64) if is_hot_request(f"req-{i}")] == [5, 10, 27, 33, 38, 46,
                                                                      52, 59]


def value_planner(capacity: int) -> tuple[BlockHasher, HostTier, Planner, InsertionDuel]:
    """Full attention + a window of 8 tokens under the value policy, a tier of
    ``capacity`` keys, and the planner's insertion duel."""
    cfg = OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),
                                GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8)),
                        hash_block_size=4, host_capacity_bytes=capacity,
                        eviction_policy="value")
    tier = HostTier(cfg)
    planner = Planner(cfg, tier)
    assert planner.insertion is not None
    return BlockHasher(4), tier, planner, planner.insertion


def test_the_planner_makes_a_cold_request_cold_when_it_finishes() -> None:
    """Full attention + a window of 8 tokens; a full value tier. With bimodal insertion
    clearly ahead, a cold request's new blocks stay normal while it runs (a preemption
    would reload them) and go before the older normal ones when it finishes; a hot
    request's do not; without a clear lead nothing goes cold."""
    hasher, tier, planner, duel = value_planner(24)

    class Req:
        def __init__(self, rid: str, first_token: int) -> None:
            self.request_id = rid
            self.num_prompt_tokens = self.num_tokens = 16
            self.block_hashes = hasher.hashes(list(range(first_token, first_token + 16)))

    def run(rid: str, first_token: int, first_id: int, finish: bool = True) -> Req:
        req = Req(rid, first_token)
        assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 0
        table = tuple(range(first_id, first_id + 4))
        planner.update_state_after_alloc(req, (table, table), 0)
        planner.build_step_plan(StepInput((ScheduledRequest(
            req, (table, table), 0, 16, num_freed_blocks=(0, 0)),)))
        if finish:
            planner.request_finished(req)
        return req

    def front() -> set[OffloadKey]:
        return set(list(tier)[:8])

    def full_keys(req: Req) -> set[OffloadKey]:
        return {make_offload_key(h, 0) for h in req.block_hashes}

    run("warm", 1000, 100)
    run("warm2", 2000, 200)  # the tier (24 keys) is full from here on
    cold_id = next(f"c{i}" for i in range(100) if not is_hot_request(f"c{i}"))
    hot_id = next(f"h{i}" for i in range(100) if is_hot_request(f"h{i}"))
    duel.lru_score, duel.bimodal_score = 0.0, 1.0  # bimodal clearly ahead
    cold = run(cold_id, 3000, 300, finish=False)
    assert not full_keys(cold) & front() and planner.stats.cold_stored_keys == 0
    planner.request_finished(cold)
    n = planner.stats.cold_stored_keys
    assert n >= 4 and full_keys(cold) <= set(list(tier)[:n])  # all of it, at the front
    hot = run(hot_id, 4000, 400)
    assert not full_keys(hot) & front()
    before = planner.stats.cold_stored_keys
    duel.lru_score, duel.bimodal_score = 1.0, 1.0  # no clear lead: LRU insertion
    run(next(f"d{i}" for i in range(100) if not is_hot_request(f"d{i}")), 5000, 500)
    assert planner.stats.cold_stored_keys == before


def test_the_directories_evict_first_what_the_planner_demotes() -> None:
    """A request with 8 prompt and 32 generated tokens finishes: the decode blocks no
    likely hit uses are demoted in the tier and in both shadow directories alike."""
    hasher, tier, planner, duel = value_planner(100)

    class Req:
        request_id = "a"
        num_prompt_tokens, num_tokens = 8, 40
        block_hashes = hasher.hashes(list(range(40)))

    assert planner.get_num_new_matched_tokens(Req, 0).num_tokens == 0
    table = tuple(range(1, 11))
    planner.update_state_after_alloc(Req, (table, table), 0)
    planner.build_step_plan(StepInput((ScheduledRequest(
        Req, (table, table), 0, 40, num_freed_blocks=(0, 0)),)))
    planner.request_finished(Req)
    demoted = set(list(tier)[:5])
    assert {make_offload_key(Req.block_hashes[k], 1) for k in range(2, 7)} == demoted
    assert set(list(duel.lru)[:5]) == demoted == set(list(duel.bimodal)[:5])


def test_a_preempted_cold_request_still_goes_cold_and_only_cold_keys_are_counted() -> None:
    """Bimodal insertion ahead; a cold request is preempted after 12 tokens and resumes
    (its re-lookup must not count as a use of its own keys): at finish every key it
    stored goes cold, and the count says so; cooling them again counts none."""
    hasher, tier, planner, duel = value_planner(200)
    duel.lru_score, duel.bimodal_score = 0.0, 1.0
    rid = next(f"c{i}" for i in range(100) if not is_hot_request(f"c{i}"))

    class Req:
        request_id = rid
        num_prompt_tokens = num_tokens = 32
        block_hashes = hasher.hashes(list(range(32)))

    def run(step: StepInput) -> None:
        plan = planner.build_step_plan(step)
        planner.update_from_worker_reports(
            [WorkerReport(0, tuple(j.job_id for j in plan.stores + plan.loads))])

    def compute(ids: tuple[int, ...], computed: int, scheduled: int) -> None:
        run(StepInput((ScheduledRequest(Req, (ids, ids), computed, scheduled,
                                        num_freed_blocks=(0, 0)),)))

    assert planner.get_num_new_matched_tokens(Req, 0).num_tokens == 0
    planner.update_state_after_alloc(Req, ((1, 2, 3), (1, 2, 3)), 0)
    compute((1, 2, 3), 0, 12)
    planner.build_step_plan(StepInput(preempted=(rid,)))
    assert planner.get_num_new_matched_tokens(Req, 0).num_tokens == 12
    planner.update_state_after_alloc(Req, ((1, 2, 3), (1, 2, 3)), 12)
    run(StepInput())  # the load
    compute((4, 5, 6, 7, 8), 12, 20)
    planner.request_finished(Req)
    assert planner.stats.cold_stored_keys == len(tier) > 0  # every key it stored
    assert tier.cool(list(tier)) == 0  # cold already


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
