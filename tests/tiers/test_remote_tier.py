"""The remote tier end to end against a real ``redis-server`` (started per test on a free
loopback port): the real planner, a ``CascadeTier``, two real worker ranks with tier I/O.
The engine checks every loaded block byte for byte.

Stories: two engine processes share a prefix through the server, and an engine of another
model sees none of it; the server killed in the middle of a run costs no crash and no
wrong byte, and hits resume once it is back; a hung server is skipped the same way; a
corrupted value is a miss; the scheduler's existence checks are asynchronous, cached, and
back off from a dead server.

No assertion rests on a short wall-clock window (a loaded machine stretches any of them):
the index's answer TTL and retry interval run on a fake clock, a hung server is held
until the engine has stepped far past its step bound rather than for a fixed time, a
recovery gets a counted number of tries, and the one upper bound left on wall time (a
hung server costs seconds, not a hang) is far above the timeouts it checks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import subprocess
import sys
import time

import pytest

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.keys import make_offload_key
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.config import RemoteTierConfig
from kvoffload.tiers.naming import namespace, remote_key
from kvoffload.tiers.remote import RemoteIndex
from tiers.tier_kit import (
    ENV,
    RedisServer,
    TieredEngine,
    baseline_hits,
    hybrid_config,
    prompt,
    remote_tiers,
    tiered_engine,
)

pytestmark = pytest.mark.redis

PREFIX = 40
ATTEMPTS = 20
"""Tries a recovery story makes before it fails (counted, not timed: each try waits past
the retry interval, however slowly the machine runs it)."""


def evicting(engine: TieredEngine, seeds: range) -> None:
    engine.run([prompt(s, PREFIX) for s in seeds])


def test_two_engine_processes_share_a_prefix_through_redis(redis_srv: RedisServer) -> None:
    first = subprocess.run(
        [sys.executable, "-m", "tiers.engine_proc", "--remote", redis_srv.url,
         "--prompts", "1"], env=ENV, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["demoted"]["remote"] > 0

    config = hybrid_config(host_slots=48)
    query = [*prompt(1, PREFIX), 3, 3, 3]
    perfect = baseline_hits(config, [prompt(1, PREFIX), query])[1]
    assert perfect >= 32
    # This test process is the second engine: it never computed prompt 1.
    with tiered_engine(config, remote_tiers(redis_srv.url)) as engine:
        assert engine.run([query]) == perfect
        assert set(engine.tier.stats.loaded_blocks) == {"remote"}
    ns = namespace(config, remote_tiers(redis_srv.url))
    stored = redis_srv.client().keys(b"*")  # type: ignore[attr-defined]
    assert stored and all(k.startswith(f"kvo:{ns}:".encode()) for k in stored)

    # Another model with the same layout shares nothing.
    other = dataclasses.replace(remote_tiers(redis_srv.url), model_id="another-model")
    with tiered_engine(config, other) as engine:
        assert engine.run([query]) == 0


def test_server_killed_mid_run_no_crash_no_wrong_bytes_and_hits_resume(
        redis_srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    config = hybrid_config(host_slots=24)
    query = [*prompt(1, PREFIX), 1, 2, 3]
    perfect = baseline_hits(config, [prompt(1, PREFIX), query])[1]
    tiers = remote_tiers(redis_srv.url)
    assert tiers.remote is not None
    with tiered_engine(config, tiers) as engine:
        engine.run([prompt(1, PREFIX)])
        evicting(engine, range(2, 4))
        assert engine.run([query]) == perfect  # from redis
        assert engine.tier.stats.loaded_blocks.get("remote", 0) > 0

        # Kill the server while a request is in its prefill, its stores writing through.
        def kill_at(step: int) -> None:
            if step == 2:
                redis_srv.kill()

        with caplog.at_level(logging.WARNING):
            engine.run([prompt(5, PREFIX)], on_step=kill_at)
            evicting(engine, range(6, 8))  # more work while the server is gone
            down_hit = engine.run([[*prompt(1, PREFIX), 4, 4, 4]])
        assert down_hit < perfect  # prompt 1 left host memory; redis is gone: recompute
        remote = engine.tier.lower("remote")
        assert remote.stats.unreachable >= 1
        assert any("unreachable" in r.message for r in caplog.records)

        redis_srv.start()  # back, empty
        loaded_before = engine.tier.stats.loaded_blocks.get("remote", 0)
        for attempt in range(ATTEMPTS):
            time.sleep(tiers.remote.retry_interval_s + 0.05)  # at least past it: tried again
            fresh = prompt(1000 + attempt, PREFIX)
            engine.run([fresh])
            evicting(engine, range(8, 10))
            if engine.run([[*fresh, 1, 2, 3]]) > 0 and \
                    engine.tier.stats.loaded_blocks.get("remote", 0) > loaded_before:
                break
        else:
            raise AssertionError(f"no remote hit in {ATTEMPTS} tries after the server's "
                                 "return, each past the retry interval")
        engine.tier.check_integrity()


def test_a_hung_server_is_skipped_and_the_engine_keeps_serving(
        redis_srv: RedisServer) -> None:
    config = hybrid_config(host_slots=48)
    tiers = remote_tiers(redis_srv.url, timeout_s=0.3)
    with tiered_engine(config, tiers) as engine:
        engine.run([prompt(1, PREFIX)])
        redis_srv.pause()
        try:
            start = time.monotonic()
            assert engine.run([prompt(2, PREFIX)]) == 0
            assert engine.run([[*prompt(2, PREFIX), 1, 2, 3]]) > 0  # host memory serves
            # Bounded: each call gives up after 0.3 s; the server never answers, so a call
            # that waited for it would never return.
            assert time.monotonic() - start < 10
            assert engine.tier.lower("remote").stats.unreachable >= 1
        finally:
            redis_srv.resume()


def test_a_corrupted_value_is_a_miss(redis_srv: RedisServer) -> None:
    config = hybrid_config(host_slots=24)
    tokens = prompt(1, PREFIX)
    with tiered_engine(config, remote_tiers(redis_srv.url)) as engine:
        engine.run([tokens], chunk=4)  # a Mamba state at every block end
        evicting(engine, range(2, 4))
        ns = namespace(config, remote_tiers(redis_srv.url))
        block5 = make_offload_key(engine.sim.hasher.hashes(tokens)[5], 0)
        client = redis_srv.client()
        name = remote_key(ns, 0, block5)
        value = bytearray(client.get(name))  # type: ignore[attr-defined]
        value[-1] ^= 0x04  # the last payload byte
        client.set(name, bytes(value))  # type: ignore[attr-defined]
        assert 0 < engine.run([[*tokens, 9, 9, 9]]) <= 20
        assert engine.tier.stats.promote_failed == {"remote": 1}


# -- the scheduler's existence checks -------------------------------------------------------


def small_config(workers: int = 2) -> OffloadConfig:
    return OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4, page_bytes=8),),
                         hash_block_size=4, host_capacity_bytes=64, num_workers=workers,
                         eviction_policy="lru")


def test_existence_checks_are_asynchronous_cached_and_need_every_rank(
        redis_srv: RedisServer) -> None:
    now = [100.0]  # the index's clock: the TTL passes only when the test says so
    settings = RemoteTierConfig(redis_srv.url, negative_ttl_s=0.2, max_connections=5)
    index = RemoteIndex(small_config(), settings, "ns", clock=lambda: now[0])
    client = redis_srv.client()
    both, one = (make_offload_key(bytes([i]) * 16, 0) for i in (1, 2))
    client.set(remote_key("ns", 0, both), b"x")  # type: ignore[attr-defined]
    client.set(remote_key("ns", 1, both), b"x")  # type: ignore[attr-defined]
    client.set(remote_key("ns", 0, one), b"x")  # rank 1 lacks it  # type: ignore[attr-defined]
    try:
        assert index.status(both) is LookupResult.PENDING  # asked, not waited for
        assert index.status(one) is LookupResult.PENDING
        assert index.wait_idle()
        assert index.status(both) is LookupResult.HIT
        assert index.status(one) is LookupResult.MISS
        client.set(remote_key("ns", 1, one), b"x")  # another engine stores it  # type: ignore[attr-defined]
        assert index.status(one) is LookupResult.MISS  # trusted for negative_ttl_s
        now[0] += 0.19
        assert index.status(one) is LookupResult.MISS  # still within it
        now[0] += 0.02
        assert index.status(one) is LookupResult.PENDING  # past it: asked again
        assert index.wait_idle()
        assert index.status(one) is LookupResult.HIT
        assert index.begin_write(both) is False  # present: no need to write it again
    finally:
        index.close()


def test_a_dead_server_is_skipped_for_the_retry_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    settings = RemoteTierConfig(dead, retry_interval_s=0.3, timeout_s=0.2,
                                connect_timeout_s=0.2)
    now = [100.0]  # the index's clock: the interval passes only when the test says so
    index = RemoteIndex(small_config(), settings, "ns", clock=lambda: now[0])
    key = make_offload_key(b"\x01" * 16, 0)
    try:
        with caplog.at_level(logging.WARNING):
            assert index.status(key) is LookupResult.PENDING
            assert index.wait_idle()
            assert index.is_down
            assert index.status(key) is LookupResult.MISS  # skipped, no waiting
            assert index.begin_write(key) is False
        warnings = [r for r in caplog.records if "unreachable" in r.message]
        assert len(warnings) == 1
        now[0] += 0.29
        assert index.is_down and index.status(key) is LookupResult.MISS  # still skipped
        now[0] += 0.02
        assert not index.is_down and index.status(key) is LookupResult.PENDING  # retried
        assert index.wait_idle()
        assert len([r for r in caplog.records if "unreachable" in r.message]) == 1
    finally:
        index.close()


class _FastEngine(TieredEngine):
    """An engine whose steps take half a millisecond and never wait for the remote
    index's existence checks (an idle vLLM steps about that fast)."""

    def step(self, chunk: int) -> None:
        self.sim.step(chunk, 1.0, 0.0)
        time.sleep(0.0005)


