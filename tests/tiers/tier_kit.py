"""Helpers for the lower-tier tests: a real redis-server on a free loopback port (with a
password, ACL users or TLS where a test asks; ``make_tls_files`` makes the certificates
with ``openssl``), and the simulated engine (``support.sim_engine``) wired to the real
planner, a ``CascadeTier`` and real ``TransferWorker`` ranks whose ``TierIO`` reads and
writes a real directory and a real server.

Block contents are a hash of (rank, layer, what the block summarises: its group, position
and tokens), so two engine processes fed the same tokens produce the same bytes, and the
engine checks every loaded block byte for byte against what it must hold (rule 6).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import JobId, StepPlan, TierJobId, WorkerReport
from kvoffload.offload import build_offload
from kvoffload.planner.planner import Planner
from kvoffload.tiers.cascade import CascadeTier
from kvoffload.tiers.config import DiskTierConfig, RemoteTierConfig, TierConfig, WriteMode
from kvoffload.worker import TransferWorker, cpu_backend
from support.real_workers import RandomFaults, TensorDevice, with_pages
from support.sim_engine import SimEngine

REDIS_SERVER = shutil.which("redis-server")
OPENSSL = shutil.which("openssl")


# -- redis-server --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files of a test CA, a server certificate for 127.0.0.1/localhost and a client
    certificate, all signed by that CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A throw-away CA and its server and client certificates (EC keys, one day), made
    with ``openssl``; skips the test where ``openssl`` is missing."""
    if OPENSSL is None:
        pytest.skip("openssl is not installed: cannot make test certificates")
    files = TlsFiles(*(directory / n for n in ("ca.crt", "server.crt", "server.key",
                                                "client.crt", "client.key")))
    ca_key = directory / "ca.key"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def openssl(*args: str | Path) -> None:
        subprocess.run([OPENSSL, *map(str, args)], check=True, capture_output=True,
                       timeout=60)

    openssl("req", "-x509", *ec, "-keyout", ca_key, "-out", files.ca, "-days", "1",
            "-subj", "/CN=kvoffload test CA")
    san = directory / "san.ext"
    san.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for cert, key, name, ext in ((files.server_cert, files.server_key, "localhost", True),
                                 (files.client_cert, files.client_key, "client", False)):
        csr = directory / f"{name}.csr"
        openssl("req", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", csr, "-CA", files.ca, "-CAkey", ca_key,
                "-CAcreateserial", "-out", cert, "-days", "1",
                *(["-extfile", san] if ext else []))
    return files


class RedisServer:
    """A throw-away ``redis-server`` on 127.0.0.1 (no persistence), startable again on the
    same port after ``kill``.

    ``extra_args`` go to the server as they are (``--requirepass``, ``--user`` lines);
    ``password`` is the default user's, for ``client`` and the start-up check. With
    ``tls`` the server speaks TLS only (``--port 0``), asking clients for a certificate
    as ``tls_auth_clients`` says (``yes``, ``optional``, ``no``).
    """

    def __init__(self, directory: Path, port: int | None = None,
                 maxmemory: str | None = None, policy: str = "allkeys-lru", *,
                 extra_args: Sequence[str] = (), password: str | None = None,
                 tls: TlsFiles | None = None, tls_auth_clients: str = "optional") -> None:
        if REDIS_SERVER is None:
            pytest.skip("redis-server is not installed; run scripts/install_redis.sh")
        self.directory = directory
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra_args = tuple(extra_args)
        self.password = password
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> Path:
        return self.directory / "redis-server.log"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                "--protected-mode", "no", "--loglevel", "warning"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy]
        if self.tls is not None:
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(self.tls.server_cert),
                     "--tls-key-file", str(self.tls.server_key),
                     "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", self.tls_auth_clients]
        args += self.extra_args
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), self._socket() as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   + self.log.read_text(errors="replace")[-400:])
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer within 10 s")

    def _socket(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=0.2)
        if self.tls is None:
            return sock
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return context.wrap_socket(sock, server_hostname="127.0.0.1")

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, its data is gone."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing answers)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> Any:
        """An administrator's client (the default user, TLS with the client certificate)."""
        import redis

        tls: dict[str, Any] = {}
        if self.tls is not None:
            tls = {"ssl": True, "ssl_ca_certs": str(self.tls.ca),
                   "ssl_certfile": str(self.tls.client_cert),
                   "ssl_keyfile": str(self.tls.client_key)}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **tls)

    def stats(self) -> dict[str, Any]:
        """``INFO`` of the server, asked on a connection closed at once."""
        client = self.client()
        try:
            return dict(client.info())
        finally:
            client.connection_pool.disconnect()

    def clients(self) -> int:
        """Clients connected now, not counting the connection that asks."""
        return int(self.stats()["connected_clients"]) - 1


@contextlib.contextmanager
def redis_server(maxmemory: str | None = None, policy: str = "allkeys-lru",
                 **options: Any) -> Iterator[RedisServer]:
    """A started ``RedisServer`` (``options``: its keyword arguments), killed at exit."""
    with tempfile.TemporaryDirectory(prefix="kvoffload-redis-") as directory:
        server = RedisServer(Path(directory), maxmemory=maxmemory, policy=policy, **options)
        server.start()
        try:
            yield server
        finally:
            server.kill()


