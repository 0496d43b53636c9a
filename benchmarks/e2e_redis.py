"""A throw-away local ``redis-server`` for the Redis tier of ``vllm_e2e.py``.

It listens on a free loopback port, keeps its files in a temporary directory, persists
nothing, and is killed when the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers_ping(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port),
                                                                timeout=0.2) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(16).startswith(b"+PONG")
    return False


class RedisProcess:
    """A ``redis-server`` on a fixed loopback port that can be killed and started again
    (empty: nothing is persisted), as a Redis tier's server fails in production."""

    def __init__(self, program: str, directory: Path) -> None:
        self.program = program
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server; raise ``RuntimeError`` if it does not answer within 10 s."""
        log = self.directory / "redis-server.log"
        with open(log, "ab") as out:
            self._proc = proc = subprocess.Popen(
                [self.program, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.directory), "--protected-mode",
                 "no", "--loglevel", "warning"], stdout=out, stderr=out)
        deadline = time.monotonic() + 10
        while not _answers_ping(self.port):
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}: "
                                   + log.read_text(errors="replace")[-400:])
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not answer within 10 s")
            time.sleep(0.02)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL); what it held is gone."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


@contextlib.contextmanager
def redis_process(binary: str | None = None) -> Iterator[RedisProcess]:
    """A started ``RedisProcess`` (the program ``binary`` names, else ``redis-server`` on
    PATH), killed when the ``with`` block ends.

    Raises ``RuntimeError`` with what to do when no binary is found or the server does
    not answer within 10 s.
    """
    path = shutil.which(binary or "redis-server")
    if path is None:
        raise RuntimeError(f"{binary or 'redis-server'} is not found: install redis-server "
                           "(scripts/install_redis.sh on Debian/Ubuntu) or leave the Redis "
                           "configuration out with --configs")
    with tempfile.TemporaryDirectory(prefix="kvoffload-e2e-redis-") as directory:
        server = RedisProcess(path, Path(directory))
        try:
            server.start()
            yield server
        finally:
            server.kill()


@contextlib.contextmanager
def redis_server(binary: str | None = None) -> Iterator[str]:
    """Start ``redis-server`` (as ``redis_process``); yield its URL."""
    with redis_process(binary) as server:
        yield server.url
