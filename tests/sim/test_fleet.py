"""Simulated fleets (``kvoffload.sim.fleet``): one engine is the one-engine simulation,
engines share only what the shared tier holds, the routers send requests where they say."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvoffload.errors import ConfigError
from kvoffload.refengine.engine import ReferenceEngine
from kvoffload.sim import fleet as fleet_module
from kvoffload.sim.fleet import (
    PREFIX_ROUTE_TOKENS,
    FleetConfig,
    Router,
    route,
    run_fleet,
    simulate_fleet,
)
from kvoffload.sim.simulation import Mode, SimulationConfig, simulate
from kvoffload.workloads import WorkloadRequest, builtin_workload, derive_tokens

MiB = 1 << 20
GiB = 1 << 30

CHAT = builtin_workload("chat", 0, None)[:48]


def config(**kw: object) -> SimulationConfig:
    """A small accounting-mode gpt-oss-20b: 8k tokens of engine memory, 128 MiB of host."""
    base: dict[str, object] = dict(mode=Mode.ACCOUNTING, engine_tokens=8192,
                                   host_capacity_bytes=128 * MiB, decode_tokens_per_step=16)
    base.update(kw)
    return SimulationConfig(**base)  # type: ignore[arg-type]


def request(rid: str, prompt: list[int] | object, at: float, *, session: str | None = None,
            parent: str | None = None) -> WorkloadRequest:
    return WorkloadRequest(request_id=rid, arrival_s=at, prompt=prompt,  # type: ignore[arg-type]
                           output_length=4, session_id=session, parent_id=parent)


@pytest.mark.parametrize("router", list(Router))
@pytest.mark.parametrize("remote", [None, 1 * GiB])
def test_one_engine_is_the_single_engine_simulation(router: Router, remote: int | None) -> None:
    cfg = config(remote_capacity_bytes=remote)
    single = simulate(cfg, CHAT)
    fleet = simulate_fleet(FleetConfig(cfg, 1, router), CHAT)
    assert fleet.baseline is not None and single.baseline is not None
    for one, run in ((single.offload, fleet.offload), (single.baseline, fleet.baseline)):
        (engine,) = run.engines
        assert (engine.engine_hit_tokens, engine.host_hit_tokens, engine.tier_hit_rates,
                engine.prefill_tokens_computed, engine.steps) == (
                one.engine_hit_tokens, one.host_hit_tokens, one.tier_hit_rates,
                one.prefill_tokens_computed, one.steps)
        assert run.totals.prefill_tokens_saved == one.prefill_tokens_saved
        assert run.totals.ttft.mean == pytest.approx(one.ttft.mean)
    assert fleet.offload.totals.host_hit_tokens > 0  # the comparison is not vacuous


SAME = derive_tokens("fleet/same-prompt", 256)
"""One prompt sent three times: to engine 0, engine 1, engine 0 (round robin). Short: an
idle engine steps once per promote that lands, and a lookup waits for promotes at most
``max_deferred_steps`` (64) steps; 16 blocks of 2 groups land within that."""

THRICE = [request("a", SAME, 0.0), request("b", SAME, 10.0), request("c", SAME, 20.0)]


def engine_hits(run: fleet_module.FleetRun, engine: int) -> dict[str, int]:
    summary = run.engines[engine]
    return {"device": summary.engine_hit_tokens, **run.engine_tier_tokens[engine]}


def test_round_robin_without_a_shared_tier_never_hits_the_other_engine() -> None:
    run = run_fleet(FleetConfig(config(), 2, Router.ROUND_ROBIN), THRICE)
    assert run.routed == (2, 1)
    assert run.engines[1].prefill_tokens_saved == 0  # b: nothing of a's, device or host
    assert engine_hits(run, 1) == {"device": 0}
    assert run.engines[0].prefill_tokens_saved > 0  # c hits what a left on engine 0


def test_with_the_shared_tier_engine_b_hits_what_engine_a_stored() -> None:
    run = run_fleet(FleetConfig(config(remote_capacity_bytes=1 * GiB), 2,
                                Router.ROUND_ROBIN), THRICE)
    hits = engine_hits(run, 1)
    assert hits["device"] == 0 and hits.get("host", 0) == 0
    assert hits["remote"] >= 256 - 16  # a's blocks (the last one may be recomputed)
    assert run.shared_blocks > 0 and run.deferral_timeouts == (0, 0)


def test_prefix_router_keeps_a_shared_prefix_on_one_engine() -> None:
    head = derive_tokens("fleet/conversation-7", PREFIX_ROUTE_TOKENS)
    turns = [request(f"t{i}", head + derive_tokens(f"fleet/turn-{i}", 100 + i), i)
             for i in range(12)]
    others = [request(f"o{i}", derive_tokens(f"fleet/other-{i}", PREFIX_ROUTE_TOKENS + 8), i)
              for i in range(64)]
    for engines in (2, 4, 8):
        assert len({route(Router.PREFIX, i, r, engines) for i, r in enumerate(turns)}) == 1
        assert len({route(Router.PREFIX, i, r, engines)
                    for i, r in enumerate(others)}) == engines  # distinct prefixes spread
        assert [route(Router.ROUND_ROBIN, i, r, engines) for i, r in enumerate(turns)] == [
            i % engines for i in range(12)]
    # A session id, where the workload names one, is the key: a conversation stays put.
    chat = [r for r in CHAT if r.session_id == CHAT[0].session_id]
    assert len(chat) > 1
    assert len({route(Router.PREFIX, i, r, 4) for i, r in enumerate(chat)}) == 1
    run = run_fleet(FleetConfig(config(), 4, Router.PREFIX), turns)
    assert sorted(run.routed) == [0, 0, 0, 12]
    assert run.totals.prefill_tokens_saved >= 11 * PREFIX_ROUTE_TOKENS


@pytest.fixture
def engines_of_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ReferenceEngine]]:
    """The engines every ``run_fleet`` of the test built."""
    built: list[ReferenceEngine] = []
    build = fleet_module.build_fleet

    def keep(*args: object, **kw: object) -> object:
        engines, store = build(*args, **kw)  # type: ignore[arg-type]
        built.extend(engines)
        return engines, store

    monkeypatch.setattr(fleet_module, "build_fleet", keep)
    yield built


def test_a_turn_waits_for_its_parent_on_another_engine(
        engines_of_runs: list[ReferenceEngine]) -> None:
    run = run_fleet(FleetConfig(config(remote_capacity_bytes=1 * GiB), 4,
                                Router.ROUND_ROBIN), CHAT)
    assert run.totals.requests == len(CHAT)
    records = {r.request_id: r for e in engines_of_runs for r in e.metrics.records}
    parents = [(r.request_id, r.parent_id) for r in CHAT if r.parent_id in records]
    assert parents
    for child, parent in parents:
        finish = records[parent].finish_s
        assert finish is not None and records[child].arrival_s >= finish


def test_fleet_config_refuses_what_it_does_not_model() -> None:
    with pytest.raises(ConfigError, match="engines"):
        FleetConfig(config(), 0)
    with pytest.raises(ConfigError, match="engines"):
        FleetConfig(config(), 65)
    with pytest.raises(ConfigError, match="accounting"):
        FleetConfig(config(mode=Mode.BYTES), 2)
    with pytest.raises(ConfigError, match="real ones"):
        FleetConfig(config(remote_url="redis://127.0.0.1:6379/0"), 2)
