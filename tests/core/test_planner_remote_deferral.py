"""Deferred lookups that wait on a remote tier's existence checks.

An idle engine steps every few hundred microseconds, far faster than a server answers:
a lookup that waits on answers the remote tier has asked for and not heard back on must
keep waiting for them, bounded by the remote call's own timeout in seconds, not by
``max_deferred_steps``; and a server that never answers must still let the lookup give up
at that deadline (the request recomputes).

The stories drive the real ``Planner`` over a ``CascadeTier`` (host memory + the real
``RemoteIndex``, whose background thread sends its existence checks) with a scripted
server in place of redis-py: its pipelined ``EXISTS`` blocks until the test lets it
answer. The planner's clock is a fake one, so "many fast steps" take no wall time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from planner_kit import Harness, Req, full, make_config, mamba, prompt

from kvoffload.jobs import TierOp, WorkerReport
from kvoffload.keys import OffloadKey
from kvoffload.planner import planner as planner_module
from kvoffload.planner.contract import MatchResult
from kvoffload.policies import cache_policy
from kvoffload.tiers.cascade import CascadeTier
from kvoffload.tiers.config import RemoteTierConfig
from kvoffload.tiers.naming import remote_key
from kvoffload.tiers.remote import RemoteIndex

DEFER = MatchResult(None)
MISS = MatchResult(0, load_async=False)
NS = "ns"
TIMEOUT_S, CONNECT_S = 1.0, 0.5  # the remote call's bound: 1.5 s


class LateServer:
    """A Redis stand-in holding ``names``; every pipelined round trip waits until
    ``answer`` is set. ``calls``: round trips started."""

    def __init__(self) -> None:
        self.names: set[bytes] = set()
        self.answer = threading.Event()
        self.calls = 0

    def client(self) -> Any:
        return _Client(self)


class _Pipe:
    def __init__(self, server: LateServer) -> None:
        self.server = server
        self.asked: list[tuple[bytes, ...]] = []

    def exists(self, *names: bytes) -> None:
        self.asked.append(names)

    def execute(self) -> list[int]:
        self.server.calls += 1
        self.server.answer.wait()
        return [sum(name in self.server.names for name in names) for names in self.asked]


class _Pool:
    def disconnect(self) -> None:
        pass


class _Client:
    def __init__(self, server: LateServer) -> None:
        self.server = server
        self.connection_pool = _Pool()

    def pipeline(self, transaction: bool = False) -> _Pipe:
        assert transaction is False
        return _Pipe(self.server)

    def close(self) -> None:
        pass


class RemoteHarness(Harness):
    """``Harness`` whose planner runs over host memory + a remote tier on ``server``."""

    def __init__(self, server: LateServer, clock: list[float]) -> None:
        super().__init__(make_config(full(), mamba(), max_deferred=3))
        settings = RemoteTierConfig("redis://127.0.0.1:1/0", timeout_s=TIMEOUT_S,
                                    connect_timeout_s=CONNECT_S)
        self.remote = RemoteIndex(self.config, settings, NS, client_factory=server.client,
                                  clock=lambda: clock[0])
        self.cascade = CascadeTier(self.tier, [self.remote])
        self.planner = planner_module.Planner(self.config, self.cascade,
                                              cache_policy(self.config.eviction_policy),
                                              clock=lambda: clock[0])
        self.server = server

    def on_server(self, keys: list[OffloadKey]) -> None:
        self.server.names.update(remote_key(NS, 0, key) for key in keys)


@pytest.fixture
def clock() -> list[float]:
    """The fake time ``RemoteHarness`` gives the planner and the index, in seconds (the
    index's thread and its waits keep the real one)."""
    return [100.0]


@pytest.fixture
def late() -> Iterator[LateServer]:
    server = LateServer()
    yield server
    server.answer.set()  # let the index's thread finish its round trip


def stored_prefix(h: RemoteHarness) -> Req:
    """A 25-token prompt whose 6 full-attention blocks and Mamba state at token 16 (its
    block 3: a state exists only where a step ended) another engine stored on the server;
    host memory holds none of it."""
    req = h.request("b", [*prompt(24), 9])
    h.on_server(h.keys(req, 0, range(6)))
    h.on_server(h.keys(req, 1, [3]))
    return req


def test_late_answers_after_many_fast_steps_still_hit(
        clock: list[float], late: LateServer) -> None:
    h = RemoteHarness(late, clock)
    try:
        req = stored_prefix(h)
        # The server takes 1.2 s to answer; the engine asks again every 0.5 ms meanwhile:
        # 2400 steps, far past max_deferred_steps (3).
        for _ in range(2400):
            assert h.lookup(req) == DEFER
            h.step()
            clock[0] += 0.0005
        assert late.calls >= 1
        assert h.planner.stats.deferral_timeouts == 0
        late.answer.set()
        assert h.remote.wait_idle()
        # The answers are in: the full-attention blocks and the state at 16 are on the
        # server; the lookup asks for them to be promoted and waits (now by steps).
        assert h.lookup(req) == DEFER
        plan = h.step()
        promotes = [job for job in plan.tier_jobs if job.op is TierOp.PROMOTE]
        wanted = {*h.keys(req, 0, range(4)), h.key(req, 1, 3)}
        assert {bytes(job.key) for job in promotes} == wanted
        h.planner.update_from_worker_reports(
            [WorkerReport(0, tier_finished=tuple(job.job_id for job in promotes))])
        assert h.lookup(req) == MatchResult(16, load_async=True)
        assert h.planner.stats.deferral_timeouts == 0
    finally:
        late.answer.set()
        h.cascade.close()


def test_a_server_that_never_answers_gives_up_at_the_call_timeout(
        clock: list[float], late: LateServer) -> None:
    h = RemoteHarness(late, clock)
    try:
        req = stored_prefix(h)
        assert h.lookup(req) == DEFER
        first = clock[0]
        while clock[0] - first < TIMEOUT_S + CONNECT_S - 0.01:
            clock[0] += 0.001
            assert h.lookup(req) == DEFER  # the check is still outstanding
        assert h.planner.stats.deferral_timeouts == 0
        clock[0] = first + TIMEOUT_S + CONNECT_S + 0.001
        assert h.lookup(req) == MISS  # the deadline passed: recompute
        assert h.planner.stats.deferral_timeouts == 1
        assert h.remote.answer_wait_s(h.key(req, 0, 0)) == TIMEOUT_S + CONNECT_S
    finally:
        late.answer.set()
        h.cascade.close()
