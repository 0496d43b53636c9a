"""The remote tier against servers that do not behave like Redis: a scripted loopback
server (``support.scripted_redis``) that answers garbage (an HTTP reply, ``:1``, ``+OK``,
an array, ``-ERR``, a bulk length of 2^63 - 1) to the tier's commands or already to the
login (``HELLO``), drips one byte every 0.3 s (during the login or a command), or never
answers.

Stories, one table row per server behaviour: the start-up check, an existence check of
the remote index, a store, a load and ``kvoffload simulate --remote-url`` each end within
the tier's documented bound on a whole call (``connect_timeout_s + timeout_s``, plus
slack for a loaded machine) however the server answers; the tier is marked down with one
warning (no traceback); the data path sees misses only; ``simulate`` runs to the end with
the tier down (exit 0, every verified byte right), as with an unreachable server.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

from kvoffload.blockfile.framing import FINGERPRINT_BYTES
from kvoffload.cli import main
from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.keys import make_offload_key
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.config import RemoteTierConfig
from kvoffload.tiers.remote import RemoteIndex, check_credentials
from kvoffload.worker.block_store import TierUnavailable
from kvoffload.worker.remote_store import RemoteStore
from support.scripted_redis import BEHAVIOURS, STREAM, TLS_DRIP, ScriptedServer, timed

FP = bytes(range(FINGERPRINT_BYTES))
NS = "ns-misbehaving"
SLACK_S = 1.0
"""Allowance over the documented bound for a loaded test machine (the watchdog wakes in
milliseconds; a hang would be unbounded)."""
HANG_S = 20.0
"""A call still running after this long counts as a hang."""

NAMES = sorted(BEHAVIOURS)


@pytest.fixture(params=NAMES)
def server(request: pytest.FixtureRequest) -> ScriptedServer:
    srv = ScriptedServer(BEHAVIOURS[request.param])
    request.addfinalizer(srv.close)
    return srv


def remote(url: str) -> RemoteTierConfig:
    return RemoteTierConfig(url, timeout_s=0.5, connect_timeout_s=0.25,
                            retry_interval_s=60.0, negative_ttl_s=0.0)


def call_bound_s(config: RemoteTierConfig) -> float:
    """The documented bound on one whole call (docs/tiers.md)."""
    return config.connect_timeout_s + config.timeout_s


def bound(config: RemoteTierConfig) -> float:
    return call_bound_s(config) + SLACK_S


def small_config() -> OffloadConfig:
    return OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4, page_bytes=8),),
                         hash_block_size=4, host_capacity_bytes=64, num_workers=1,
                         eviction_policy="lru")


def blocks(n: int, size: int = 4096) -> list[tuple[bytes, bytes]]:
    return [(make_offload_key(bytes([7, i]) * 8, 0), os.urandom(size)) for i in range(n)]


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    """No traceback logged, and no line echoing a server's huge reply."""
    traced = [r.getMessage() for r in caplog.records if r.exc_info]
    assert not traced, f"tracebacks logged: {traced}"
    long = [r.getMessage()[:200] for r in caplog.records if len(r.getMessage()) > 1000]
    assert not long, f"huge lines logged: {long}"


def test_the_start_up_check_passes_within_the_bound_with_a_warning(
        server: ScriptedServer, caplog: pytest.LogCaptureFixture) -> None:
    config = remote(server.url)
    with caplog.at_level(logging.DEBUG, logger="kvoffload"):
        elapsed, result = timed(check_credentials, config, limit_s=HANG_S)
    assert elapsed <= bound(config), f"start-up check took {elapsed:.2f} s"
    assert result is None, f"start-up check raised {result!r}"
    assert any("not usable at start-up" in r.getMessage() for r in caplog.records)
    no_tracebacks(caplog)


def test_existence_checks_mark_the_tier_down_once_without_tracebacks(
        server: ScriptedServer, caplog: pytest.LogCaptureFixture) -> None:
    config = remote(server.url)
    index = RemoteIndex(small_config(), config, NS)
    key = make_offload_key(b"k" * 16, 0)
    try:
        with caplog.at_level(logging.DEBUG, logger="kvoffload"):
            assert index.status(key) is LookupResult.PENDING
            assert index.answer_wait_s(key) <= call_bound_s(config)
            elapsed, idle = timed(index.wait_idle, HANG_S, limit_s=HANG_S)
            assert idle is True and elapsed <= bound(config), f"check took {elapsed:.2f} s"
            if server.behaviour.reply == b":1\r\n":
                # ":1" is a valid EXISTS answer ("present"): no outage; the load that
                # follows gets ":1" for its value, a miss (previous test)
                assert not index.is_down and index.status(key) is LookupResult.HIT
                return
            assert index.is_down
            for i in range(20):  # further lookups: misses, nothing asked, nothing logged
                assert index.status(make_offload_key(bytes([i]) * 16, 0)) is \
                    LookupResult.MISS
    finally:
        index.close()
        no_tracebacks(caplog)
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert index.stats.unreachable == 1


