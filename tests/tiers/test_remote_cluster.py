"""The remote tier on a real Redis Cluster (three masters, three replicas, on loopback):
the real planner, a ``CascadeTier``, two real worker ranks with tier I/O, and the engine
checking every loaded block byte for byte (``tiers.tier_kit``).

Stories: blocks of every group kind round-trip and spread over every master, with every
rank's copy of a block on one shard; two engine processes share a prefix through the
cluster; a master killed with SIGKILL mid-run costs misses until its replica takes over,
then hits again, never a wrong byte; slots moved between masters mid-run cost no error.
And the kit itself: a node whose port is taken before it binds starts on another port.

Waits are for what happened (the cluster reports ``ok``, a try hits), bounded by counted
tries or generous deadlines, never by a short wall-clock window.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.tiers.naming import namespace
from tiers import cluster_kit
from tiers.cluster_kit import Cluster, redis_cluster
from tiers.tier_kit import (
    ENV,
    TieredEngine,
    baseline_hits,
    hybrid_config,
    prompt,
    remote_tiers,
    tiered_engine,
)

pytestmark = pytest.mark.redis

PREFIX = 40
ATTEMPTS = 30
"""Tries a recovery story makes before it fails (counted, not timed: each try waits past
the retry interval, however slowly the machine runs it)."""


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[Cluster]:
    """One cluster for the stories that leave it as they found it."""
    with redis_cluster() as cluster:
        yield cluster


@pytest.fixture
def own_cluster() -> Iterator[Cluster]:
    """A fresh cluster for a story that kills nodes or moves slots."""
    with redis_cluster() as cluster:
        yield cluster


def evicting(engine: TieredEngine, seeds: range) -> None:
    engine.run([prompt(s, PREFIX) for s in seeds])


def remote_hit_after_eviction(engine: TieredEngine, seed: int) -> int:
    """Store prompt ``seed``, push it out of host memory, ask for it again."""
    engine.run([prompt(seed, PREFIX)])
    evicting(engine, range(seed + 1, seed + 3))
    return engine.run([[*prompt(seed, PREFIX), 1, 2, 3]])


def test_every_group_kind_round_trips_and_blocks_spread_over_every_master(
        shared_cluster: Cluster) -> None:
    config = hybrid_config(host_slots=24)  # full attention, sliding window, Mamba
    query = [*prompt(1, PREFIX), 1, 2, 3]
    perfect = baseline_hits(config, [prompt(1, PREFIX), query])[1]
    tiers = remote_tiers(shared_cluster.url, cluster=True)
    with tiered_engine(config, tiers) as engine:
        assert remote_hit_after_eviction(engine, 1) == perfect
        groups = {g for (tier, g) in engine.tier.stats.loaded_group_blocks if tier == "remote"}
        assert groups == {0, 1, 2}
        engine.tier.check_integrity()
    masters = shared_cluster.masters()
    assert len(masters) == 3
    assert all(shared_cluster.dbsize(m) > 0 for m in masters)
    # Every rank's copy of one block shares a slot: the hash tag is the block key.
    ns = namespace(config, tiers)
    client = shared_cluster.client()
    keys = [k for k in client.keys(f"kvo:{ns}:*".encode()) if k.endswith(b":0")]
    assert keys
    for key in keys[:20]:
        twin = key[:-1] + b"1"
        assert client.keyslot(key) == client.keyslot(twin)
        assert client.exists(key, twin) == 2
    client.close()


def test_two_engine_processes_share_a_prefix_through_the_cluster(
        shared_cluster: Cluster) -> None:
    first = subprocess.run(
        [sys.executable, "-m", "tiers.engine_proc", "--remote", shared_cluster.url,
         "--remote-cluster", "--prompts", "7"], env=ENV, capture_output=True, text=True,
        timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["demoted"]["remote"] > 0
    config = hybrid_config(host_slots=48)
    query = [*prompt(7, PREFIX), 3, 3, 3]
    perfect = baseline_hits(config, [prompt(7, PREFIX), query])[1]
    with tiered_engine(config, remote_tiers(shared_cluster.url, cluster=True)) as engine:
        assert engine.run([query]) == perfect  # this process never computed prompt 7
        assert set(engine.tier.stats.loaded_blocks) == {"remote"}


def test_a_master_killed_mid_run_costs_misses_then_hits_resume(own_cluster: Cluster) -> None:
    config = hybrid_config(host_slots=24)
    tiers = remote_tiers(own_cluster.url, cluster=True, retry_interval_s=0.3)
    assert tiers.remote is not None
    with tiered_engine(config, tiers) as engine:
        assert remote_hit_after_eviction(engine, 1) > 0
        victim = own_cluster.masters()[-1]

        def kill_at(step: int) -> None:
            if step == 2:
                own_cluster.kill(victim)

        engine.run([prompt(20, PREFIX)], on_step=kill_at)
        evicting(engine, range(21, 23))  # more traffic while a third of the slots has no master
        engine.run([[*prompt(20, PREFIX), 4, 4]])  # whatever it hits is checked byte for byte
        own_cluster.wait_ok()  # the replica took over
        loaded = engine.tier.stats.loaded_blocks.get("remote", 0)
        for attempt in range(ATTEMPTS):
            time.sleep(tiers.remote.retry_interval_s + 0.05)  # at least past it: tried again
            if remote_hit_after_eviction(engine, 110 + 10 * attempt) > 0 and \
                    engine.tier.stats.loaded_blocks.get("remote", 0) > loaded:
                break
        else:
            raise AssertionError(f"no remote hit in {ATTEMPTS} tries after the failover, "
                                 "each past the retry interval")
        engine.tier.check_integrity()


def test_slots_moved_mid_run_cost_no_errors(own_cluster: Cluster) -> None:
    config = hybrid_config(host_slots=24)
    tiers = remote_tiers(own_cluster.url, cluster=True)
    with tiered_engine(config, tiers) as engine:
        assert remote_hit_after_eviction(engine, 1) > 0
        source, target = own_cluster.masters()[:2]

        def move_at(step: int) -> None:
            if step == 1:
                own_cluster.reshard(source, target, 3000)

        engine.run([prompt(30, PREFIX)], on_step=move_at)
        # Blocks stored before the move are still found where they went; new ones too.
        assert engine.run([[*prompt(1, PREFIX), 5, 5]]) > 0
        assert remote_hit_after_eviction(engine, 40) > 0
        engine.tier.check_integrity()


def test_a_node_whose_port_is_taken_meanwhile_starts_on_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A port found free can be taken before redis-server binds it (the CI flake this
    # guards against): the kit starts that node again on another port instead of failing.
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    busy = blocker.getsockname()[1]
    picks: list[int] = []
    free_port = cluster_kit.cluster_port

    def taken_first(rng: random.Random, taken: set[int]) -> int:
        picks.append(busy if not picks else free_port(rng, taken))
        return picks[-1]

    monkeypatch.setattr(cluster_kit, "cluster_port", taken_first)
    cluster = Cluster(tmp_path)
    try:
        cluster.nodes.append(cluster._start_node(random.Random(1), set()))
        node = cluster.nodes[0]
        assert picks[0] == busy and node.port == picks[1] != busy
        assert cluster._cli(node.port, "PING").strip() == "PONG"
    finally:
        cluster.stop()
        blocker.close()
