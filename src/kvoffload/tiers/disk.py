"""The disk tier's bookkeeping (``DiskIndex``): which blocks a directory holds, its byte
budget and its eviction order.

The workers write one file per block and rank (``kvoffload.tiers.naming.block_path``:
``<path>/<namespace>/rank<r>/<xx>/<key hex>.kvb``, header and payload as in
``kvoffload.blockfile.framing``). This index runs in the scheduler process: it owns the
budget (``DiskTierConfig.capacity_bytes``, all ranks' files together, headers included),
picks victims with an eviction policy (the eviction half of the cache policy
``DiskTierConfig.eviction_policy`` names, which ``kvoffload.offload`` resolves), pins
blocks being promoted so they are not deleted under a reader, and hands out the deletions
it decides (``take_deletes``) for the cascade to turn into ``DELETE`` tier jobs. It reads
directory listings, never a block.

Restart. On construction the index is rebuilt from the directory: a key counts as stored
when every rank's file exists with exactly the size its group implies; keys are ordered by
the files' modification time (oldest evicted first). Incomplete keys (a rank missing, a
wrong size: a crash mid-write, a changed layout) are deleted. Stray temporary files are the
workers' to clean (``DiskStore`` does at start). Contents are verified when read: a file
that passes the listing but fails its checksum is a miss, dropped then.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from kvoffload.blockfile.framing import HEADER_BYTES, MAX_KEY_BYTES
from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey, key_group
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.config import DiskTierConfig
from kvoffload.tiers.eviction import WRITING, BlockState, EvictionPolicy, LRUPolicy
from kvoffload.tiers.lower import LowerTier, LowerTierStats
from kvoffload.tiers.naming import key_of_file_name, rank_dir


class DiskIndex(LowerTier):
    """Bookkeeping of the disk tier (see the module docstring).

    Pins: ``begin_read`` pins a key until ``end_read``; a key being written or pinned is
    never evicted. ``begin_write`` evicts idle keys (oldest by policy) until the new key
    fits the budget, or changes nothing when even that could not make room.
    """

    name = "disk"

    def __init__(self, config: OffloadConfig, disk: DiskTierConfig, ns: str, *,
                 scan: bool = True, name: str = "disk",
                 eviction: Callable[[int], EvictionPolicy] = LRUPolicy) -> None:
        """Args:
            config: the offload configuration (groups, block sizes, ranks).
            disk: the disk tier's settings.
            ns: the namespace fingerprint (``kvoffload.tiers.naming.namespace``).
            scan: rebuild the index from the directory (off: start empty -- tests, and
                simulations that model a tier without touching a disk).
            name: the tier's name in tier jobs (a simulation models the remote tier as a
                budgeted index too, named "remote").
            eviction: builds the eviction policy for a capacity in keys (least recently
                used unless given: the order of a budgeted store).
        """
        self.name = name
        self.write_mode = disk.write_mode
        self.stats = LowerTierStats()
        self.root = disk.path
        self.namespace = ns
        self.capacity_bytes = disk.capacity_bytes
        self._num_groups = len(config.resolved)
        self._num_ranks = config.num_workers
        self._file_bytes = tuple(HEADER_BYTES + g.block_bytes for g in config.resolved)
        self._entry_bytes = tuple(self._num_ranks * b for b in self._file_bytes)
        capacity_keys = max(1, self.capacity_bytes // min(self._entry_bytes))
        self._policy: EvictionPolicy = eviction(capacity_keys)
        self._used = 0
        self._busy = 0  # bytes of keys being written or pinned (never evictable)
        self._deletes: list[OffloadKey] = []
        if scan:
            self._rebuild()

    # -- inspection -------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of every key present (being written included), all ranks."""
        return self._used

    def __len__(self) -> int:
        return len(self._policy)

    def held(self) -> tuple[int, int]:
        return self._used, len(self._policy)

    def __contains__(self, key: object) -> bool:
        return key in self._policy

    def entry_bytes(self, key: OffloadKey) -> int:
        """Disk bytes ``key`` takes over all ranks' files."""
        return self._entry_bytes[key_group(key)]

    # -- LowerTier --------------------------------------------------------------------

    def status(self, key: OffloadKey) -> LookupResult:
        state = self._policy.get(key)
        if state is None:
            self.stats.lookups_absent += 1
            return LookupResult.MISS
        if state.ref == WRITING:
            self.stats.lookups_pending += 1
            return LookupResult.PENDING
        self.stats.lookups_present += 1
        return LookupResult.HIT

    def begin_read(self, key: OffloadKey) -> bool:
        state = self._policy.get(key)
        if state is None or state.ref == WRITING:
            return False
        if state.ref == 0:
            self._busy += self.entry_bytes(key)
        state.ref += 1
        return True

    def end_read(self, key: OffloadKey, ok: bool) -> None:
        state = self._policy.get(key)
        if state is None or state.ref <= 0:
            raise InvariantError(f"disk end_read: key {key.hex()} is not pinned")
        state.ref -= 1
        if state.ref == 0:
            self._busy -= self.entry_bytes(key)
        if ok:
            self.stats.reads_ok += 1
            return
        self.stats.reads_failed += 1
        if state.ref == 0:
            self._drop(key)

    def begin_write(self, key: OffloadKey) -> bool:
        if self._policy.get(key) is not None:
            self._policy.touch([key])
            self.stats.writes_skipped += 1
            return False
        size = self.entry_bytes(key)
        if not self._make_room(size, key):
            self.stats.writes_skipped += 1
            return False
        self._policy.insert(key, BlockState(0))
        self._used += size
        self._busy += size
        self.stats.writes_started += 1
        return True

    def end_write(self, key: OffloadKey, ok: bool) -> None:
        state = self._policy.get(key)
        if state is None or state.ref != WRITING:
            raise InvariantError(f"disk end_write: key {key.hex()} is not being written")
        size = self.entry_bytes(key)
        self._busy -= size
        if ok:
            state.ref = 0
            self.stats.writes_ok += 1
            return
        self.stats.writes_failed += 1
        self._policy.remove(key)
        self._used -= size
        self._deletes.append(key)  # a rank may have written its file
        self.stats.dropped += 1

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._policy.touch(keys)

    def take_deletes(self) -> list[OffloadKey]:
        deletes, self._deletes = self._deletes, []
        return deletes

    def reset(self) -> bool:
        """Forget everything; the directory must be purged (returns True)."""
        self._policy.clear()
        self._used = self._busy = 0
        self._deletes = []
        return True

    def check_integrity(self) -> None:
        self._policy.check_integrity()
        used = busy = 0
        for key, state in self._policy.items():
            size = self.entry_bytes(key)
            used += size
            if state.ref != 0:
                busy += size
        if (used, busy) != (self._used, self._busy):
            raise InvariantError(f"disk: counted {used} used / {busy} busy bytes, counters "
                                 f"say {self._used} / {self._busy}")
        if self._used > self.capacity_bytes:
            raise InvariantError(f"disk: {self._used} bytes exceed the budget "
                                 f"{self.capacity_bytes}")

    # -- internals --------------------------------------------------------------------

    def _make_room(self, size: int, key: OffloadKey) -> bool:
        """Evict idle keys until ``size`` more bytes fit; False (no change) if impossible."""
        if size > self.capacity_bytes:
            return False
        need = self._used + size - self.capacity_bytes
        if need <= 0:
            return True
        if need > self._used - self._busy:
            return False
        # The idle bytes cover ``need``, so this evicts (it raises otherwise).
        victims = self._policy.evict_bytes(need, 0, frozenset((key,)), self.entry_bytes)
        for victim, _ in victims:
            self._used -= self.entry_bytes(victim)
            self._deletes.append(victim)
        self.stats.evicted += len(victims)
        return True

    def _drop(self, key: OffloadKey) -> None:
        self._policy.remove(key)
        self._used -= self.entry_bytes(key)
        self._deletes.append(key)
        self.stats.dropped += 1

    def _rebuild(self) -> None:
        """Index the blocks every rank has on disk (see the module docstring)."""
        listings = [_list_rank(rank_dir(self.root, self.namespace, r))
                    for r in range(self._num_ranks)]
        found: list[tuple[int, OffloadKey]] = []
        for key in set().union(*listings):
            group = key_group(OffloadKey(key)) if 2 < len(key) <= MAX_KEY_BYTES else -1
            if 0 <= group < self._num_groups and all(
                    listing.get(key, (-1, 0))[0] == self._file_bytes[group]
                    for listing in listings):
                found.append((listings[0][key][1], OffloadKey(key)))
            else:
                self._deletes.append(OffloadKey(key))
        found.sort()
        for _, key in found:
            self._policy.insert(key, BlockState(0, ref=0))
            self._used += self.entry_bytes(key)
        self.stats.extra["rebuilt_keys"] = len(found)
        self.stats.extra["rebuild_garbage"] = len(self._deletes)
        if self._used > self.capacity_bytes:
            # The budget shrank since the files were written: drop the oldest.
            self._make_room(0, OffloadKey(b""))


def _list_rank(directory: str) -> dict[bytes, tuple[int, int]]:
    """Block files of one rank: key -> (size, mtime_ns). Missing directory: empty."""
    out: dict[bytes, tuple[int, int]] = {}
    try:
        subdirs = list(os.scandir(directory))
    except FileNotFoundError:
        return out
    for sub in subdirs:
        if not sub.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(sub.path):
            key = key_of_file_name(entry.name)
            if key is None or key.hex()[:2] != sub.name or \
                    not entry.is_file(follow_symlinks=False):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            out[key] = (st.st_size, st.st_mtime_ns)
    return out