def test_a_store_and_a_load_end_within_the_bound_as_tier_unavailable(
        server: ScriptedServer, caplog: pytest.LogCaptureFixture) -> None:
    config = remote(server.url)
    items = blocks(4)
    with caplog.at_level(logging.DEBUG, logger="kvoffload"):
        store = RemoteStore(config, NS, 0, FP)
        try:
            elapsed, result = timed(store.put, items, limit_s=HANG_S)
            assert elapsed <= bound(config), f"store took {elapsed:.2f} s"
            # a reply to SET that is not +OK fails that write; one redis-py cannot read
            # makes the tier unavailable ("+OK" to everything is a write as far as any
            # client can tell: the load below, checksummed, still serves nothing wrong)
            assert isinstance(result, TierUnavailable) or result == \
                [server.behaviour.reply == b"+OK\r\n"] * len(items), result
            assert len(str(result)) < 1000
        finally:
            store.close()
        store = RemoteStore(config, NS, 0, FP)
        dests = [memoryview(bytearray(len(p))) for _, p in items]
        try:
            elapsed, result = timed(store.get_into, list(zip([k for k, _ in items], dests,
                                                             strict=True)), limit_s=HANG_S)
            assert elapsed <= bound(config), f"load took {elapsed:.2f} s"
            assert isinstance(result, TierUnavailable) or result == [False] * len(items), \
                result
            assert all(not any(d.tobytes()) for d in dests)  # nothing written: misses only
        finally:
            store.close()
    no_tracebacks(caplog)


def test_simulate_runs_to_the_end_with_the_tier_down(
        server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--limit", "3", "--no-baseline", "--json",
            "--remote-url", server.url]
    # the start-up check is bounded by 3 s, each call of the run by 1.5 s (defaults)
    elapsed, status = timed(main, argv, limit_s=60.0)
    out, err = capsys.readouterr()
    assert status == 0, (status, err[-2000:])
    assert "Traceback" not in err
    assert elapsed < 40.0, f"simulate took {elapsed:.1f} s"
    offload = json.loads(out)["offload"]
    assert offload["wrong_bytes"] == 0 and offload["verified_blocks"] > 0
    assert offload["lower_tier_blocks"]["remote"] == 0


@pytest.mark.parametrize("reply", ["huge-bulk", "stream"])
def test_a_reply_longer_than_a_block_allocates_nothing(reply: str) -> None:
    """A load of 4 KiB blocks answered with ``$9223372036854775807`` and nothing after it
    (``huge-bulk``), or with a 200 MB bulk reply sent as fast as loopback allows
    (``stream``): the load stops at the announced length (more than a block can be), ends
    within the bound, and memory stays flat (nothing is allocated for the announced
    length)."""
    import tracemalloc

    with ScriptedServer(BEHAVIOURS["huge-bulk"] if reply == "huge-bulk" else STREAM) as srv:
        config = remote(srv.url)
        store = RemoteStore(config, NS, 0, FP)
        items = blocks(2)
        dests = [memoryview(bytearray(len(p))) for _, p in items]
        tracemalloc.start()
        try:
            elapsed, result = timed(store.get_into, list(zip([k for k, _ in items], dests,
                                                             strict=True)), limit_s=HANG_S)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            store.close()
    assert elapsed <= bound(config) and isinstance(result, TierUnavailable), result
    assert peak < 8 << 20, f"peak {peak:,} bytes"


def test_a_tls_handshake_that_drips_is_bounded_too(caplog: pytest.LogCaptureFixture) -> None:
    """A ``rediss://`` server that drips its TLS handshake one byte every 0.2 s: the start-up
    check and a store end within the bound (CPython's ``ssl`` bounds a whole handshake by
    the connect timeout; this guards that the tier keeps it so)."""
    with ScriptedServer(TLS_DRIP) as srv:
        config = remote(srv.url.replace("redis://", "rediss://"))
        elapsed, result = timed(check_credentials, config, limit_s=HANG_S)
        assert elapsed <= bound(config) and result is None, (elapsed, result)
        store = RemoteStore(config, NS, 0, FP)
        try:
            elapsed, result = timed(store.put, blocks(1), limit_s=HANG_S)
        finally:
            store.close()
    assert elapsed <= bound(config) and isinstance(result, TierUnavailable), (elapsed, result)
    no_tracebacks(caplog)
