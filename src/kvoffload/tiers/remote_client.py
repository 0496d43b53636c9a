"""The remote tier's redis-py clients and the calls every user of the server shares:
``connect`` (a bounded pool whose connections honour whole-call deadlines), the
credential and TLS keyword arguments, the errors that mean "unreachable or not Redis"
(``remote_errors``), the refused-login test and message, and the start-up check
(``check_credentials``).

Every call to the server runs inside ``deadline(call_bound_s(remote))``
(``kvoffload.tiers.remote_deadline``): it ends within ``connect_timeout_s + timeout_s``
however slowly or strangely the server answers.
"""

from __future__ import annotations

import logging
from typing import Any

from kvoffload.errors import ConfigError, shown
from kvoffload.tiers.config import RemoteTierConfig, url_without_credentials
from kvoffload.tiers.remote_deadline import deadline, deadline_pool_class

logger = logging.getLogger(__name__)

REMOTE_ERRORS: tuple[type[BaseException], ...] = (OSError,)
"""Exceptions meaning "the server is unreachable or too slow" (redis' are added on import)."""


def call_bound_s(remote: RemoteTierConfig) -> float:
    """The bound on one whole call to the server (a command or a pipelined batch, with
    the connection it may open): ``connect_timeout_s + timeout_s``, however slowly or
    strangely the server answers (``kvoffload.tiers.remote_deadline``)."""
    return remote.connect_timeout_s + remote.timeout_s


def connect(remote: RemoteTierConfig, max_connections: int) -> Any:
    """A redis-py client for ``remote.url`` with bounded timeouts and no silent retries.
    Run each call in ``deadline(call_bound_s(remote))`` to bound it as a whole.

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
    pool = deadline_pool_class(redis.BlockingConnectionPool).from_url(
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
    from redis.connection import ConnectionPool
    from redis.retry import Retry

    kwargs = connection_kwargs(remote)
    with deadline(call_bound_s(remote)):  # the client reads the slot map as it is built
        return RedisCluster.from_url(
            url_without_credentials(remote.url), max_connections=max_connections,
            connection_pool_class=deadline_pool_class(ConnectionPool),
            socket_timeout=remote.timeout_s, socket_connect_timeout=remote.connect_timeout_s,
            require_full_coverage=False, retry=Retry(NoBackoff(), 1), **kwargs)



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
    """Connection, timeout and cluster-availability errors of redis-py, plus ``OSError``,
    and the replies of a server that does not speak Redis as the tier expects
    (``InvalidResponse``: a protocol error or an answer of the wrong kind;
    ``ResponseError``: an error reply to a whole call).

    A refused login (``AuthenticationError``) is one of them too: tell it apart with
    ``auth_failure`` before treating the server as merely unreachable.
    """
    try:
        from redis.exceptions import (
            ClusterDownError,
            ClusterError,
            InvalidResponse,
            RedisClusterException,
            ResponseError,
        )
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
    except ImportError:  # pragma: no cover - depends on the environment
        return REMOTE_ERRORS
    # Cluster errors: no master for a slot (failover in progress), or the slot map could
    # not be read; they pass like an unreachable server.
    return (*REMOTE_ERRORS, RedisConnectionError, RedisTimeoutError, ClusterDownError,
            ClusterError, RedisClusterException, InvalidResponse, ResponseError)


def unexpected_reply(what: str, reply: object) -> Exception:
    """redis-py's ``InvalidResponse`` for a reply of the wrong kind (shown cut short)."""
    from redis.exceptions import InvalidResponse

    return InvalidResponse(f"{what} answered {shown(reply)}, not what Redis answers")


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
    """Start-up check: log in once and ``PING``, within ``call_bound_s``; raise
    ``ConfigError`` (naming ``field``) when the server refuses the credentials. A server
    that is unreachable, too slow, or answers something other than Redis passes with a
    warning (the tier skips it while it is down); so does a missing redis-py."""
    try:
        client = connect(remote, 1)
    except ImportError:  # pragma: no cover - depends on the environment
        return
    except ValueError as exc:  # redis-py cannot read the URL (a port that is no number)
        raise ConfigError(field, f"cannot read {shown(remote.shown_url)}: "
                          f"{type(exc).__name__}", "Use redis://host:port/db.") from None
    try:
        with deadline(call_bound_s(remote)):
            if client.ping() is not True:
                raise unexpected_reply("PING", "something other than PONG")
    except Exception as exc:
        if auth_failure(exc):
            raise ConfigError(field, refused_message(remote, exc),
                              "Fix them and start again.") from None
        if not isinstance(exc, (*remote_errors(), ValueError, TypeError)):
            raise
        logger.warning("remote tier %s not usable at start-up (%s: %s); the tier is skipped "
                       "while it is down", remote.shown_url, type(exc).__name__,
                       shown(str(exc)))
    finally:
        client.connection_pool.disconnect()
