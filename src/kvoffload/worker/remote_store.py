"""``RemoteStore``: one rank's blocks on a shared Redis/Valkey server.

Each block is one string value, ``header + payload`` (``kvoffload.tiers.framing``), under
``kvoffload.tiers.naming.remote_key`` (namespace, rank, key). A batch of blocks is one
pipelined round trip of binary ``SET``s or ``GET``s (no transaction: each command stands
alone, and ``SET`` is atomic, so a reader never sees half a block). Connections come from
redis-py's bounded pool; every round trip is bounded by ``timeout_s``. ``SET`` commands
are packed here (header bytes, then the payload straight from the host slot, no copy);
everything else is plain redis-py.

Outcomes: a missing value (never stored, or evicted by the server's ``maxmemory`` policy)
reads as a miss; a value of the wrong size, or whose header, checksum or MAC does not match,
is deleted and read as a miss; a ``SET`` the server refuses (out of memory) writes as
``False``. A connection error or timeout raises ``TierUnavailable`` and makes the store
refuse further calls at once for ``retry_interval_s`` (so a dead server costs one timeout,
not one per block); the first call after that tries the server again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvoffload.tiers.config import RemoteTierConfig
from kvoffload.tiers.framing import HEADER_BYTES, BytesLike, MacKey, check, encode_header
from kvoffload.tiers.naming import remote_key
from kvoffload.tiers.remote import connect, remote_errors
from kvoffload.worker.block_store import BlockStore, TierUnavailable

logger = logging.getLogger(__name__)


class RemoteStore(BlockStore):
    """Blocks of one rank on a Redis/Valkey server (thread-safe; see module docstring)."""

    name = "remote"

    def __init__(self, remote: RemoteTierConfig, ns: str, rank: int, fingerprint: bytes, *,
                 client: Any = None, clock: Callable[[], float] = time.monotonic,
                 mac_key: MacKey | None = None) -> None:
        """Args:
            remote: the remote tier's settings.
            ns: the namespace fingerprint.
            rank: this worker's rank.
            fingerprint: the layout fingerprint written into and checked in every header.
            client: a redis-py client (default: ``connect`` with ``max_connections``).
            clock: monotonic seconds.
            mac_key: MAC every value with it and accept only values whose MAC verifies
                (None: unkeyed checksums only; ``kvoffload.tiers.framing``).
        """
        super().__init__()
        self.settings = remote
        self.namespace = ns
        self.rank = rank
        self._mac_key = mac_key
        self.fingerprint = fingerprint
        self._client = client if client is not None else connect(remote,
                                                                 remote.max_connections)
        self._errors = remote_errors()
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until = 0.0

    def _rkey(self, key: bytes) -> bytes:
        return remote_key(self.namespace, self.rank, key)

    # -- BlockStore ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        """One pipelined round trip of ``SET``s. The commands are packed here so that each
        payload goes to the socket straight from its host slot (redis-py's pipeline would
        need header and payload joined into one copy first); the connection, its pool,
        timeouts and reply parsing are redis-py's."""
        self._check_up()
        chunks: list[BytesLike] = []
        small = bytearray()
        sizes = []
        for key, payload in items:
            data = memoryview(payload).cast("B")
            header = encode_header(self.fingerprint, self.rank, key, data,
                                   mac_key=self._mac_key)
            name = self._rkey(key)
            small += b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s" % (
                len(name), name, HEADER_BYTES + data.nbytes, header)
            chunks.append(bytes(small))
            chunks.append(data)
            small = bytearray(b"\r\n")
            sizes.append(data.nbytes)
        chunks.append(bytes(small))
        replies = self._round_trip(chunks, len(items))
        out = []
        for (key, _), reply, size in zip(items, replies, sizes, strict=True):
            ok = reply == b"OK"
            if ok:
                self._count(writes=1, written_bytes=size)
            else:
                self._count(write_errors=1)
                logger.debug("remote tier: SET of %s refused: %r", key.hex()[:16], reply)
            out.append(ok)
        return out

    def get_into(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        self._check_up()
        pipe = self._client.pipeline(transaction=False)
        for key, _ in items:
            pipe.get(self._rkey(key))
        replies = self._execute(pipe)
        out = []
        damaged = []
        for (key, dest), value in zip(items, replies, strict=True):
            if value is None or isinstance(value, Exception):
                self._count(misses=1)
                out.append(False)
                continue
            view = memoryview(value)
            if view.nbytes != HEADER_BYTES + dest.nbytes:
                problem: str | None = (f"{view.nbytes} bytes, expected "
                                       f"{HEADER_BYTES + dest.nbytes}")
            else:
                problem = check(view[:HEADER_BYTES], view[HEADER_BYTES:], self.fingerprint,
                                self.rank, key, mac_key=self._mac_key)
            if problem is not None:
                logger.warning("remote tier: dropped block %s: %s", key.hex()[:16], problem)
                damaged.append(self._rkey(key))
                self._count(rejected=1)
                out.append(False)
                continue
            dest[:] = view[HEADER_BYTES:]
            self._count(reads=1, read_bytes=dest.nbytes)
            out.append(True)
        if damaged:
            try:
                self._client.delete(*damaged)
            except self._errors:
                logger.debug("remote tier: could not delete damaged blocks", exc_info=True)
        return out

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        self._check_up()
        try:
            self._client.delete(*(self._rkey(k) for k in keys))
        except self._errors as exc:
            self._went_down(exc)

    def purge(self) -> None:
        """Shared blocks are never purged by one engine (other engines may use them)."""

    @property
    def client(self) -> Any:
        """The redis-py client (tools and fault injection; workers go through ``put`` and
        ``get_into``)."""
        return self._client

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # pragma: no cover - best effort at shutdown
            logger.debug("closing the remote client failed", exc_info=True)

    # -- internals ----------------------------------------------------------------------

    def _check_up(self) -> None:
        with self._lock:
            if self._clock() < self._down_until:
                raise TierUnavailable("remote tier skipped: unreachable moments ago")

    def _round_trip(self, chunks: Sequence[BytesLike], replies: int) -> list[Any]:
        """Send packed commands on one pooled connection; read ``replies`` replies (an
        error reply, e.g. the server out of memory, is returned, not raised)."""
        from redis.exceptions import ResponseError

        pool = self._client.connection_pool
        try:
            conn = pool.get_connection()
        except self._errors as exc:
            self._went_down(exc)
        try:
            conn.send_packed_command(chunks)
            out: list[Any] = []
            for _ in range(replies):
                try:
                    out.append(conn.read_response())
                except ResponseError as exc:
                    out.append(exc)
            return out
        except self._errors as exc:
            conn.disconnect()
            self._went_down(exc)
        finally:
            pool.release(conn)

    def _execute(self, pipe: Any) -> list[Any]:
        try:
            return list(pipe.execute(raise_on_error=False))
        except self._errors as exc:
            self._went_down(exc)

    def _went_down(self, exc: BaseException) -> NoReturn:
        with self._lock:
            self._down_until = self._clock() + self.settings.retry_interval_s
        raise TierUnavailable(f"{type(exc).__name__}: {exc}") from exc
