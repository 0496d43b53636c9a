"""``FaultyBlockStore``: I/O errors, damaged blocks and outages of a lower tier.

It wraps a worker-side ``BlockStore`` (a disk directory, a remote server) and, call by call
from a seeded schedule at ``rate``:

* ``io_error``: the call raises ``OSError`` (its tier jobs fail; a promote is a miss);
* ``corrupt``: a ``put`` succeeds, then ``tamper`` damages the stored block at rest (one
  payload bit flipped), so the next read must reject it and remove it, never serve it;
* ``outage``: the store becomes unreachable (``TierUnavailable``) for ``outage_calls``
  calls, as a remote server that disappears and comes back.

``disk_tamper`` and ``redis_tamper`` damage a block of a ``DiskStore`` or a
``RemoteStore`` in place.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.blockfile.framing import HEADER_BYTES, BytesLike
from kvoffload.faults.plan import draw_fault
from kvoffload.tiers.naming import block_path, remote_key
from kvoffload.worker.block_store import BlockStore, TierUnavailable

STORE_KINDS = ("io_error", "corrupt", "outage")

Tamper = Callable[[bytes], None]
"""Damages the stored block of a key in place."""


class FaultyBlockStore(BlockStore):
    """See the module docstring."""

    def __init__(self, inner: BlockStore, *, rate: float, seed: int = 0,
                 kinds: Sequence[str] = STORE_KINDS, tamper: Tamper | None = None,
                 outage_calls: int = 20) -> None:
        super().__init__()
        unknown = set(kinds) - set(STORE_KINDS)
        if unknown:
            raise ValueError(f"unknown store fault kinds {sorted(unknown)}")
        if "corrupt" in kinds and tamper is None:
            raise ValueError("the corrupt kind needs a tamper function")
        self.inner = inner
        self.name = inner.name
        self.stats = inner.stats
        self.rate = rate
        self.kinds = tuple(kinds)
        self.tamper = tamper
        self.outage_calls = outage_calls
        self.injected: Counter[str] = Counter()
        self.tampered: set[bytes] = set()
        """Keys damaged at rest (and not rewritten since)."""
        self._rng = random.Random(seed)
        self._down_for = 0

    def _fault(self, allowed: Sequence[str]) -> str | None:
        if self._down_for > 0:
            self._down_for -= 1
            raise TierUnavailable(f"{self.name}: injected outage")
        kind = draw_fault(self._rng, self.rate, self.kinds, allowed)
        if kind is None:
            return None
        self.injected[kind] += 1
        if kind == "outage":
            self._down_for = self.outage_calls - 1
            raise TierUnavailable(f"{self.name}: injected outage")
        if kind == "io_error":
            raise OSError(f"{self.name}: injected I/O error")
        return kind

    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        kind = self._fault(STORE_KINDS)
        oks = self.inner.put(items)
        for key, _ in items:
            self.tampered.discard(key)
        if kind == "corrupt" and self.tamper is not None:
            stored = [key for (key, _), ok in zip(items, oks, strict=True) if ok]
            if stored:
                victim = stored[self._rng.randrange(len(stored))]
                self.tamper(victim)
                self.tampered.add(victim)
        return oks

    def get_into(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        self._fault(("io_error", "outage"))
        return self.inner.get_into(items)

    def delete(self, keys: Sequence[bytes]) -> None:
        self._fault(("outage",))
        self.inner.delete(keys)

    def purge(self) -> None:
        self.inner.purge()

    def close(self) -> None:
        self.inner.close()


def disk_tamper(store: Any) -> Tamper:
    """Flip the last payload bit of a ``DiskStore`` block file (the byte before its
    header, which ends the file)."""

    def tamper(key: bytes) -> None:
        path = block_path(store.root, store.namespace, store.rank, key)
        with open(path, "r+b") as f:
            f.seek(-HEADER_BYTES - 1, 2)
            last = f.read(1)
            f.seek(-HEADER_BYTES - 1, 2)
            f.write(bytes([last[0] ^ 0x01]))

    return tamper


def redis_tamper(client: Any, store: Any) -> Tamper:
    """Flip the last payload bit of a ``RemoteStore`` value on the server."""

    def tamper(key: bytes) -> None:
        name = remote_key(store.namespace, store.rank, key)
        value = bytearray(client.get(name))
        value[-1] ^= 0x01
        client.set(name, bytes(value))

    return tamper
