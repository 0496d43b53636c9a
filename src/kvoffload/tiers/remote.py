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

Misbehaving server. Each existence check is one call bounded as a whole by
``connect_timeout_s + timeout_s`` (``remote_client.call_bound_s``); a server that drips,
never answers or answers something other than Redis marks the tier down like an
unreachable one. The clients, errors and start-up check live in ``remote_client``
(re-exported here).
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
from kvoffload.errors import ConfigError, InvariantError, shown
from kvoffload.keys import OffloadKey
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.config import RemoteTierConfig
from kvoffload.tiers.lower import LowerTier, LowerTierStats
from kvoffload.tiers.naming import remote_key
from kvoffload.tiers.remote_client import (
    REMOTE_ERRORS,
    auth_failure,
    call_bound_s,
    check_credentials,
    connect,
    connection_kwargs,
    refused_message,
    remote_errors,
    unexpected_reply,
)
from kvoffload.tiers.remote_deadline import deadline

__all__ = ["REMOTE_ERRORS", "RemoteIndex", "auth_failure", "call_bound_s",
           "check_credentials", "connect", "connection_kwargs", "refused_message",
           "remote_errors", "unexpected_reply"]

logger = logging.getLogger(__name__)

_PROBE_BATCH = 512
"""Keys per pipelined existence check."""

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
        """An existence check raised: refused credentials turn the tier off; an
        unreachable, too slow or non-Redis server marks it down (one warning); anything
        else (a bug) marks it down too, its traceback logged once per outage."""
        refused = auth_failure(exc) or isinstance(exc, ConfigError)
        unreachable = not refused and isinstance(exc, self._errors)
        with self._cond:
            if not (refused or unreachable or self._down):
                logger.error("remote tier existence check failed", exc_info=exc)
            self._probing.difference_update(batch)
            if refused:
                self._refuse(exc)
            else:
                self._queued.clear()  # asked again once the tier is retried
                self._go_down(f"{type(exc).__name__}: {shown(str(exc))}")
            self._cond.notify_all()

    def _exists(self, client: Any, keys: Sequence[OffloadKey]) -> list[int]:
        """One pipelined round trip of ``EXISTS`` within ``call_bound_s``; a reply that is
        not a count in ``0..ranks`` raises ``InvalidResponse`` (the tier goes down)."""
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(*(remote_key(self.namespace, r, key) for r in range(self._ranks)))
        try:
            with deadline(call_bound_s(self.settings)):
                replies = pipe.execute()
        except (ValueError, TypeError, IndexError) as exc:  # a reply of the wrong kind
            raise unexpected_reply("EXISTS", str(exc)) from None
        if not isinstance(replies, list) or len(replies) != len(keys):
            raise unexpected_reply("EXISTS", replies)
        for n in replies:
            if type(n) is not int or not 0 <= n <= self._ranks:
                raise unexpected_reply("EXISTS", n)
        return replies
