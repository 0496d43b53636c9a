"""The contract of a worker-side block store (a disk directory, a remote server).

A store moves one rank's blocks between byte buffers (host slots) and a lower tier, framed
and checked as ``kvoffload.blockfile.framing`` describes. Stores are called from the tier I/O
threads (``kvoffload.worker.tier_io``), several at once: implementations are thread-safe.

Outcomes are values: a block that is missing, truncated, corrupt or foreign reads as
``False`` (and a damaged one is removed from the store); a block that could not be written
(disk full, server out of memory) writes as ``False``. ``TierUnavailable`` means the whole
store cannot be reached now (the server is down or too slow): the jobs fail and the worker
reports the tier unreachable, so the scheduler skips it for a while.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.blockfile.framing import BytesLike


class TierUnavailable(RuntimeError):  # noqa: N818 - reads as the state it reports
    """The store cannot be reached now; retry later."""


class StoreError(RuntimeError):
    """An operation of the store failed in a way it has already logged, with what it
    means (a purge that could not remove everything): the job fails, no traceback."""


@dataclass
class BlockStoreStats:
    """Cumulative counters of one store (plain data, updated under the store's lock).

    Attributes:
        reads / writes: blocks read or written successfully.
        read_bytes / written_bytes: their payload bytes.
        misses: blocks asked for that were not there.
        rejected: blocks found damaged (corrupt, truncated, foreign) and removed.
        write_errors: blocks that could not be written.
        refused: entries a read or write would not use (a symlink, a FIFO, anything but
            a regular file or a real directory where a block or its directory belongs).
    """

    reads: int = 0
    writes: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    misses: int = 0
    rejected: int = 0
    write_errors: int = 0
    refused: int = 0


class BlockStore(ABC):
    """One rank's view of one lower tier (see the module docstring)."""

    name: str

    def __init__(self) -> None:
        self.stats = BlockStoreStats()
        self._stats_lock = threading.Lock()

    @abstractmethod
    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]:
        """Store each ``(key, payload)``; per item whether it is now stored, whole.

        A block is never visible half-written: a reader sees the old block, the new one,
        or none.
        """

    @abstractmethod
    def get_into(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        """Read each key's payload into its buffer (sized exactly for the block); per item
        whether the buffer now holds the verified block. On ``False`` the buffer's
        contents are undefined."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None:
        """Remove the keys' blocks; absent keys are ignored."""

    @abstractmethod
    def purge(self) -> None:
        """Remove every block of this store's namespace and rank; raise ``StoreError``
        when that failed (the store says what remains and whether it can still be read)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, value in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)