def test_a_late_answer_is_waited_for_however_fast_the_engine_steps(
        redis_srv: RedisServer) -> None:
    # Another engine stored the prefix; this one's host memory has none of it, and the
    # server hangs while this engine looks it up, until the lookup has been deferred
    # far past max_deferred_steps (16) and for at least 0.3 s, but within the check's
    # own timeout (10 s: generous, so that a slow machine's late answer still counts).
    config = hybrid_config(host_slots=48)
    tiers = remote_tiers(redis_srv.url, timeout_s=10.0)
    query = [*prompt(1, PREFIX), 3, 3, 3]
    perfect = baseline_hits(config, [prompt(1, PREFIX), query])[1]
    with tiered_engine(config, tiers) as first:
        first.run([prompt(1, PREFIX)])
    engine = _FastEngine(config, tiers)
    engine.sim.max_deferral_s = 10.0 + 10.0  # the check's timeouts: round trip + connect
    hold = 4 * config.max_deferred_steps  # deferred answers the server hangs for at least
    resumed_after: list[int] = []

    def resume_once_far_past_the_step_bound(step: int) -> None:
        deferred = engine.planner.stats.deferred_lookups
        if not resumed_after and deferred >= hold and time.monotonic() - started >= 0.3:
            resumed_after.append(deferred)
            redis_srv.resume()

    try:
        started = time.monotonic()
        redis_srv.pause()
        assert engine.run([query], max_steps=100_000,
                          on_step=resume_once_far_past_the_step_bound) == perfect
        assert time.monotonic() - started >= 0.3  # it did wait for the server
        assert resumed_after  # the engine still asked, 4 x the step bound on, when it answered
        assert engine.planner.stats.deferral_timeouts == 0
        assert set(engine.tier.stats.loaded_blocks) == {"remote"}
    finally:
        redis_srv.resume()
        engine.close()
