"""Helpers for the worker tests: cache layouts with random bytes, configs that fit them,
and a step runner that waits for and collects reports."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import (
    Direction,
    GroupTransfer,
    JobId,
    StepPlan,
    TransferJob,
    WorkerReport,
)
from kvoffload.worker import CacheTensorLayout, GroupTensors, TransferWorker
from kvoffload.worker.native_copy import load_native_copy

needs_native = pytest.mark.skipif(load_native_copy() is None,
                                  reason="native copy queue not built")
"""Marks a test that needs the CPU backend's native copy queue."""

_ids = itertools.count(1)


def next_job_id() -> JobId:
    return JobId(next(_ids))


def random_bytes(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """A tensor of ``shape``/``dtype`` whose bytes are uniformly random (NaN patterns too)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


@dataclass
class CacheSet:
    """One rank's cache for one group: the tensors and how to read one block's bytes."""

    kind: GroupKind
    layout: CacheTensorLayout
    layers: list[tuple[str, torch.Tensor | tuple[torch.Tensor, ...]]]
    page_bytes: int  # per layer, per engine block (what GroupSpec.page_bytes says)
    block_bytes_fn: Callable[[int], torch.Tensor]

    def spec(self, block_size: int = 16, window: int | None = None) -> GroupSpec:
        return GroupSpec(self.kind, block_size=block_size, num_layers=len(self.layers),
                         page_bytes=self.page_bytes,
                         sliding_window=window if self.kind is GroupKind.SLIDING_WINDOW else None)

    def tensors(self, group: int) -> GroupTensors:
        return GroupTensors(group, self.layers, self.layout)

    def block(self, block_id: int) -> torch.Tensor:
        """Every byte engine block ``block_id`` holds, over all layers, as uint8."""
        return self.block_bytes_fn(block_id)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1).cpu()


def kv_separate(num_blocks: int, gen: torch.Generator, *, layers: int = 2,
                block_size: int = 4, heads: int = 2, head_dim: int = 8,
                dtype: torch.dtype = torch.float16, device: str = "cpu",
                kind: GroupKind = GroupKind.FULL_ATTENTION) -> CacheSet:
    """K and V as separate tensors ``(num_blocks, block_size, heads, head_dim)`` per layer."""
    shape = (num_blocks, block_size, heads, head_dim)
    tensors = [(f"attn{i}", (random_bytes(shape, dtype, gen, device),
                             random_bytes(shape, dtype, gen, device))) for i in range(layers)]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    page = 2 * block_size * heads * head_dim * itemsize

    def block(b: int) -> torch.Tensor:
        return torch.cat([_u8(t[b]) for _, kv in tensors for t in kv])

    return CacheSet(kind, CacheTensorLayout.BLOCKS_FIRST, list(tensors), page, block)


def kv_fused_kv_first(num_blocks: int, gen: torch.Generator, *, layers: int = 2,
                      block_size: int = 4, heads: int = 2, head_dim: int = 8,
                      dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                      kind: GroupKind = GroupKind.SLIDING_WINDOW) -> CacheSet:
    """One ``(2, num_blocks, block_size, heads, head_dim)`` tensor per layer."""
    shape = (2, num_blocks, block_size, heads, head_dim)
    tensors = [(f"swa{i}", random_bytes(shape, dtype, gen, device)) for i in range(layers)]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    page = 2 * block_size * heads * head_dim * itemsize

    def block(b: int) -> torch.Tensor:
        return torch.cat([torch.cat([_u8(t[0, b]), _u8(t[1, b])]) for _, t in tensors])

    return CacheSet(kind, CacheTensorLayout.KV_FIRST, list(tensors), page, block)


def kv_fused_block_major(num_blocks: int, gen: torch.Generator, *, layers: int = 2,
                         block_size: int = 4, heads: int = 2, head_dim: int = 8,
                         dtype: torch.dtype = torch.float32, device: str = "cpu",
                         kind: GroupKind = GroupKind.FULL_ATTENTION) -> CacheSet:
    """One ``(num_blocks, 2, block_size, heads, head_dim)`` tensor per layer."""
    shape = (num_blocks, 2, block_size, heads, head_dim)
    tensors = [(f"fa{i}", random_bytes(shape, dtype, gen, device)) for i in range(layers)]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    page = 2 * block_size * heads * head_dim * itemsize

    def block(b: int) -> torch.Tensor:
        return torch.cat([_u8(t[b]) for _, t in tensors])

    return CacheSet(kind, CacheTensorLayout.BLOCKS_FIRST, list(tensors), page, block)


def mamba_states(num_blocks: int, gen: torch.Generator, *, layers: int = 2,
                 device: str = "cpu") -> CacheSet:
    """Per layer a conv state ``(num_blocks, 3, 20)`` fp32 and an SSM state
    ``(num_blocks, 4, 8, 6)`` fp16: two segments of different page sizes."""
    tensors = [(f"mamba{i}", (random_bytes((num_blocks, 3, 20), torch.float32, gen, device),
                              random_bytes((num_blocks, 4, 8, 6), torch.float16, gen, device)))
               for i in range(layers)]
    page = 3 * 20 * 4 + 4 * 8 * 6 * 2

    def block(b: int) -> torch.Tensor:
        return torch.cat([_u8(t[b]) for _, states in tensors for t in states])

    return CacheSet(GroupKind.MAMBA, CacheTensorLayout.BLOCKS_FIRST, list(tensors), page, block)


def mamba_raw_padded(num_blocks: int, gen: torch.Generator, *, layers: int = 2,
                     page_bytes: int = 1000, padded_to: int = 1536,
                     device: str = "cpu") -> CacheSet:
    """vLLM-style raw int8 Mamba pages ``(num_blocks, 1, 1, page_bytes)`` that are views into
    a larger buffer whose rows are padded to ``padded_to`` bytes (row stride > page)."""
    tensors = []
    for i in range(layers):
        backing = random_bytes((num_blocks, padded_to), torch.int8, gen, device)
        pages = backing[:, :page_bytes].view(num_blocks, 1, 1, page_bytes)  # strided rows
        tensors.append((f"mraw{i}", pages))

    def block(b: int) -> torch.Tensor:
        return torch.cat([_u8(t[b]) for _, t in tensors])

    return CacheSet(GroupKind.MAMBA, CacheTensorLayout.BLOCKS_FIRST, list(tensors),
                    page_bytes, block)


LAYOUTS: dict[str, Callable[..., CacheSet]] = {
    "kv_separate": kv_separate,
    "kv_first": kv_fused_kv_first,
    "block_major": kv_fused_block_major,
    "mamba_states": mamba_states,
    "mamba_raw_padded": mamba_raw_padded,
}


def make_config(caches: Sequence[CacheSet], *, factor: int = 1, num_slots: int = 16,
                num_workers: int = 1) -> OffloadConfig:
    specs = tuple(c.spec(window=64) for c in caches)
    probe = OffloadConfig(groups=specs, hash_block_size=16, block_size_factor=factor,
                          host_capacity_bytes=1 << 40, num_workers=num_workers)
    return OffloadConfig(groups=specs, hash_block_size=16, block_size_factor=factor,
                         host_capacity_bytes=probe.slot_bytes * num_slots,
                         num_workers=num_workers, eviction_policy="lru")


def make_worker(caches: Sequence[CacheSet], *, factor: int = 1, num_slots: int = 16,
                rank: int = 0, num_workers: int = 1, **kwargs: object) -> TransferWorker:
    config = make_config(caches, factor=factor, num_slots=num_slots, num_workers=num_workers)
    worker = TransferWorker(config, rank=rank, **kwargs)  # type: ignore[arg-type]
    worker.register_kv_caches([c.tensors(g) for g, c in enumerate(caches)])
    return worker


def store(group: int, block_ids: Sequence[int], slots: Sequence[int],
          first_block_index: int = 0) -> TransferJob:
    return TransferJob(next_job_id(), Direction.STORE, "req",
                       (GroupTransfer(group, tuple(block_ids), first_block_index, tuple(slots)),))


def load(group: int, block_ids: Sequence[int], slots: Sequence[int],
         first_block_index: int = 0) -> TransferJob:
    return TransferJob(next_job_id(), Direction.LOAD, "req",
                       (GroupTransfer(group, tuple(block_ids), first_block_index, tuple(slots)),))


def run_step(worker: TransferWorker, plan: StepPlan) -> WorkerReport:
    """Execute ``plan``, wait for all of it, and return the (single) report."""
    worker.execute(plan)
    worker.wait([j.job_id for j in (*plan.stores, *plan.loads)])
    return worker.poll()


def run_all(worker: TransferWorker, jobs: Sequence[TransferJob]) -> WorkerReport:
    stores = tuple(j for j in jobs if j.direction is Direction.STORE)
    loads = tuple(j for j in jobs if j.direction is Direction.LOAD)
    return run_step(worker, StepPlan(stores=stores, loads=loads))