# -- layouts and tier configs --------------------------------------------------------------


def hybrid_config(*, host_slots: int, num_workers: int = 2,
                  max_deferred_steps: int = 16) -> OffloadConfig:
    """Full attention + sliding window (8 tokens) + Mamba, block size 4, real page bytes."""
    groups = (GroupSpec(GroupKind.FULL_ATTENTION, 4, name="fa"),
              GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8, name="swa"),
              GroupSpec(GroupKind.MAMBA, 4, name="mamba"))
    # The simulated engine writes every block's boundary state, Mamba included.
    base = OffloadConfig(groups=groups, hash_block_size=4, host_capacity_bytes=host_slots,
                         num_workers=num_workers, max_deferred_steps=max_deferred_steps,
                         mamba_states_every_block=True, eviction_policy="lru")
    return with_pages(base, host_slots)


def disk_tiers(path: str | Path, *, capacity: int = 1 << 30,
               mode: WriteMode = WriteMode.WRITE_BACK, fsync: bool = False) -> TierConfig:
    return TierConfig(model_id="test-model",
                      disk=DiskTierConfig(str(path), capacity, write_mode=mode, io_threads=2,
                                          fsync=fsync))


def remote_tiers(url: str, *, mode: WriteMode = WriteMode.WRITE_THROUGH,
                 retry_interval_s: float = 0.3, negative_ttl_s: float = 0.0,
                 timeout_s: float = 0.5, **remote: Any) -> TierConfig:
    """``remote``: more ``RemoteTierConfig`` fields (credentials, TLS files)."""
    return TierConfig(model_id="test-model",
                      remote=RemoteTierConfig(url, write_mode=mode, io_threads=2,
                                              max_connections=4, timeout_s=timeout_s,
                                              connect_timeout_s=timeout_s,
                                              retry_interval_s=retry_interval_s,
                                              negative_ttl_s=negative_ttl_s, **remote))


# -- the engine ----------------------------------------------------------------------------


class TieredWorkers:
    """Every rank's real ``TransferWorker`` with tier I/O.

    ``deliver`` first waits for every transfer and tier job submitted so far (a step lasts
    long enough), then hands the engine a seeded random ``fraction`` of the reports (the
    rest arrive later, reordered and split across ranks); transfer jobs submitted after it
    fail at ``fail_rate``. Runs are reproducible.
    """

    def __init__(self, device: TensorDevice, config: OffloadConfig, tiers: TierConfig,
                 seed: int = 0) -> None:
        self.faults = [RandomFaults(seed, rank) for rank in range(config.num_workers)]
        self.workers = []
        for rank in range(config.num_workers):
            worker = TransferWorker(config, rank, cpu_backend(fault_hook=self.faults[rank]),
                                    pin_memory=False, tiers=tiers)
            worker.register_kv_caches(device.group_tensors(rank))
            self.workers.append(worker)
        self.unreported: dict[JobId, int] = {}
        self.tier_unreported: dict[TierJobId, int] = {}
        self.held: list[tuple[int, bool, int, bool]] = []  # (rank, tier?, id, failed)
        self.unreachable: list[tuple[int, str]] = []

    @property
    def idle(self) -> bool:
        return not self.unreported and not self.tier_unreported

    def begin(self, plan: StepPlan) -> None:
        n = len(self.workers)
        for job in (*plan.stores, *plan.loads):
            self.unreported[job.job_id] = n
        for tjob in plan.tier_jobs:
            self.tier_unreported[tjob.job_id] = n
        for worker in self.workers:
            worker.begin_step(plan)

    def end(self) -> None:
        for worker in self.workers:
            worker.end_step()

    def deliver(self, rng: random.Random, fraction: float,
                fail_rate: float) -> list[WorkerReport]:
        for worker in self.workers:
            worker.wait(list(self.unreported))
            worker.wait_tier_jobs()
            report = worker.poll()
            rank = worker.rank
            self.held += [(rank, False, j, False) for j in report.finished]
            self.held += [(rank, False, j, True) for j in report.failed]
            self.held += [(rank, True, j, False) for j in report.tier_finished]
            self.held += [(rank, True, j, True) for j in report.tier_failed]
            self.unreachable += [(rank, t) for t in report.tier_unreachable]
        for faults in self.faults:
            faults.rate = fail_rate
        self.held.sort()
        rng.shuffle(self.held)
        cut = len(self.held) if fraction >= 1.0 else round(len(self.held) * fraction)
        released, self.held = self.held[:cut], self.held[cut:]
        parts: dict[int, tuple[list[JobId], list[JobId], list[TierJobId], list[TierJobId]]] = {}
        for rank, is_tier, job_id, failed in released:
            ok, bad, tier_ok, tier_bad = parts.setdefault(rank, ([], [], [], []))
            if is_tier:
                (tier_bad if failed else tier_ok).append(TierJobId(job_id))
                self._tick(self.tier_unreported, job_id)
            else:
                (bad if failed else ok).append(JobId(job_id))
                self._tick(self.unreported, job_id)
        unreachable: dict[int, list[str]] = {}
        for rank, tier in self.unreachable:
            unreachable.setdefault(rank, []).append(tier)
            parts.setdefault(rank, ([], [], [], []))
        self.unreachable = []
        return [WorkerReport(rank, tuple(ok), tuple(bad), tier_finished=tuple(tok),
                             tier_failed=tuple(tbad),
                             tier_unreachable=tuple(unreachable.get(rank, ())))
                for rank, (ok, bad, tok, tbad) in sorted(parts.items())]

    @staticmethod
    def _tick(table: dict[Any, int], job_id: int) -> None:
        table[job_id] -= 1
        if not table[job_id]:
            del table[job_id]

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


