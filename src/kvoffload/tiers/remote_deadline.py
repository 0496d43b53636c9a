"""Whole-call deadlines for the remote tier's redis-py clients.

redis-py bounds each socket read by ``socket_timeout``; a server that drips one byte just
inside that bound (or sends a bulk length it never fills) holds a call for ever. Here every
call to the server runs inside ``deadline(seconds)``: the connections the call touches
(opened, written or read in this thread while the deadline is active) are registered with
one watchdog thread, which shuts their sockets down when the deadline passes. The blocked
read then ends at once; the call raises redis-py's ``TimeoutError`` (one of
``remote_errors``), which the tier counts as unreachable.

Contract: a call inside ``deadline(s)`` returns or raises within ``s`` plus the time the
watchdog needs to wake (milliseconds), plus at most one TCP connect (bounded by
``connect_timeout_s``: a socket that is still connecting cannot be shut down; a TLS
handshake is bounded as a whole by it too, as CPython's ``ssl`` applies a socket's timeout
to a whole operation). A call that overran its deadline raises ``TimeoutError`` even if
its reply arrived; a call that failed disconnects the connections it touched (never
reused half-read). A reply redis-py cannot make sense of becomes ``InvalidResponse``, so a
server that does not speak Redis is unreachable, never a traceback; a reply longer than
the call can use is refused when announced (``MAX_REPLY_BYTES``). Connections get this
behaviour from the pool classes ``deadline_pool_class`` makes (their connections are
``deadline_connection_class``); a client built otherwise is not bounded beyond its
per-read timeout. With the optional ``hiredis`` parser the reply cap does not apply (the
deadline does).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from functools import cache
from typing import Any

from kvoffload.errors import KVOffloadError, shown

MAX_REPLY_BYTES = 1 << 20
"""The longest single bulk reply or reply line a call accepts unless it says otherwise
(the tier's replies are counts, ``OK`` and short slot-map entries; loads name their own
bound: a block's size)."""


class _Call:
    """One call under a deadline: when it ends and the connections it touched."""

    __slots__ = ("conns", "deadline", "expired", "max_reply", "seconds")

    def __init__(self, seconds: float, max_reply: int) -> None:
        self.seconds = seconds
        self.max_reply = max_reply
        self.deadline = time.monotonic() + seconds
        self.conns: list[Any] = []
        self.expired = False


def _abort(conn: Any) -> None:
    """Shut ``conn``'s socket down: a read blocked on it returns at once."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return
    with suppress(OSError, ValueError):
        sock.shutdown(socket.SHUT_RDWR)


class _Watchdog:
    """One daemon thread that aborts the connections of calls past their deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._calls: set[_Call] = set()
        self._thread: threading.Thread | None = None
        self._wake = float("inf")  # when the thread wakes next (woken early only if needed)

    def add(self, call: _Call) -> None:
        with self._cond:
            self._calls.add(call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kvoffload-remote-deadline")
                self._thread.start()
            if call.deadline < self._wake:
                self._cond.notify_all()

    def remove(self, call: _Call) -> None:
        with self._cond:
            self._calls.discard(call)

    def touch(self, call: _Call, conn: Any) -> None:
        """Register ``conn`` with ``call``; abort it now if the call is already late."""
        with self._cond:
            if not any(c is conn for c in call.conns):
                call.conns.append(conn)
            late = call.expired or time.monotonic() >= call.deadline
            if late:
                call.expired = True
        if late:
            _abort(conn)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                waits = []
                for call in self._calls:
                    if call.expired:
                        continue
                    if call.deadline <= now:
                        call.expired = True
                        for conn in call.conns:
                            _abort(conn)
                    else:
                        waits.append(call.deadline - now)
                wait = min(waits) if waits else None
                self._wake = now + wait if wait is not None else float("inf")
                self._cond.wait(wait)


_WATCHDOG = _Watchdog()
_LOCAL = threading.local()


def _touch(conn: Any) -> None:
    call = getattr(_LOCAL, "call", None)
    if call is not None:
        _WATCHDOG.touch(call, conn)


def _reply_cap() -> int | None:
    call = getattr(_LOCAL, "call", None)
    return None if call is None else call.max_reply


@contextmanager
def deadline(seconds: float, max_reply_bytes: int = MAX_REPLY_BYTES) -> Iterator[None]:
    """Run the block as one call bounded by ``seconds`` (module docstring); raises
    redis-py's ``TimeoutError`` when it overran. Any other exception than redis-py's own,
    ``OSError`` or kvoffload's (redis-py raises ``AttributeError``, ``OverflowError``, ...
    on some replies a real Redis never sends) becomes redis-py's ``InvalidResponse``.
    A bulk reply announced longer than ``max_reply_bytes``, or a reply line that grows
    past it, is ``InvalidResponse`` before it is read (memory stays bounded however much
    the server sends). A call that fails disconnects the connections it touched."""
    from redis.exceptions import InvalidResponse, RedisError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    call = _Call(seconds, max_reply_bytes)
    outer = getattr(_LOCAL, "call", None)
    _LOCAL.call = call
    _WATCHDOG.add(call)
    failed: BaseException | None = None
    try:
        yield
    except Exception as exc:
        failed = exc
    finally:
        _WATCHDOG.remove(call)
        _LOCAL.call = outer
    if call.expired or time.monotonic() > call.deadline:
        for conn in call.conns:
            with suppress(Exception):  # best effort; the call fails anyway
                conn.disconnect()
        raise RedisTimeoutError(f"no complete answer within {seconds:g} s (the bound on "
                                "a whole call)") from failed
    if failed is not None:
        for conn in call.conns:  # never reuse a connection left mid-reply
            with suppress(Exception):
                conn.disconnect()
        if isinstance(failed, (RedisError, OSError, KVOffloadError)):
            raise failed
        raise InvalidResponse(f"a reply that is not Redis ({type(failed).__name__}: "
                              f"{shown(str(failed))})") from failed


class _DeadlineMixin:
    """Registers the connection with the current call before every socket operation."""

    def connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        _touch(self)
        return super().connect_check_health(*args, **kwargs)  # type: ignore[misc]

    def send_packed_command(self, *args: Any, **kwargs: Any) -> Any:
        _touch(self)
        return super().send_packed_command(*args, **kwargs)  # type: ignore[misc]

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        _touch(self)
        _cap_buffer(self)
        return super().read_response(*args, **kwargs)  # type: ignore[misc]

    def can_read(self, *args: Any, **kwargs: Any) -> Any:
        _touch(self)
        return super().can_read(*args, **kwargs)  # type: ignore[misc]


@cache
def deadline_connection_class(base: type) -> type:
    """``base`` (a redis-py connection class) whose calls honour ``deadline``."""
    if issubclass(base, _DeadlineMixin):
        return base
    return type(f"Deadline{base.__name__}", (_DeadlineMixin, base), {})


@cache
def deadline_pool_class(base: type) -> Any:
    """``base`` (a redis-py pool class) whose connections honour ``deadline``."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        from redis.connection import Connection

        kwargs["connection_class"] = deadline_connection_class(
            kwargs.get("connection_class", Connection))
        base.__init__(self, *args, **kwargs)  # type: ignore[misc]

    return type(f"Deadline{base.__name__}", (base,), {"__init__": init})


def _cap_buffer(conn: Any) -> None:
    """Make ``conn``'s reply buffer (redis-py's pure-Python parsers) check ``_reply_cap``."""
    buffer = getattr(getattr(conn, "_parser", None), "_buffer", None)
    if buffer is None:
        return
    capped = _capped_buffer_class()
    if type(buffer) is capped.__base__:
        buffer.__class__ = capped


@cache
def _capped_buffer_class() -> type:
    """redis-py's ``SocketBuffer``, refusing replies longer than the call's cap."""
    from redis._parsers.socket import SocketBuffer
    from redis.exceptions import InvalidResponse

    class CappedSocketBuffer(SocketBuffer):
        def read(self, length: int, *args: Any, **kwargs: Any) -> Any:
            cap = _reply_cap()
            if cap is not None and length > cap:
                raise InvalidResponse(f"a bulk reply of {length:,} bytes announced, more "
                                      f"than the {cap:,} this call reads")
            return super().read(length, *args, **kwargs)

        def _read_from_socket(self, length: int | None = None, *args: Any,
                              **kwargs: Any) -> Any:
            out = super()._read_from_socket(length, *args, **kwargs)
            cap = _reply_cap()
            if length is None and cap is not None and \
                    self.unread_bytes() > cap + 2 * self.socket_read_size:
                raise InvalidResponse(f"a reply line longer than {cap:,} bytes")
            return out

    return CappedSocketBuffer
