"""Bytes mode: the engine's KV caches as real tensors, their contents, and the real worker.

Every engine block of every group is a page of ``num_layers x page_bytes`` bytes in one
tensor per group, shape ``(num_blocks, num_layers, page_bytes)``; each layer is registered
with the ``TransferWorker`` as its own ``(num_blocks, page_bytes)`` view (rows further
apart than a page, which the worker's layouts accept).

Contents are a deterministic function of ``(seed, group, position)`` and of the layer and
byte offset inside the page (``block_content``): the forward pass writes them, and every
loaded block is compared byte for byte with what it must hold. The seed of a full block
is its prefix: the first 8 bytes of the chained block hash at the block's last token, so
two requests sharing a prefix write identical bytes and a block from another prefix,
another group or another position differs in nearly every byte. A block is written when
the forward pass fills it (a Mamba state: when a step ends on its boundary); partial
blocks and running Mamba states are never stored or loaded, so their bytes do not matter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.config import GroupSpec, OffloadConfig
from kvoffload.jobs import JobId, StepPlan, TransferStats, WorkerReport
from kvoffload.keys import BlockHash
from kvoffload.tiers.config import TierConfig
from kvoffload.worker import (
    GroupTensors,
    HostPool,
    TransferBackend,
    TransferWorker,
    cpu_backend,
)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1
_INDEX: dict[int, npt.NDArray[np.uint64]] = {}


def full_block_seed(block_hash: BlockHash) -> int:
    """Seed of a full block: its prefix hash, as a signed 64-bit integer."""
    return int.from_bytes(block_hash[:8], "little", signed=True)


def block_content(seeds: Sequence[int], group: int, positions: Sequence[int],
                  num_layers: int, page_bytes: int) -> npt.NDArray[np.uint8]:
    """Contents of blocks, shape ``(len(seeds), num_layers, page_bytes)`` uint8.

    A splitmix-style mix of (seed, group, position, word index) in wrapping 64-bit
    arithmetic; ``page_bytes`` must be a multiple of 8. numpy, not torch: these arrays are
    small and torch's per-call overhead would dominate.
    """
    if page_bytes % 8:
        raise ValueError(f"page_bytes {page_bytes} is not a multiple of 8")
    words = num_layers * page_bytes // 8
    index = _INDEX.get(words)
    if index is None:
        index = _INDEX[words] = np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN
    base = np.asarray(seeds, dtype=np.int64).view(np.uint64) * _MIX1  # (n,)
    base += np.asarray(positions, dtype=np.uint64) * _GOLDEN
    base += np.uint64(((group + 1) * int(_MIX2)) & _MASK64)
    x = base[:, None] + index[None, :]  # (n, words)
    x ^= x >> np.uint64(31)
    x *= _MIX1
    x ^= x >> np.uint64(29)
    x *= _MIX2
    x ^= x >> np.uint64(32)
    return x.view(np.uint8).reshape(len(seeds), num_layers, page_bytes)


class DeviceCaches:
    """One tensor per group holding every engine block's bytes (see the module docstring).

    Args:
        groups: the group specs whose ``page_bytes`` are the bytes moved (scaled or real).
        num_blocks: engine block ids, the null block 0 included.
    """

    def __init__(self, groups: Sequence[GroupSpec], num_blocks: int) -> None:
        self.groups = tuple(groups)
        self.num_blocks = num_blocks
        # Per group: (num_blocks, num_layers, page_bytes) uint8, zeroed.
        self.tensors = [torch.zeros((num_blocks, g.num_layers, g.page_bytes), dtype=torch.uint8)
                        for g in self.groups]
        self._arrays = [t.numpy() for t in self.tensors]  # the same memory, for numpy ops

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors)

    def group_tensors(self) -> list[GroupTensors]:
        """The per-layer views to register with a ``TransferWorker``."""
        return [GroupTensors(g, [(f"group{g}.layer{layer}", t[:, layer, :])
                                 for layer in range(t.shape[1])])
                for g, t in enumerate(self.tensors)]

    def write(self, group: int, block_ids: Sequence[int], seeds: Sequence[int],
              positions: Sequence[int]) -> None:
        """The forward pass: write the contents of ``(seed, position)`` into blocks."""
        if not block_ids:
            return
        spec = self.groups[group]
        content = block_content(seeds, group, positions, spec.num_layers, spec.page_bytes)
        self._arrays[group][np.asarray(block_ids, dtype=np.int64)] = content

    def wrong_bytes(self, group: int, block_ids: Sequence[int], seeds: Sequence[int],
                    positions: Sequence[int]) -> int:
        """Bytes of the blocks that differ from the contents of ``(seed, position)``."""
        if not block_ids:
            return 0
        spec = self.groups[group]
        expected = block_content(seeds, group, positions, spec.num_layers, spec.page_bytes)
        held = self._arrays[group][np.asarray(block_ids, dtype=np.int64)]
        return int(np.count_nonzero(held != expected))


class HostAuditor:
    """Checks the host arena itself: every readable key must hold what was stored.

    The engine tells it, for every store it submits, which contents each (slot, sub-block)
    must end up holding; ``audit`` then compares the arena with that for every key the
    tier can serve. A store that read a block before its KV was written is caught here
    even if no request ever loads it.
    """

    def __init__(self, pool: HostPool, groups: Sequence[GroupSpec], factor: int) -> None:
        self.pool = pool
        self.groups = tuple(groups)
        self.factor = factor
        self._arena = pool.arena.numpy()  # (num_slots, slot_bytes) uint8, same memory
        self._expect: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}

    def expect(self, group: int, slot: int, subs: dict[int, tuple[int, int]]) -> None:
        """``slot`` now holds a block of ``group`` whose sub-block ``j`` must hold the
        contents of ``subs[j] = (seed, position)`` (sub-blocks not listed are unchecked)."""
        for g in range(len(self.groups)):
            self._expect.pop((g, slot), None)
        self._expect[(group, slot)] = subs

    def forget(self, slot: int) -> None:
        """``slot`` is being filled from a lower tier: its contents are checked by the
        tier's checksum and, when loaded, by the engine's load verification."""
        for g in range(len(self.groups)):
            self._expect.pop((g, slot), None)

    def audit(self, keys: Iterable[tuple[int, int]]) -> tuple[int, int]:
        """``(blocks compared, wrong bytes)`` over ``(group, slot)`` of readable keys."""
        compared = wrong = 0
        for group, slot in keys:
            subs = self._expect.get((group, slot))
            if not subs:
                continue
            spec = self.groups[group]
            layers, page = spec.num_layers, spec.page_bytes
            # A slot holds, per layer, ``factor`` consecutive pages (see worker.layout).
            held = self._arena[slot, :layers * self.factor * page].reshape(
                layers, self.factor, page)
            for sub, (seed, pos) in subs.items():
                expected = block_content([seed], group, [pos], layers, page)[0]  # (L, P)
                wrong += int(np.count_nonzero(held[:, sub, :] != expected))
                compared += 1
        return compared, wrong


class WorkerExecutor:
    """The real ``TransferWorker`` over ``DeviceCaches`` (see ``refengine.executors``).

    ``poll`` waits for every submitted job before polling, so each step's jobs are done
    by the end of the step and a run is deterministic; the engine's modelled clock, not
    the host's, decides when the planner hears of them.
    """

    def __init__(self, config: OffloadConfig, caches: DeviceCaches,
                 backend: TransferBackend | None = None,
                 tiers: TierConfig | None = None) -> None:
        """``tiers``: real lower tiers (a directory, a Redis server) the worker reads and
        writes for the plans' tier jobs; waited for like transfers."""
        self.worker = TransferWorker(config, rank=0,
                                     backend=backend or cpu_backend(copy_threads=1),
                                     pin_memory=False, tiers=tiers)
        self.worker.register_kv_caches(caches.group_tensors())
        self._in_flight: set[JobId] = set()
        self._tier_in_flight = False
        self.moved = TransferStats()

    def begin_step(self, plan: StepPlan) -> None:
        self.worker.begin_step(plan)
        self._in_flight.update(j.job_id for j in (*plan.loads, *plan.stores))
        self._tier_in_flight |= bool(plan.tier_jobs)

    def end_step(self) -> None:
        self.worker.end_step()

    def poll(self) -> list[WorkerReport]:
        if not self._in_flight and not self._tier_in_flight:
            return []
        self.worker.wait(self._in_flight)
        if self.worker.tier_io is not None:
            self.worker.tier_io.wait()
        self._tier_in_flight = False
        report = self.worker.poll()
        for job_id in (*report.finished, *report.failed):
            self._in_flight.discard(job_id)
        s = report.stats
        m = self.moved
        self.moved = TransferStats(m.stored_bytes + s.stored_bytes, m.loaded_bytes + s.loaded_bytes,
                                   m.store_seconds + s.store_seconds,
                                   m.load_seconds + s.load_seconds)
        return [report]

    def shutdown(self) -> None:
        self.worker.shutdown()

    @property
    def arena(self) -> torch.Tensor:
        """The host arena, ``(num_slots, slot_bytes)`` uint8 (tests corrupt it on purpose)."""
        return self.worker.host_pool.arena
