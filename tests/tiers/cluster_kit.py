"""A real Redis Cluster on loopback for the tests: three masters and three replicas.

Six ``redis-server --cluster-enabled yes`` processes on free ports, joined with
``redis-cli --cluster create ... --cluster-replicas 1``. A node timeout of one second
makes a replica take over within a few seconds of its master dying (``kill``); ``reshard``
moves slots, with their keys, between masters while clients keep running.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NODE_TIMEOUT_MS = 1000
BUS_OFFSET = 10_000
"""A cluster node also listens on its port + 10000 (the cluster bus)."""


START_ATTEMPTS = 5
"""Tries per node: a port found free can still be taken before the server binds it."""


def ephemeral_low() -> int:
    """The first port the kernel hands out as a connection's source port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def cluster_port(rng: random.Random, taken: set[int]) -> int:
    """A loopback port that is free, and whose bus port is too, both below the ephemeral
    range (where any client connection of the run could take one as its source port) and
    neither in ``taken`` (the ports of nodes already started, which may not be bound yet)."""
    low, high = 10_000, ephemeral_low() - BUS_OFFSET
    if high - low < 1000:  # an ephemeral range starting low: it cannot be avoided
        low, high = 20_000, 50_000
    for _ in range(1000):
        port = rng.randrange(low, high)
        if {port, port + BUS_OFFSET} & taken:
            continue
        try:
            for p in (port, port + BUS_OFFSET):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class Node:
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class Cluster:
    """Six nodes; ``url`` names one master (any node seeds a cluster client)."""

    def __init__(self, directory: Path) -> None:
        if REDIS_SERVER is None or REDIS_CLI is None:
            pytest.skip("redis-server/redis-cli are not installed; run scripts/install_redis.sh")
        self.directory = directory
        self.nodes: list[Node] = []

    def start(self) -> None:
        assert REDIS_SERVER is not None and REDIS_CLI is not None
        rng = random.Random()
        taken: set[int] = set()
        for _ in range(6):
            self.nodes.append(self._start_node(rng, taken))
        subprocess.run([REDIS_CLI, "--cluster", "create",
                        *(n.address for n in self.nodes), "--cluster-replicas", "1",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_ok()
        self.wait_replicas_synced()

    def wait_replicas_synced(self, timeout: float = 30) -> None:
        """Until every replica's link to its master is up (its copy is current)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [self._cli(n.port, "INFO", "replication") for n in self.live()]
            replicas = [i for i in infos if "role:slave" in i]
            if len(replicas) == 3 and all("master_link_status:up" in i for i in replicas):
                return
            time.sleep(0.1)
        raise RuntimeError("the replicas did not sync with their masters")

    def _cli(self, port: int, *args: str, timeout: float = 10) -> str:
        assert REDIS_CLI is not None
        done = subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True,
                              timeout=timeout, check=False)
        return done.stdout.decode()

    def _start_node(self, rng: random.Random, taken: set[int]) -> Node:
        """One node answering PING; a server that exits at once (its port was taken after
        the check) is started again on another port."""
        assert REDIS_SERVER is not None
        for _ in range(START_ATTEMPTS):
            port = cluster_port(rng, taken)
            taken.update((port, port + BUS_OFFSET))
            args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                    # A replica may take over however long it was out of touch.
                    "--cluster-replica-validity-factor", "0", "--save", "",
                    "--appendonly", "no", "--dir", str(self.directory),
                    "--protected-mode", "no", "--loglevel", "warning"]
            node = Node(port, subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
            if self._wait_ping(node):
                return node
            node.proc.kill()
            node.proc.wait()
        raise RuntimeError(f"no redis-server of the cluster answered in {START_ATTEMPTS} tries")

    def _wait_ping(self, node: Node) -> bool:
        """Whether ``node`` answers PING within 10 s (False at once if it exited)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and node.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # another listener there
                if self._cli(node.port, "PING", timeout=1).strip() == "PONG":
                    return True
            time.sleep(0.05)
        return False

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node reports ``cluster_state:ok`` with all slots served."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [self._cli(n.port, "CLUSTER", "INFO") for n in self.live()]
            if infos and all("cluster_state:ok" in i and "cluster_slots_ok:16384" in i
                             for i in infos):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def masters(self) -> list[Node]:
        """Live nodes that are masters owning slots now."""
        out = []
        for node in self.live():
            line = next((ln for ln in self._cli(node.port, "CLUSTER", "NODES").splitlines()
                         if "myself" in ln), "")
            fields = line.split()
            if "master" in line and len(fields) > 8:
                out.append(node)
        return out

    def node_id(self, node: Node) -> str:
        return self._cli(node.port, "CLUSTER", "MYID").strip()

    def dbsize(self, node: Node) -> int:
        return int(self._cli(node.port, "DBSIZE").strip() or 0)

    def client(self) -> Any:
        """A redis-py cluster client (for the tests' own reads)."""
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(self.url)

    @property
    def url(self) -> str:
        return f"redis://{self.masters()[0].address}/0"

    def kill(self, node: Node) -> None:
        """SIGKILL: the node dies at once; its replica is promoted after the node timeout."""
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=10)

    def reshard(self, source: Node, target: Node, slots: int) -> None:
        """Move ``slots`` slots with their keys from ``source`` to ``target``."""
        assert REDIS_CLI is not None
        subprocess.run([REDIS_CLI, "--cluster", "reshard", source.address,
                        "--cluster-from", self.node_id(source),
                        "--cluster-to", self.node_id(target),
                        "--cluster-slots", str(slots), "--cluster-yes", "--cluster-pipeline",
                        "100"], check=True, capture_output=True, timeout=120)

    def stop(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(ProcessLookupError):
                node.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)


@contextlib.contextmanager
def redis_cluster() -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory(prefix="kvoffload-cluster-") as directory:
        cluster = Cluster(Path(directory))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
