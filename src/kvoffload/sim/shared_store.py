"""A modelled remote store shared by several engines (``SharedStore``), for simulated
fleets (``kvoffload.sim.fleet``).

In a deployment, a fleet's shared tier is a Redis/Valkey server that every engine's
cascade writes through and promotes from, each engine asking it through its own
``RemoteIndex``. A simulation moves no bytes and must not need a server, so the store is
modelled in-process, the way ``kvoffload.offload.build_offload(accounting=True)`` models one
engine's remote tier: a ``DiskIndex`` named "remote" that starts empty -- the keys held, a
byte budget for
all ranks together, LRU eviction of idle keys (a server's ``maxmemory``). One such index
is shared: each engine's cascade gets a ``SharedStoreView`` of it, a ``LowerTier`` that
answers as a ``RemoteIndex`` does:

* ``status``: PENDING while *this* engine writes the key; HIT when the store holds
  it; MISS otherwise -- also while another engine is still writing it (a server has no
  value before the write lands). Existence checks are modelled exact and instant; a real
  ``RemoteIndex`` asks asynchronously and trusts an "absent" answer for
  ``negative_ttl_s``, so a real fleet sees another engine's block a little later.
* ``begin_read`` pins the key in the store until its promote ends (a pinned key is never
  evicted under a reader); ``end_read(ok=False)`` drops it, as a block the server lost.
* ``begin_write`` skips a key the store holds or another engine is writing (one copy is
  enough) and evicts the least recently used idle keys for room. The evictions are
  handed out as ``DELETE`` tier jobs of the first engine that collects them; they move
  no bytes (as in the one-engine model, so one view alone behaves exactly like it).
* ``touch``: recency in the store, shared by every engine.
* ``reset`` (a cache reset of one engine): that engine's writes in flight are dropped and
  its pins released; the store keeps every other block (``RemoteIndex.reset`` keeps the
  server's blocks too).
* ``held`` answers (0, 0), as a tier shared by a fleet does (``LowerTier.held``); the
  fleet reports the store's contents once, ``SharedStore.held``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.config import DiskTierConfig, RemoteTierConfig, WriteMode
from kvoffload.tiers.disk import DiskIndex
from kvoffload.tiers.lower import LowerTier, LowerTierStats


class SharedStore:
    """The store every ``SharedStoreView`` reads and writes (see the module docstring).

    Args:
        config: the engines' offload configuration (groups, block sizes, ranks); every
            engine of the fleet has the same one.
        capacity_bytes: the store's budget, all ranks together.
        write_mode: how the engines' cascades fill it (default write-through, as a
            ``RemoteTierConfig``).
    """

    def __init__(self, config: OffloadConfig, capacity_bytes: int, *,
                 write_mode: WriteMode = RemoteTierConfig.write_mode) -> None:
        model = DiskTierConfig("(simulated shared store)", capacity_bytes,
                               write_mode=write_mode)
        self.index = DiskIndex(config, model, "shared", scan=False, name="remote")
        """The store's contents, budget and LRU order (all engines' keys)."""
        self.views: list[SharedStoreView] = []

    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    def view(self) -> SharedStoreView:
        """A new engine's view of the store (one per cascade)."""
        view = SharedStoreView(self)
        self.views.append(view)
        return view

    def held(self) -> tuple[int, int]:
        """(bytes, blocks) the store holds, being written included."""
        return self.index.held()

    def check_integrity(self) -> None:
        """The index is consistent and every key a view writes is in it."""
        self.index.check_integrity()
        for view in self.views:
            view.check_integrity()


class SharedStoreView(LowerTier):
    """One engine's view of a ``SharedStore`` (see the module docstring); its ``stats``
    count this engine's lookups, reads and writes."""

    name = "remote"

    def __init__(self, store: SharedStore) -> None:
        self.store = store
        self.write_mode = store.index.write_mode
        self.stats = LowerTierStats()
        self._writing: set[OffloadKey] = set()
        self._reading: Counter[OffloadKey] = Counter()

    def status(self, key: OffloadKey) -> LookupResult:
        if key in self._writing:
            self.stats.lookups_pending += 1
            return LookupResult.PENDING
        if self.store.index.status(key) is LookupResult.HIT:
            self.stats.lookups_present += 1
            return LookupResult.HIT
        self.stats.lookups_absent += 1  # absent, or another engine's write not landed yet
        return LookupResult.MISS

    def begin_read(self, key: OffloadKey) -> bool:
        if not self.store.index.begin_read(key):
            return False
        self._reading[key] += 1
        return True

    def end_read(self, key: OffloadKey, ok: bool) -> None:
        if self._reading[key] <= 0:
            raise InvariantError(f"shared store end_read: key {key.hex()} is not being "
                                 "read by this engine")
        self._reading[key] -= 1
        if not self._reading[key]:
            del self._reading[key]
        self.store.index.end_read(key, ok)
        if ok:
            self.stats.reads_ok += 1
        else:
            self.stats.reads_failed += 1
            self.stats.dropped += 1

    def begin_write(self, key: OffloadKey) -> bool:
        index = self.store.index
        evicted = index.stats.evicted
        if not index.begin_write(key):  # held, written by an engine already, or no room
            self.stats.writes_skipped += 1
            return False
        self.stats.evicted += index.stats.evicted - evicted
        self._writing.add(key)
        self.stats.writes_started += 1
        return True

    def end_write(self, key: OffloadKey, ok: bool) -> None:
        if key not in self._writing:
            raise InvariantError(f"shared store end_write: key {key.hex()} is not being "
                                 "written by this engine")
        self._writing.discard(key)
        self.store.index.end_write(key, ok)
        if ok:
            self.stats.writes_ok += 1
        else:
            self.stats.writes_failed += 1

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.store.index.touch(keys)

    def take_deletes(self) -> list[OffloadKey]:
        return self.store.index.take_deletes()

    def reset(self) -> bool:
        """Drop this engine's writes in flight and release its pins; the store keeps its
        blocks (returns False: nothing to purge)."""
        index = self.store.index
        for key in self._writing:
            index.end_write(key, ok=False)
        self._writing.clear()
        for key, pins in self._reading.items():
            for _ in range(pins):
                index.end_read(key, ok=True)
        self._reading.clear()
        return False

    def check_integrity(self) -> None:
        index = self.store.index
        lost = [key for key in (*self._writing, *self._reading) if key not in index]
        if lost:
            raise InvariantError(f"shared store: {len(lost)} keys this engine reads or "
                                 "writes are not in the store")
