"""The oracle reference policy: its future (``sim.oracle.future``), that it uses the future only
through its rule, that it cannot be configured outside the simulator, and that it does
at least as well as LRU where LRU has hits to lose."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace

import pytest

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.keys import BlockHasher, OffloadKey, make_offload_key
from kvoffload.offload import build_offload
from kvoffload.planner.state import RequestState
from kvoffload.planner.store_policy import StorePolicy, StoreSelection
from kvoffload.policies import (
    RESERVED_NAMES,
    CachePolicy,
    cache_policy,
    cache_policy_names,
    register_cache_policy,
)
from kvoffload.sim.oracle.binding import OracleRun
from kvoffload.sim.oracle.eviction import OraclePolicy
from kvoffload.sim.oracle.future import NO_USE, WorkloadFuture
from kvoffload.sim.oracle.store import OracleStorePolicy
from kvoffload.sim.simulation import Mode, SimulationConfig, build_engine, resolve, run_one
from kvoffload.tiers.eviction.base import BlockState, Victims
from kvoffload.workloads.generators import builtin_workload
from kvoffload.workloads.request import WorkloadRequest, derive_tokens

# -------------------------------------------------------------------- the future


def _config(*groups: GroupSpec, factor: int = 1) -> OffloadConfig:
    return OffloadConfig(groups=groups, hash_block_size=4, block_size_factor=factor,
                         host_capacity_bytes=100, eviction_policy="lru")


FULL = GroupSpec(GroupKind.FULL_ATTENTION, 4)
MAMBA = GroupSpec(GroupKind.MAMBA, 4)
WINDOW = GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8)


def _request(rid: str, tokens: Sequence[int], output: int = 4) -> WorkloadRequest:
    return WorkloadRequest(rid, 0.0, array("i", tokens), output)


def test_future_hit_ends_and_uses_follow_the_planner_rules() -> None:
    config = _config(FULL, WINDOW, MAMBA)
    base = list(range(100, 124))  # 6 blocks of 4
    requests = [_request("a", base), _request("b", base[:16] + [7] * 8),
                _request("c", [9] * 12), _request("d", [*base, 1, 2, 3, 4, 5])]
    future = WorkloadFuture.build(requests, config)
    hashes = BlockHasher(4).hashes(base)
    # b shares a's first 16 tokens; c shares nothing; d shares all 24 (its hit stops at the
    # last token it must recompute: 28 tokens, minus one, rounded down to 4 -> 24).
    assert [future.hit_end(i) for i in range(4)] == [0, 16, 0, 24]
    full = [make_offload_key(h, 0) for h in hashes]
    window = [make_offload_key(h, 1) for h in hashes]
    mamba = [make_offload_key(h, 2) for h in hashes]
    # b reads every full block before 16, the window's last two blocks, the state at 16.
    assert list(future.keys_used_by(1)) == [*full[:4], *window[2:4], mamba[3]]
    assert future.uses(full[0]) == [1, 3]
    assert future.uses(mamba[3]) == [1] and future.uses(mamba[5]) == [3]
    assert future.next_use(full[0], 1) == 3 and future.next_use(full[0], 3) == NO_USE
    assert future.depth(full[3]) == 16
    assert future.hits_later(0, 16) and future.hits_later(0, 24)
    assert not future.hits_later(0, 20) and not future.hits_later(1, 16)
    assert future.reach(0) == 24 and future.reach(2) == 0


def test_future_counts_given_outputs_and_not_the_last_decode_step() -> None:
    config = _config(FULL)
    prompt = list(range(10, 22))
    given = WorkloadRequest("a", 0.0, array("i", prompt), 8,
                            output_tokens=array("i", range(50, 58)))
    nxt = _request("b", prompt + list(range(50, 58)) + [1, 2, 3, 4])
    # Full attention only: nothing recomputed at the end; the whole 20-token context is
    # there, unless the last decode step's 4 tokens are never stored.
    assert WorkloadFuture.build([given, nxt], config).hit_end(1) == 20
    assert WorkloadFuture.build([given, nxt], config, unstored_tail=4).reach(0) >= 16


def test_future_counts_a_hit_the_modelled_engine_cache_serves_as_the_engines() -> None:
    config = _config(FULL)
    base = list(range(100, 116))
    requests = [_request("a", base), _request("b", [*base, 1, 2, 3, 4, 5]),
                _request("c", [7] * 40), _request("d", [*base, 9, 9, 9, 9, 9])]
    key = make_offload_key(BlockHasher(4).hashes(base)[0], 0)
    # An engine of 48 tokens still holds a's 16 when b comes: b reads them from it. c's 40
    # tokens push a's out, so d reads them from a tier.
    future = WorkloadFuture.build(requests, config, engine_tokens=48)
    assert future.engine_uses(key) == [1] and future.uses(key) == [3]
    assert future.hit_end(1) == 16 and future.hit_end(3) == 16
    # Not modelled: every hit is a tier's.
    plain = WorkloadFuture.build(requests, config)
    assert list(plain.uses(key)) == [1, 3] and not plain.engine_uses(key)


def test_future_rejects_repeated_ids() -> None:
    with pytest.raises(ValueError, match="unique"):
        WorkloadFuture.build([_request("a", [1] * 8), _request("a", [2] * 8)], _config(FULL))


# ------------------------------------------------------------- selection rules


def test_oracle_is_a_simulator_only_reference() -> None:
    assert "oracle" not in cache_policy_names()
    assert "oracle" in RESERVED_NAMES
    with pytest.raises(ConfigError, match="simulator-only reference"):
        cache_policy("oracle")
    with pytest.raises(ConfigError, match="simulator-only reference"):
        build_offload(OffloadConfig(groups=(FULL,), hash_block_size=4, host_capacity_bytes=100,
                                    eviction_policy="oracle"))
    with pytest.raises(ConfigError, match="future"):
        build_engine(SimulationConfig(mode=Mode.ACCOUNTING, eviction_policy="oracle"))
    with pytest.raises(ValueError, match="reserved"):
        register_cache_policy("oracle", OraclePolicy)


# ------------------------------------------------- eviction by the future, unit


class _Clock:
    def __init__(self, next_use: dict[OffloadKey, int], depth: dict[OffloadKey, int]) -> None:
        self.now = 0
        self._next = next_use
        self._depth = depth
        self.listeners: list = []

    def next_use(self, key: OffloadKey) -> int:
        return self._next.get(key, NO_USE)

    def depth(self, key: OffloadKey) -> int:
        return self._depth.get(key, 0)

    def subscribe(self, listener) -> None:  # type: ignore[no-untyped-def]
        self.listeners.append(listener)


def _key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(bytes([i]) * 16, group)  # type: ignore[arg-type]


def test_oracle_eviction_takes_furthest_next_use_per_byte() -> None:
    a, b, c, d = _key(1), _key(2), _key(3), _key(4, group=1)
    clock = _Clock({a: 5, b: 2, c: 9, d: 4}, {a: 8, b: 8, c: 8, d: 8})
    policy = OraclePolicy(10, clock)
    for k in (a, b, c, d):
        policy.insert(k, BlockState(0, ref=0, group=k[-1]))
    policy.insert(_key(5), BlockState(1, ref=0))  # no later use: first
    assert [k for k, _ in policy.evict(2, frozenset()) or []] == [_key(5), c]
    # By bytes: d (group 1) is 4 times a's size: (4 - 0 + 1) * 4 > (5 - 0 + 1) * 1.
    sizes = {0: 1, 1: 4}
    got = policy.evict_bytes(1, 1, frozenset(), lambda k: sizes[k[-1]])
    assert [k for k, _ in got] == [d]
    # Pinned and protected keys stay; evict is atomic.
    policy.get(a).ref = 1  # type: ignore[union-attr]
    assert policy.evict(2, frozenset({b})) is None and len(policy) == 2
    assert [k for k, _ in policy.evict(1, frozenset()) or []] == [b]
    # A start rescoring a key moves it: a's next use is now far away.
    policy.get(a).ref = 0  # type: ignore[union-attr]
    policy.insert(b, BlockState(2, ref=0))
    clock._next[a] = 50
    for listener in clock.listeners:
        listener([a])
    assert [k for k, _ in policy.evict(1, frozenset()) or []] == [a]
    policy.check_integrity()


# ------------------------------------------------ the future used only by its rule


ENGINE = SimulationConfig(preset="gemma3-27b", mode=Mode.ACCOUNTING, block_size=64,
                          block_size_factor=1, engine_tokens=12288, baseline=False,
                          host_accounting="bytes", decode_tokens_per_step=16, eviction_policy="lru")


def _conversation(label: str, turns: int, start_s: float, base: Sequence[int] = ()
                  ) -> list[WorkloadRequest]:
    prompt = array("i", base) if base else derive_tokens(f"{label}/system", 1500)
    out = []
    for turn in range(turns):
        prompt = prompt + derive_tokens(f"{label}/turn{turn}", 700)
        out.append(WorkloadRequest(f"{label}-{turn}", start_s + 2.0 * turn, prompt, 16))
    return out


EARLY = sorted([r for i, label in enumerate("abcdef")
                for r in _conversation(label, 4, 0.3 * i)], key=lambda r: r.arrival_s)
"""Six interleaved conversations; every later part of a workload below arrives long after
they end."""

LATER_S = 10_000.0


class _LoggedStore(OracleStorePolicy):
    def __init__(self, run: OracleRun, log: list[tuple[str, object]],
                 later: AbstractSet[str]) -> None:
        super().__init__(run)
        self._log = log
        self._later = later

    def first_lookup(self, st: RequestState, num_computed_tokens: int, hit_end: int) -> None:
        if st.request.request_id in self._later:
            self._log.append(("later", st.request.request_id))
        super().first_lookup(st, num_computed_tokens, hit_end)

    def select(self, st: RequestState, offloadable: int) -> StoreSelection:
        inner = super().select(st, offloadable)
        log = self._log

        class Logged(StoreSelection):
            def admit(self, group, block, key):  # type: ignore[no-untyped-def]
                verdict = inner.admit(group, block, key)
                log.append(("admit", (key, verdict)))
                return verdict

        return Logged()


class _LoggedEviction(OraclePolicy):
    log: list[tuple[str, object]]

    def evict_bytes(self, need_bytes, need_keys, protected, size_of) -> Victims:  # type: ignore[no-untyped-def]
        victims = super().evict_bytes(need_bytes, need_keys, protected, size_of)
        self.log.append(("evict", tuple(k for k, _ in victims)))
        return victims


def _logged_oracle(requests: list[WorkloadRequest], later: AbstractSet[str]
                   ) -> tuple[CachePolicy, list[tuple[str, object]], WorkloadFuture]:
    future = WorkloadFuture.build(requests, resolve(ENGINE, ENGINE.layout())[1],
                                  unstored_tail=ENGINE.decode_tokens_per_step)
    run = OracleRun(future)
    log: list[tuple[str, object]] = []

    def eviction(capacity: int) -> OraclePolicy:
        policy = _LoggedEviction(capacity, run)
        policy.log = log
        return policy

    def store(context: object) -> StorePolicy:
        return _LoggedStore(run, log, later)

    return CachePolicy("oracle-logged", eviction, store), log, future


def _decisions(later: list[WorkloadRequest], capacity: int
               ) -> tuple[list[tuple[str, object]], WorkloadFuture]:
    """The oracle's admission verdicts and evictions until the first later request
    starts, and the future it ran with."""
    requests = EARLY + later
    policy, log, future = _logged_oracle(requests, {r.request_id for r in later})
    run_one(replace(ENGINE, host_capacity_bytes=capacity), requests, policy=policy)
    cut = next((i for i, (kind, _) in enumerate(log) if kind == "later"), len(log))
    return log[:cut], future


CAPACITY = 2800 << 20
"""Host memory holding a fraction of the early conversations (evictions happen)."""


def test_a_future_that_shares_nothing_with_the_past_changes_no_decision() -> None:
    one, _ = _decisions(_conversation("x", 3, LATER_S), CAPACITY)
    other, _ = _decisions(_conversation("y", 2, LATER_S), CAPACITY)
    assert any(kind == "evict" for kind, _ in one), "the capacity must force evictions"
    assert any(kind == "admit" and not v[1] for kind, v in one)  # type: ignore[index]
    assert one == other


def test_only_decisions_about_keys_the_changed_future_uses_change() -> None:
    plain, plain_future = _decisions(_conversation("x", 3, LATER_S), CAPACITY)
    # The changed future continues conversation a: its later turns reuse a's prefix.
    again, again_future = _decisions(
        _conversation("a2", 2, LATER_S, base=EARLY[3].prompt), CAPACITY)
    assert plain != again  # the oracle does use what it knows
    first = next(i for i, (x, y) in enumerate(zip(plain, again, strict=False)) if x != y)
    assert plain[:first] == again[:first]
    kind, what = again[first]
    keys = [what[0]] if kind == "admit" else list(what)  # type: ignore[index]
    keys += [plain[first][1][0]] if plain[first][0] == "admit" else list(plain[first][1])  # type: ignore[index,arg-type]
    later_start = len(EARLY)
    assert any(
        [u for u in plain_future.uses(k) if u >= later_start]
        != [u for u in again_future.uses(k) if u >= later_start] for k in keys), \
        "the first decision that changed is about a key whose later uses changed"


# ------------------------------------------------------------ against LRU


def test_oracle_hits_at_least_as_much_as_lru_at_small_capacities() -> None:
    requests = builtin_workload("agentic", 0, 4)
    config = replace(ENGINE, preset="nemotron-h-8b", block_size=None, engine_tokens=32768)
    unbounded = run_one(replace(config, eviction_policy="lru", host_capacity_bytes=1 << 50),
                        requests)
    compared = 0
    for share in (0.05, 0.1, 0.2):
        capacity = int(share * unbounded.host_bytes_peak)
        lru = run_one(replace(config, eviction_policy="lru", host_capacity_bytes=capacity),
                      requests)
        oracle = run_one(replace(config, eviction_policy="oracle",
                                 host_capacity_bytes=capacity), requests)
        assert oracle.host_hit_rate >= lru.host_hit_rate, share
        compared += lru.host_hit_rate > 0
    assert compared >= 2, "LRU must have hits to lose at two of the capacities"


def test_the_oracle_refuses_a_draft_group() -> None:
    lagged = GroupSpec(GroupKind.FULL_ATTENTION, 4, proof_tokens=3, name="draft")
    with pytest.raises(ConfigError, match="draft model") as info:
        WorkloadFuture.build([_request("a", [1] * 8)], _config(FULL, lagged))
    assert info.value.field == "proof_tokens"
