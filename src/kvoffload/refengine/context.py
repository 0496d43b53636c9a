"""What every part of the reference engine shares: its limits (``EngineConfig``) and the
collaborators each part reads (``EngineContext``).

The step loop (``engine.ReferenceEngine``) builds one ``EngineContext`` and hands it to
each of its parts -- the transfer tracker (``transfers``), the recorder (``recording``)
and the scheduler (``scheduler``) -- instead of the same half dozen arguments each.
Nothing here changes state; the parts own what they change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvoffload.errors import ConfigError
from kvoffload.planner.planner import Planner
from kvoffload.refengine.block_pool import HybridBlockPool
from kvoffload.refengine.metrics import EngineMetrics


class Clocked(Protocol):
    """What holds the modelled clock (the engine): ``clock`` is now, in seconds."""

    clock: float


@dataclass(frozen=True)
class EngineConfig:
    """The engine's own limits.

    Attributes:
        num_blocks: engine block ids, the null block 0 included.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: requests running or loading at once.
        decode_tokens_per_step: engine iterations one step stands for (K). 1 is a real
            engine. With K > 1 (long replays in fewer steps) a decoding request computes K
            tokens per step, the step's token budget is K x ``max_num_batched_tokens``
            (one request's chunk stays within ``max_num_batched_tokens``), and a step
            with decodes lasts at least K decode iterations: the same blocks fill in the
            same order, in coarser steps.
        sample_interval_s: modelled seconds between two ``Sample`` values.
        check_integrity: check the pool's and the planner's bookkeeping every step (slow;
            for tests).
        load_deadline_s: modelled seconds a request waits for its load before it gives
            up and recomputes (``engine`` module docstring, point 7); None waits for ever.
    """

    num_blocks: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    decode_tokens_per_step: int = 1
    sample_interval_s: float = 1.0
    check_integrity: bool = False
    load_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.load_deadline_s is not None and not self.load_deadline_s > 0:
            raise ConfigError("load_deadline_s", f"must be positive, got {self.load_deadline_s}",
                              "Give seconds, or None to wait for every load.")
        for name in ("max_num_batched_tokens", "max_num_seqs", "decode_tokens_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}",
                                  "Give a positive count.")
        if self.num_blocks < 2:
            raise ConfigError("engine capacity", f"{self.num_blocks} block ids leave no "
                              "block to allocate", "Raise the engine capacity.")
        if not self.sample_interval_s > 0:
            raise ConfigError("sample_interval_s", "must be positive", "Give seconds.")


@dataclass(frozen=True)
class BlockBytes:
    """Bytes of one block, per group, as the engine accounts them.

    Attributes:
        real: one engine block at the model's real sizes.
        real_offloaded: one offloaded block (``block_size_factor`` engine blocks), real.
        moved_offloaded: one offloaded block as the tier holds it (the pages moved,
            scaled down in bytes mode).
    """

    real: tuple[int, ...]
    real_offloaded: tuple[int, ...]
    moved_offloaded: tuple[int, ...]


@dataclass(frozen=True)
class EngineContext:
    """The collaborators the engine's parts share (module docstring).

    Attributes:
        clock: the engine, whose ``clock`` is now (read live).
        config: the engine's limits.
        pool: the engine's block pool.
        planner: the planner, None without offloading.
        metrics: the engine's metrics, written to.
        block_bytes: bytes of one block per group.
    """

    clock: Clocked
    config: EngineConfig
    pool: HybridBlockPool
    planner: Planner | None
    metrics: EngineMetrics
    block_bytes: BlockBytes
