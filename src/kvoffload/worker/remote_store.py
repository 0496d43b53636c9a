"""``RemoteStore``: one rank's blocks on a shared Redis/Valkey server.

Each block is one string value, ``header + payload`` (``kvoffload.blockfile.framing``), under
``kvoffload.tiers.naming.remote_key`` (namespace, rank, key). A batch of blocks is one
pipelined round trip of binary ``SET``s or ``GET``s (no transaction: each command stands
alone, and ``SET`` is atomic, so a reader never sees half a block). Connections come from
redis-py's bounded pool; every call (a round trip with the connection it may open) ends
within ``connect_timeout_s + timeout_s`` however the server answers (a whole-call
deadline, ``kvoffload.tiers.remote_deadline``); a reply that is not Redis counts as an
unreachable server. ``SET`` commands
are packed here (header bytes, then the payload straight from the host slot, no copy);
everything else is plain redis-py.

Outcomes: a missing value (never stored, or evicted by the server's ``maxmemory`` policy)
reads as a miss; a value of the wrong size, or whose header, checksum or MAC does not match,
is deleted and read as a miss; a ``SET`` the server refuses (out of memory) writes as
``False``. Reads ask for at most one byte more than the block's size (``GETRANGE``), so an
oversized value costs no more than that before it is dropped. A connection error or
timeout raises ``TierUnavailable`` and makes the store refuse further calls at once for
``retry_interval_s`` (so a dead server costs one timeout, not one per block); the first
call after that tries the server again. A server that refuses the credentials
(``kvoffload.tiers.remote.auth_failure``) gets one error logged and no further call: the
store raises ``TierUnavailable`` at once until it is closed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvoffload.blockfile.framing import HEADER_BYTES, BytesLike, MacKey, check, encode_header
from kvoffload.errors import shown
from kvoffload.tiers.config import RemoteTierConfig
from kvoffload.tiers.naming import remote_key
from kvoffload.tiers.remote import (
    auth_failure,
    call_bound_s,
    connect,
    refused_message,
    remote_errors,
    unexpected_reply,
)
from kvoffload.tiers.remote_deadline import deadline
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
                (None: unkeyed checksums only; ``kvoffload.blockfile.framing``).
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
        self._stale_slots = False
        self._refused = False

    def _rkey(self, key: bytes) -> bytes:
        return remote_key(self.namespace, self.rank, key)

    # -- BlockStore ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        """One pipelined round trip of ``SET``s per server (one for a standalone server, one
        per master that owns some of the blocks on a cluster). The commands are packed
        here so that each payload goes to the socket straight from its host slot (redis-py's
        pipeline would need header and payload joined into one copy first); connections,
        their pools, timeouts and reply parsing are redis-py's.

        On a cluster, a ``MOVED``/``ASK`` reply (the slot moved since the client read the
        slot map) leaves that block unwritten (a future miss) and makes the next call read
        the slot map again."""
        self._check_up()
        if not self.settings.cluster:
            return self._put_on(self._client.connection_pool, items)
        by_node: dict[str, list[int]] = {}
        nodes: dict[str, Any] = {}
        try:
            for i, (key, _) in enumerate(items):
                node = self._client.get_node_from_key(self._rkey(key))
                nodes[node.name] = node
                by_node.setdefault(node.name, []).append(i)
        except self._errors as exc:
            self._went_down(exc)
        out = [False] * len(items)
        for name, indices in by_node.items():
            pool = nodes[name].redis_connection.connection_pool
            for i, ok in zip(indices, self._put_on(pool, [items[i] for i in indices]),
                             strict=True):
                out[i] = ok
        return out

    def _put_on(self, pool: Any, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        """Pipelined ``SET``s of ``items`` on one connection of ``pool``."""
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
        replies = self._round_trip(pool, chunks, len(items))
        self._check_refused(replies)
        out = []
        for (key, _), reply, size in zip(items, replies, sizes, strict=True):
            ok = reply == b"OK"
            if ok:
                self._count(writes=1, written_bytes=size)
            else:
                self._count(write_errors=1)
                if _is_redirect(reply):
                    self._stale_slots = True
                logger.debug("remote tier: SET of %s refused: %s", key.hex()[:16], shown(reply))
            out.append(ok)
        return out

    def get_into(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        """One pipelined round trip of ``GETRANGE key 0 size`` (inclusive end: at most one
        byte past the expected ``size``, so an oversized value is told apart without
        fetching it whole). A missing key reads as an empty value: a miss."""
        self._check_up()
        pipe = self._client.pipeline(transaction=False)
        for key, dest in items:
            pipe.getrange(self._rkey(key), 0, HEADER_BYTES + dest.nbytes)
        replies = self._execute(pipe, max((HEADER_BYTES + dest.nbytes + 1
                                           for _, dest in items), default=0))
        self._check_refused(replies)
        out = []
        damaged = []
        for (key, dest), value in zip(items, replies, strict=True):
            if not value or not isinstance(value, bytes):  # absent, an error reply, junk
                self._count(misses=1)
                out.append(False)
                continue
            view = memoryview(value)
            if view.nbytes != HEADER_BYTES + dest.nbytes:
                size = (f"more than {HEADER_BYTES + dest.nbytes}"
                        if view.nbytes > HEADER_BYTES + dest.nbytes else f"{view.nbytes}")
                problem: str | None = (f"{size} bytes, expected "
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
                with deadline(call_bound_s(self.settings)):
                    self._client.delete(*damaged)
            except Exception as exc:
                if auth_failure(exc):
                    self._went_down(exc)
                if not isinstance(exc, self._errors):
                    raise
                logger.debug("remote tier: could not delete damaged blocks", exc_info=True)
        return out

    def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        self._check_up()
        try:
            with deadline(call_bound_s(self.settings)):
                self._client.delete(*(self._rkey(k) for k in keys))
        except Exception as exc:
            if auth_failure(exc) or isinstance(exc, self._errors):
                self._went_down(exc)
            raise

    def purge(self) -> None:
        """Shared blocks are never purged by one engine (other engines may use them)."""

    @property
    def client(self) -> Any:
        """The redis-py client (tools and fault injection; workers go through ``put`` and
        ``get_into``)."""
        return self._client

    def close(self) -> None:
        """Close the client and disconnect every connection of its pool (the server sees
        this worker's clients go)."""
        try:
            self._client.close()  # a cluster client disconnects every node's pool here
            pool = getattr(self._client, "connection_pool", None)
            if pool is not None:
                pool.disconnect()
        except Exception:  # pragma: no cover - best effort at shutdown
            logger.debug("closing the remote client failed", exc_info=True)

    # -- internals ----------------------------------------------------------------------

    def _check_up(self) -> None:
        with self._lock:
            if self._refused:
                raise TierUnavailable("remote tier off: the server refused the credentials")
            if self._clock() < self._down_until:
                raise TierUnavailable("remote tier skipped: unreachable moments ago")
            refresh, self._stale_slots = self._stale_slots, False
        if refresh:
            # A cluster's slot map changed (a redirect, or a node lost): read it again.
            try:
                with deadline(call_bound_s(self.settings)):
                    self._client.nodes_manager.initialize()
            except self._errors as exc:
                self._went_down(exc)

    def _check_refused(self, replies: Sequence[Any]) -> None:
        """A per-command error reply refusing the credentials (``NOPERM``) stops the store
        as a refused login does."""
        for reply in replies:
            if isinstance(reply, Exception) and auth_failure(reply):
                self._went_down(reply)

    def _round_trip(self, pool: Any, chunks: Sequence[BytesLike], replies: int) -> list[Any]:
        """Send packed commands on one connection of ``pool``; read ``replies`` replies (an
        error reply, e.g. the server out of memory, is returned, not raised), all within
        ``call_bound_s``."""
        try:
            with deadline(call_bound_s(self.settings)):
                return self._send_and_read(pool, chunks, replies)
        except self._errors as exc:
            self._went_down(exc)

    @staticmethod
    def _send_and_read(pool: Any, chunks: Sequence[BytesLike], replies: int) -> list[Any]:
        from redis.exceptions import ResponseError

        conn = pool.get_connection()
        try:
            conn.send_packed_command(chunks)
            out: list[Any] = []
            for _ in range(replies):
                try:
                    out.append(conn.read_response())
                except ResponseError as exc:
                    out.append(exc)
            return out
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    def _execute(self, pipe: Any, max_reply_bytes: int) -> list[Any]:
        """A pipeline's replies within ``call_bound_s`` (an error reply per command is
        returned, not raised), none longer than ``max_reply_bytes``; a reply redis-py
        cannot convert, or a longer one, counts as unreachable."""
        try:
            with deadline(call_bound_s(self.settings), max(max_reply_bytes, 1 << 16)):
                try:
                    return list(pipe.execute(raise_on_error=False))
                except (ValueError, TypeError, IndexError) as exc:
                    raise unexpected_reply("GETRANGE", str(exc)) from None
        except self._errors as exc:
            self._went_down(exc)

    def _went_down(self, exc: BaseException) -> NoReturn:
        refused = auth_failure(exc)
        with self._lock:
            first = refused and not self._refused
            if refused:
                self._refused = True
                self._down_until = math.inf
            else:
                self._down_until = max(self._down_until,
                                       self._clock() + self.settings.retry_interval_s)
                self._stale_slots = self.settings.cluster  # a node may have failed over
        if first:
            logger.error("rank %d: remote tier %s; no more calls to it until the worker "
                         "restarts", self.rank, refused_message(self.settings, exc))
        raise TierUnavailable(f"remote tier {self.settings.shown_url}: "
                              f"{type(exc).__name__}: {shown(str(exc))}") from exc


def _is_redirect(reply: object) -> bool:
    """Whether a reply says the slot lives elsewhere or is moving: ``MOVED``/``ASK`` (redis-py
    raises ``MovedError``, a kind of ``AskError``), ``TRYAGAIN`` or ``CLUSTERDOWN``."""
    from redis.exceptions import AskError, ClusterDownError, TryAgainError

    return isinstance(reply, (AskError, TryAgainError, ClusterDownError))
