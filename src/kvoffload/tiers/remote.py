"""The remote tier's bookkeeping (``RemoteIndex``): which blocks a shared Redis/Valkey
server holds, as far as this engine knows, and whether the server is reachable.

Many engines write the server, and the server evicts on its own (its ``maxmemory`` policy
governs capacity), so this index cannot own the contents the way ``DiskIndex`` does. It
*asks*: a lookup of a key it has no fresh answer for queues an existence check and answers
PENDING; a background thread sends the queued checks as one pipelined round trip of
``EXISTS`` (one per key, naming every rank's copy; the key counts only if all exist) and
records the answers. The scheduler never blocks on the network.

Answers. "Present" is trusted until a read fails (the server may have evicted the block
since: the promote then fails, the key becomes a miss). "Absent" is trusted for at least
one lookup and then for ``negative_ttl_s`` (another engine may store the block meanwhile).

Unreachable or slow server. A check that errors or times out (``timeout_s``), or a worker
report naming the tier unreachable, marks the tier *down* for ``retry_interval_s``: every
lookup answers MISS and no demote starts, so the engine keeps serving from the other
tiers. One warning is logged when it goes down, one info line when it answers again.

Refused credentials. A server that refuses the user or password (``WRONGPASS``,
``NOAUTH``, ``NOPERM``: ``auth_failure``) will not accept them later either: the index
logs one error naming the options to check and keeps the tier off (every lookup MISS,
no demote) for the life of the process; it asks the server nothing more.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError, InvariantError
from kvoffload.keys import OffloadKey
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.config import RemoteTierConfig, url_without_credentials
from kvoffload.tiers.lower import LowerTier, LowerTierStats
from kvoffload.tiers.naming import remote_key

logger = logging.getLogger(__name__)

_PROBE_BATCH = 512
"""Keys per pipelined existence check."""

REMOTE_ERRORS: tuple[type[BaseException], ...] = (OSError,)
"""Exceptions meaning "the server is unreachable or too slow" (redis' are added on import)."""


def connect(remote: RemoteTierConfig, max_connections: int) -> Any:
    """A redis-py client for ``remote.url`` with bounded timeouts and no silent retries.

    Blocks on nothing: connections open lazily. A pool of ``max_connections`` connections;
    a caller waiting for a free one gives up after ``timeout_s``. Credentials and TLS
    settings come from ``connection_kwargs``. Needs the ``redis`` extra
    (``pip install kvoffload[redis]``).
    """
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the remote tier needs redis-py: pip install 'kvoffload[redis]'") \
            from exc
    if remote.cluster:
        return _connect_cluster(remote, max_connections)
    pool = redis.BlockingConnectionPool.from_url(
        url_without_credentials(remote.url), max_connections=max_connections,
        timeout=remote.timeout_s, socket_timeout=remote.timeout_s,
        socket_connect_timeout=remote.connect_timeout_s, retry=Retry(NoBackoff(), 0),
        **connection_kwargs(remote))
    return redis.Redis(connection_pool=pool)


def _connect_cluster(remote: RemoteTierConfig, max_connections: int) -> Any:
    """A redis-py ``RedisCluster`` seeded by ``remote.url`` (one node; the client reads the
    slot map from it). Slots without a master (one lost, its replica not promoted yet)
    make their commands fail, which the tier counts as unreachable, never as data:
    ``require_full_coverage=False`` keeps the other shards serving. Each node gets a pool
    of ``max_connections``."""
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    return RedisCluster.from_url(
        url_without_credentials(remote.url), max_connections=max_connections,
        socket_timeout=remote.timeout_s, socket_connect_timeout=remote.connect_timeout_s,
        require_full_coverage=False, retry=Retry(NoBackoff(), 1), **connection_kwargs(remote))



def connection_kwargs(remote: RemoteTierConfig) -> dict[str, Any]:
    """Credential and TLS keyword arguments of a redis-py client (a pool, a cluster
    client) for ``remote``: ``username``/``password`` as ``RemoteTierConfig`` resolves
    them (options over the environment over the URL) and, for ``rediss://``, the
    ``ssl_*`` settings (the server's certificate and host name verified).

    Give them with ``url_without_credentials(remote.url)``: redis-py lets a URL's own
    user and password override keyword arguments.
    """
    kwargs: dict[str, Any] = {}
    username, password = remote.credentials()
    if username is not None:
        kwargs["username"] = username
    if password is not None:
        kwargs["password"] = password
    if remote.url.lower().startswith("rediss://"):
        kwargs["ssl_cert_reqs"] = "required"
        kwargs["ssl_check_hostname"] = True
        for key, path in (("ssl_ca_certs", remote.tls_ca_file),
                          ("ssl_certfile", remote.tls_cert_file),
                          ("ssl_keyfile", remote.tls_key_file)):
            if path is not None:
                kwargs[key] = path
    return kwargs


def remote_errors() -> tuple[type[BaseException], ...]:
    """Connection, timeout and cluster-availability errors of redis-py, plus ``OSError``.

    A refused login (``AuthenticationError``) is one of them too: tell it apart with
    ``auth_failure`` before treating the server as merely unreachable.
    """
    try:
        from redis.exceptions import ClusterDownError, ClusterError, RedisClusterException
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
    except ImportError:  # pragma: no cover - depends on the environment
        return REMOTE_ERRORS
    # Cluster errors: no master for a slot (failover in progress), or the slot map could
    # not be read; they pass like an unreachable server.
    return (*REMOTE_ERRORS, RedisConnectionError, RedisTimeoutError, ClusterDownError,
            ClusterError, RedisClusterException)


_AUTH_REPLIES = ("WRONGPASS", "NOAUTH", "NOPERM")


def auth_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the server refused our credentials (a wrong user or password,
    none given where one is needed, or a user without the rights the tier needs)."""
    try:
        from redis.exceptions import (
            AuthenticationError,
            AuthenticationWrongNumberOfArgsError,
            NoPermissionError,
        )
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    if isinstance(exc, (AuthenticationError, AuthenticationWrongNumberOfArgsError,
                        NoPermissionError)):
        return True
    return str(exc).lstrip("-").upper().startswith(_AUTH_REPLIES)


def refused_message(remote: RemoteTierConfig, exc: BaseException) -> str:
    """What the server refused (``exc``), naming the options to check; no secrets."""
    what = f"{remote.shown_url} refused the credentials ({type(exc).__name__}: {exc})"
    if type(exc).__name__ == "NoPermissionError" or \
            str(exc).lstrip("-").upper().startswith("NOPERM"):
        return (f"{what}: the user ({remote.credential_source()}) lacks a command or key "
                "the tier needs; grant it ping, set, getrange, exists and del on keys kvo:*")
    return (f"{what}: check remote_username and the password "
            f"({remote.credential_source()})")


def check_credentials(remote: RemoteTierConfig, field: str = "remote_url") -> None:
    """Start-up check: log in once and ``PING``; raise ``ConfigError`` (naming ``field``)
    when the server refuses the credentials. An unreachable server passes (the tier
    skips it while it is down); so does a missing redis-py (the tier says so)."""
    try:
        client = connect(remote, 1)
    except ImportError:  # pragma: no cover - depends on the environment
        return
    except ValueError as exc:  # redis-py cannot read the URL (a port that is no number)
        raise ConfigError(field, f"cannot read {remote.shown_url!r}: {exc}",
                          "Use redis://host:port/db.") from None
    try:
        client.ping()
    except Exception as exc:
        if auth_failure(exc):
            raise ConfigError(field, refused_message(remote, exc),
                              "Fix them and start again.") from None
        if not isinstance(exc, remote_errors()):
            raise
        logger.debug("remote tier %s not reachable at start-up: %s", remote.shown_url, exc)
    finally:
        client.connection_pool.disconnect()


@dataclass(slots=True)
class _Answer:
    present: bool
    at: float
    used: bool = False


class RemoteIndex(LowerTier):
    """Existence answers about a shared server, asked asynchronously (module docstring).

    Thread safety: the engine's scheduler thread calls every method; one background thread
    sends existence checks. They share ``_known``/``_queued``/``_down_until`` under a lock.
    """

    name = "remote"

    def __init__(self, config: OffloadConfig, remote: RemoteTierConfig, ns: str, *,
                 client_factory: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Args:
            config: the offload configuration (number of ranks).
            remote: the remote tier's settings.
            ns: the namespace fingerprint.
            client_factory: builds the redis client (default: ``connect``).
            clock: monotonic seconds (tests pass a fake one).
        """
        self.write_mode = remote.write_mode
        self.stats = LowerTierStats()
        self.settings = remote
        self.namespace = ns
        self._ranks = config.num_workers
        self._clock = clock
        self._factory = client_factory or (lambda: connect(remote, 2))
        self._errors = remote_errors()
        self._cond = threading.Condition(threading.Lock())
        self._known: OrderedDict[OffloadKey, _Answer] = OrderedDict()
        self._queued: dict[OffloadKey, None] = {}
        self._probing: set[OffloadKey] = set()
        self._writing: set[OffloadKey] = set()
        self._down_until = 0.0
        self._down = False
        self._refused = False
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- inspection -------------------------------------------------------------------

    @property
    def is_down(self) -> bool:
        """Whether the tier is skipped now (unreachable recently, or refused our
        credentials)."""
        with self._cond:
            return self._clock() < self._down_until

    @property
    def refused(self) -> bool:
        """Whether the server refused the credentials (the tier is off for good)."""
        with self._cond:
            return self._refused

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Block until no existence check is queued or in flight (tests, tools)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queued or self._probing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # -- LowerTier --------------------------------------------------------------------

    def answer_wait_s(self, key: OffloadKey) -> float:
        """While an existence check of ``key`` is queued or in flight: the bound on one
        round trip plus a connection (``timeout_s + connect_timeout_s``), after which the
        check has answered or the tier is down (every lookup MISS). Else 0.0."""
        with self._cond:
            if key not in self._queued and key not in self._probing:
                return 0.0
        return self.settings.timeout_s + self.settings.connect_timeout_s

    def status(self, key: OffloadKey) -> LookupResult:
        if key in self._writing:
            self.stats.lookups_pending += 1
            return LookupResult.PENDING
        with self._cond:
            now = self._clock()
            if self._closed or now < self._down_until:
                self.stats.lookups_absent += 1
                return LookupResult.MISS
            answer = self._known.get(key)
            if answer is not None:
                if answer.present or not answer.used or \
                        now - answer.at < self.settings.negative_ttl_s:
                    answer.used = True
                    if answer.present:
                        self.stats.lookups_present += 1
                        return LookupResult.HIT
                    self.stats.lookups_absent += 1
                    return LookupResult.MISS
                del self._known[key]
            if key not in self._queued and key not in self._probing:
                self._queued[key] = None
                self._ensure_thread()
                self._cond.notify_all()
        self.stats.lookups_pending += 1
        return LookupResult.PENDING

    def begin_read(self, key: OffloadKey) -> bool:
        return not self.is_down

    def end_read(self, key: OffloadKey, ok: bool) -> None:
        if ok:
            self.stats.reads_ok += 1
            return
        self.stats.reads_failed += 1
        self.stats.dropped += 1
        self._remember(key, present=False)

    def begin_write(self, key: OffloadKey) -> bool:
        if key in self._writing or self.is_down:
            self.stats.writes_skipped += 1
            return False
        with self._cond:
            answer = self._known.get(key)
            if answer is not None and answer.present:
                self.stats.writes_skipped += 1
                return False
        self._writing.add(key)
        self.stats.writes_started += 1
        return True

    def end_write(self, key: OffloadKey, ok: bool) -> None:
        self._writing.discard(key)
        if ok:
            self.stats.writes_ok += 1
            self._remember(key, present=True)
        else:
            self.stats.writes_failed += 1

    def mark_unreachable(self) -> None:
        with self._cond:
            self._go_down("a worker could not reach it")

    def reset(self) -> bool:
        """Forget every answer and write; the shared server keeps its blocks."""
        with self._cond:
            self._known.clear()
            self._queued.clear()
        self._writing.clear()
        return False

    def check_integrity(self) -> None:
        with self._cond:
            overlap = self._queued.keys() & self._probing
        if overlap:
            raise InvariantError(f"remote: {len(overlap)} keys both queued and in flight")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)

    # -- internals --------------------------------------------------------------------

    def _remember(self, key: OffloadKey, *, present: bool) -> None:
        with self._cond:
            self._known[key] = _Answer(present, self._clock())
            self._known.move_to_end(key)
            self._trim()

    def _trim(self) -> None:
        excess = len(self._known) - self.settings.max_known_keys
        for _ in range(max(0, excess)):
            self._known.popitem(last=False)

    def _go_down(self, why: str) -> None:
        """Skip the tier for ``retry_interval_s`` (lock held)."""
        self._down_until = max(self._down_until,
                               self._clock() + self.settings.retry_interval_s)
        self.stats.unreachable += 1
        if not self._down:
            self._down = True
            logger.warning("remote tier %s unreachable (%s); skipping it for %.1f s, the "
                           "engine keeps serving from the other tiers",
                           self.settings.shown_url, why, self.settings.retry_interval_s)

    def _refuse(self, exc: BaseException) -> None:
        """The server refused the credentials: off for good, one error (lock held)."""
        self._down_until = math.inf
        self._queued.clear()
        self._down = True
        if not self._refused:
            self._refused = True
            self.stats.extra["refused"] = self.stats.extra.get("refused", 0) + 1
            why = (str(exc) if isinstance(exc, ConfigError)
                   else refused_message(self.settings, exc))
            logger.error("remote tier: %s; the tier stays off until the engine restarts "
                         "(the other tiers keep serving)", why)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvoffload-remote-index",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        client: Any = None
        stale_slots = False
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
                batch = list(islice(self._queued, _PROBE_BATCH))
                for key in batch:
                    del self._queued[key]
                self._probing.update(batch)
            try:
                if client is None:
                    client = self._factory()
                elif stale_slots:
                    # A cluster node failed or moved slots: read the slot map again (from
                    # any node the client knows).
                    client.nodes_manager.initialize()
                stale_slots = False
                counts = self._exists(client, batch)
            except Exception as exc:  # never kill the thread
                stale_slots = self.settings.cluster
                self._probe_failed(exc, batch)
                continue
            with self._cond:
                now = self._clock()
                for key, count in zip(batch, counts, strict=True):
                    self._known[key] = _Answer(count == self._ranks, now)
                    self._known.move_to_end(key)
                self._trim()
                self._probing.difference_update(batch)
                if self._down:
                    self._down = False
                    logger.info("remote tier %s answers again", self.settings.shown_url)
                self._cond.notify_all()
        if client is not None:
            try:
                client.close()
                client.connection_pool.disconnect()
            except Exception:  # pragma: no cover - best effort at shutdown
                logger.debug("closing the remote index client failed", exc_info=True)

    def _probe_failed(self, exc: Exception, batch: Sequence[OffloadKey]) -> None:
        """An existence check raised: refused credentials turn the tier off, an
        unreachable server marks it down, anything else (a bug, an unexpected reply) is
        logged with its traceback."""
        refused = auth_failure(exc) or isinstance(exc, ConfigError)
        unreachable = not refused and isinstance(exc, self._errors)
        if not (refused or unreachable):
            logger.error("remote tier existence check failed", exc_info=exc)
        with self._cond:
            self._probing.difference_update(batch)
            if refused:
                self._refuse(exc)
            elif unreachable:
                self._queued.clear()  # asked again once the tier is retried
                self._go_down(f"{type(exc).__name__}: {exc}")
            self._cond.notify_all()

    def _exists(self, client: Any, keys: Sequence[OffloadKey]) -> list[int]:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(*(remote_key(self.namespace, r, key) for r in range(self._ranks)))
        return [int(n) for n in pipe.execute()]
