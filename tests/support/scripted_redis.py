"""A misbehaving "Redis server" on loopback, scripted per test: it reads real RESP commands
and answers each with a fixed reply (garbage, an error, a huge bulk length), drips a reply
one byte at a time, or never answers.

``ScriptedServer(behaviour)`` listens on ``127.0.0.1`` on a free port from construction
until ``close()`` (or the end of a ``with`` block); every accepted connection gets its own
thread. ``BEHAVIOURS`` names the scripted answers the hostile-input tests use.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType


@dataclass(frozen=True)
class Behaviour:
    """How the server answers: ``reply`` to every command (None: never answer); with
    ``drip_s`` the replies are sent one byte every ``drip_s`` seconds; ``once`` sends the
    reply for the first scripted command only and then stays silent."""

    reply: bytes | None
    drip_s: float = 0.0
    once: bool = False
    on_accept: bool = False
    """Send ``reply`` as soon as a connection is accepted (before any command: e.g. a
    TLS handshake that never completes)."""
    login_ok: bool = True
    """Answer the connection's set-up commands (``CLIENT``, ``HELLO``, ``AUTH``,
    ``SELECT``) with ``+OK``, so the scripted reply meets the tier's own command."""


HTTP_REPLY = (b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n"
              b"Content-Length: 11\r\n\r\nBad Request")

BEHAVIOURS: dict[str, Behaviour] = {
    "http": Behaviour(HTTP_REPLY, login_ok=False),
    "drip-at-login": Behaviour(b"+" + b"O" * 1000, drip_s=0.3, once=True, login_ok=False),
    "integer": Behaviour(b":1\r\n"),
    "ok": Behaviour(b"+OK\r\n"),
    "array": Behaviour(b"*2\r\n$1\r\na\r\n:7\r\n"),
    "error": Behaviour(b"-ERR nope\r\n"),
    "huge-bulk": Behaviour(b"$9223372036854775807\r\n", once=True),
    "drip": Behaviour(b"$1000000\r\n" + b"x" * 1_000_000, drip_s=0.3, once=True),
    "silent": Behaviour(None),
    "long-line": Behaviour(b"+" + b"A" * 200_000 + b"\r\n"),
}

TLS_DRIP = Behaviour(b"\x16\x03\x03\x40\x00" + b"x" * 16384, drip_s=0.2, once=True,
                    on_accept=True)
"""A TLS record header announcing 16 KiB of handshake, then one byte every 0.2 s
(inside the tests' 0.25 s connect timeout)."""

STREAM_BYTES = 200_000_000
STREAM = Behaviour(b"$%d\r\n" % STREAM_BYTES + b"x" * STREAM_BYTES, once=True)
"""A bulk reply of 200 MB, announced and sent at loopback speed (not in ``BEHAVIOURS``:
it costs the server 200 MB)."""


LOGIN_COMMANDS = (b"CLIENT", b"HELLO", b"AUTH", b"SELECT")
HELLO_REPLY = (b"%3\r\n$6\r\nserver\r\n$5\r\nredis\r\n$7\r\nversion\r\n$5\r\n7.2.0\r\n"
               b"$5\r\nproto\r\n:3\r\n")
"""A RESP3 ``HELLO 3`` answer (redis-py asks for RESP3 when it connects)."""


def _commands(buf: bytearray) -> list[bytes]:
    """Remove the complete RESP commands at the start of ``buf``; return their names."""
    names = []
    while True:
        pos = 0
        end = buf.find(b"\r\n", pos)
        if end < 0 or not buf.startswith(b"*"):
            return names
        parts = int(buf[1:end])
        pos = end + 2
        name = b""
        for i in range(parts):
            end = buf.find(b"\r\n", pos)
            if end < 0:
                return names
            size = int(buf[pos + 1:end])
            if i == 0:
                name = bytes(buf[end + 2:end + 2 + size]).upper()
            pos = end + 2 + size + 2
            if pos > len(buf):
                return names
        del buf[:pos]
        names.append(name)


class ScriptedServer:
    """A loopback server answering as ``behaviour`` says (module docstring)."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray()
        answered = False
        try:
            if self.behaviour.on_accept and self.behaviour.reply is not None:
                answered = True
                self._send(conn, self.behaviour.reply)
            while not self._closed.is_set():
                data = conn.recv(1 << 16)
                if not data:
                    return
                buf += data
                for name in _commands(buf):
                    if self.behaviour.login_ok and name in LOGIN_COMMANDS:
                        conn.sendall(HELLO_REPLY if name == b"HELLO" else b"+OK\r\n")
                        continue
                    reply = self.behaviour.reply
                    if reply is None or (self.behaviour.once and answered):
                        continue
                    answered = True
                    self._send(conn, reply)
        except (OSError, ValueError):
            return

    def _send(self, conn: socket.socket, reply: bytes) -> None:
        if not self.behaviour.drip_s:
            conn.sendall(reply)
            return
        for i in range(len(reply)):
            if self._closed.wait(self.behaviour.drip_s):
                return
            conn.sendall(reply[i:i + 1])

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()

    def __enter__(self) -> ScriptedServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def timed(call: Callable[..., object], *args: object,
          limit_s: float = 30.0) -> tuple[float, object]:
    """Run ``call(*args)`` in a thread; return (seconds taken, its result or exception).
    A call still running after ``limit_s`` returns ``(inf, None)`` (a hang)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call(*args))
        except BaseException as exc:  # reported to the test
            out.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        return float("inf"), None
    return time.monotonic() - start, out[0]