class _NoEnginePrefixCache(random.Random):
    """The simulated engine draws ``random() < 0.3`` to give a request a prefix hit of its
    own; here it never does, so every hit token comes from the offload tiers."""

    def random(self) -> float:
        return 0.999


class TieredEngine:
    """``SimEngine`` + ``CascadeTier`` + ``TieredWorkers``; ``run`` serves requests.

    The engine's own prefix cache is off: ``run`` returns exactly the tokens the tiers
    provided.
    """

    def __init__(self, config: OffloadConfig, tiers: TierConfig, *, num_blocks: int = 200,
                 seed: int = 0) -> None:
        holder: dict[str, TieredWorkers] = {}

        def build(engine: SimEngine, blocks: int) -> tuple[TensorDevice, TieredWorkers]:
            device = TensorDevice(engine.config, blocks)
            holder["w"] = TieredWorkers(device, engine.config, tiers, seed)
            return device, holder["w"]

        self.sim = SimEngine(config, num_blocks=num_blocks, seed=seed,
                             real=build)  # type: ignore[arg-type]
        self.sim.rng = _NoEnginePrefixCache(seed)
        offload = build_offload(config, tiers)
        self.any_tier = offload.tier
        self.sim.tier = self.any_tier  # type: ignore[assignment]
        self.sim.planner = offload.planner
        if isinstance(self.any_tier, CascadeTier):  # rule 8: a wait for host room is timed
            self.sim.max_deferral_s = max(self.sim.max_deferral_s,
                                          self.any_tier.room_deferral_s)
        self.workers = holder["w"]

    @property
    def tier(self) -> CascadeTier:
        assert isinstance(self.any_tier, CascadeTier)
        return self.any_tier

    @property
    def planner(self) -> Planner:
        return self.sim.planner

    def run(self, prompts: list[list[int]], *, max_new_tokens: int = 2, chunk: int = 16,
            max_steps: int = 400, on_step: Callable[[int], None] | None = None) -> int:
        """Serve ``prompts`` one after the other to completion; return hit tokens.

        ``on_step(n)`` runs after the n-th step (counted over all prompts of this call).
        """
        before = self.sim.hit_tokens
        steps = 0
        for tokens in prompts:
            req = self.sim.add_request(tokens, max_new_tokens)
            for _ in range(max_steps):
                if req.state == "done":
                    break
                self.step(chunk)
                steps += 1
                if on_step is not None:
                    on_step(steps)
            else:
                raise AssertionError(f"request {req.request_id} did not finish")
        self.settle()
        return self.sim.hit_tokens - before

    def step(self, chunk: int) -> None:
        """One engine step that lasts long enough for every job and every existence check
        it started to finish (the workers' reports are delivered at its end)."""
        self.sim.step(chunk, 1.0, 0.0)
        if isinstance(self.any_tier, CascadeTier):
            assert self.any_tier.wait_idle()

    def settle(self, max_steps: int = 50) -> None:
        """Run empty steps until no job or tier job is in flight."""
        for _ in range(max_steps):
            if self.workers.idle and not self.planner.has_pending_work():
                return
            self.step(16)
        raise AssertionError("jobs still in flight after settling")

    def close(self) -> None:
        try:
            self.sim.drain()
        finally:
            self.workers.shutdown()
            if isinstance(self.any_tier, CascadeTier):
                self.any_tier.close()


@contextlib.contextmanager
def tiered_engine(config: OffloadConfig, tiers: TierConfig,
                  **kwargs: int) -> Iterator[TieredEngine]:
    engine = TieredEngine(config, tiers, **kwargs)
    try:
        yield engine
    finally:
        engine.close()


def baseline_hits(config: OffloadConfig, prompts: list[list[int]]) -> list[int]:
    """Hit tokens of each prompt served in order by an engine whose host memory never
    evicts (no lower tiers): what a perfect cache would give under the same planner."""
    big = with_pages(config, 10_000)
    with tiered_engine(big, TierConfig()) as engine:
        return [engine.run([p]) for p in prompts]


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


def block_files(root: str | Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*.kvb") if p.is_file())


def with_layout(config: OffloadConfig, **changes: object) -> OffloadConfig:
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]


ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
"""Environment for engine subprocesses (``tiers.engine_proc``)."""
