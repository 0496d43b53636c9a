"""Real ``TransferWorker`` ranks on CPU tensors, plugged into ``support.sim_engine``.

Each rank owns its own shard: one uint8 cache tensor per (group, layer). A block's bytes
are a hash of (rank, layer, symbolic content), so a block holds the right data exactly
when its bytes match. Copies run on the CPU backend's threads, truly asynchronously, so a
block overwritten while a job still reads it shows up as wrong bytes later.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random

import torch

from kvoffload.config import OffloadConfig
from kvoffload.jobs import JobId, StepPlan, TransferJob, WorkerReport
from kvoffload.worker import GroupTensors, TransferWorker, cpu_backend
from support.sim_engine import Content, SimEngine

PAGE_BYTES = 32
LAYERS = 2


def with_pages(config: OffloadConfig, num_slots: int) -> OffloadConfig:
    """``config`` with real page sizes and a host tier of ``num_slots`` slots."""
    groups = tuple(dataclasses.replace(g, page_bytes=PAGE_BYTES, num_layers=LAYERS)
                   for g in config.groups)
    slot_bytes = PAGE_BYTES * LAYERS * config.block_size_factor
    return dataclasses.replace(config, groups=groups, host_capacity_bytes=num_slots * slot_bytes)


class TensorDevice:
    """Every rank's engine caches; contents are encoded as bytes per (rank, layer)."""

    def __init__(self, config: OffloadConfig, num_blocks: int) -> None:
        n_groups = len(config.groups)
        self.caches = [[[torch.zeros(num_blocks + 1, PAGE_BYTES, dtype=torch.uint8)
                         for _ in range(LAYERS)] for _ in range(n_groups)]
                       for _ in range(config.num_workers)]

    @staticmethod
    def encode(rank: int, layer: int, content: Content) -> torch.Tensor:
        digest = hashlib.blake2b(repr((rank, layer, content)).encode(),
                                 digest_size=PAGE_BYTES).digest()
        return torch.frombuffer(bytearray(digest), dtype=torch.uint8)

    def write(self, group: int, block: int, content: Content) -> None:
        for rank, per_group in enumerate(self.caches):
            for layer, tensor in enumerate(per_group[group]):
                tensor[block] = self.encode(rank, layer, content)

    def holds(self, group: int, block: int, content: Content) -> bool:
        return all(torch.equal(tensor[block], self.encode(rank, layer, content))
                   for rank, per_group in enumerate(self.caches)
                   for layer, tensor in enumerate(per_group[group]))

    def group_tensors(self, rank: int) -> list[GroupTensors]:
        return [GroupTensors(g, [(f"g{g}.l{layer}", t) for layer, t in enumerate(tensors)])
                for g, tensors in enumerate(self.caches[rank])]


class RandomFaults:
    """A fault hook failing each job with a probability the engine loop can change.

    The draw depends only on (seed, job id, rank), not on thread timing, so a run is
    reproducible.
    """

    def __init__(self, seed: int, rank: int) -> None:
        self.seed = seed
        self.rank = rank
        self.rate = 0.0

    def __call__(self, job: TransferJob) -> bool:
        return self.rate > 0 and random.Random(
            hash((self.seed, int(job.job_id), self.rank))).random() < self.rate


class RealWorkers:
    """One ``TransferWorker`` per rank; reports are held back at random to arrive late."""

    def __init__(self, device: TensorDevice, config: OffloadConfig, seed: int) -> None:
        self.faults = [RandomFaults(seed, rank) for rank in range(config.num_workers)]
        self.workers = []
        for rank in range(config.num_workers):
            worker = TransferWorker(config, rank, cpu_backend(fault_hook=self.faults[rank]),
                                    pin_memory=False)
            worker.register_kv_caches(device.group_tensors(rank))
            self.workers.append(worker)
        self.held: list[tuple[int, JobId, bool]] = []
        self.unreported: dict[JobId, int] = {}

    @property
    def idle(self) -> bool:
        return not self.unreported

    def begin(self, plan: StepPlan) -> None:
        for job in (*plan.stores, *plan.loads):
            self.unreported[job.job_id] = len(self.workers)
        for worker in self.workers:
            worker.begin_step(plan)

    def end(self) -> None:
        for worker in self.workers:
            worker.end_step()

    def deliver(self, rng: random.Random, fraction: float,
                fail_rate: float) -> list[WorkerReport]:
        # Jobs run asynchronously; to keep runs reproducible, every job submitted so far
        # finishes here, and the engine learns of a random (seeded) share of them. Jobs
        # submitted from now on fail at this call's rate.
        for worker in self.workers:
            worker.wait(list(self.unreported))
            report = worker.poll()
            self.held.extend((worker.rank, j, False) for j in report.finished)
            self.held.extend((worker.rank, j, True) for j in report.failed)
        for faults in self.faults:
            faults.rate = fail_rate
        self.held.sort()
        rng.shuffle(self.held)
        cut = len(self.held) if fraction >= 1.0 else round(len(self.held) * fraction)
        released, self.held = self.held[:cut], self.held[cut:]
        by_rank: dict[int, tuple[list[JobId], list[JobId]]] = {}
        for rank, job_id, failed in released:
            ok, bad = by_rank.setdefault(rank, ([], []))
            (bad if failed else ok).append(job_id)
            self.unreported[job_id] -= 1
            if not self.unreported[job_id]:
                del self.unreported[job_id]
        return [WorkerReport(rank, tuple(ok), tuple(bad)) for rank, (ok, bad) in by_rank.items()]

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


def real_backend(seed: int) -> object:
    """A ``RealBackendFactory`` for ``SimEngine(real=...)``."""

    def build(engine: SimEngine, num_blocks: int) -> tuple[TensorDevice, RealWorkers]:
        device = TensorDevice(engine.config, num_blocks)
        return device, RealWorkers(device, engine.config, seed)

    return build
