"""The reference engine's request: tokens, block hashes, progress, and its record.

``EngineRequest`` satisfies the planner's ``RequestInfo`` protocol: ``num_tokens`` and
``block_hashes`` grow as the engine appends output tokens. ``RequestRecord`` is what the
metrics keep once the request is gone.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import Enum

from kvoffload.keys import BlockHash, BlockHasher, HashContext
from kvoffload.workloads.request import TOKEN_TYPECODE, WorkloadRequest, derive_tokens


class Status(str, Enum):
    WAITING = "waiting"
    """Queued for admission (new, preempted, or back after a failed or corrupt load)."""
    LOADING = "loading"
    """Admitted with an offload hit; must not run until the planner reports its load."""
    RUNNING = "running"
    """Scheduled each step until it has emitted all its output tokens."""
    FINISHED = "finished"


@dataclass
class RequestRecord:
    """What one request cost and gained (all bytes are real, not scaled, bytes).

    Attributes:
        engine_hit_tokens: prompt tokens the engine's prefix cache served when the request
            first started to run (re-admissions after a preemption, which hit the
            request's own blocks, do not count).
        host_hit_tokens: prompt tokens loaded through host memory (and verified) then,
            wherever they were offloaded.
        tier_hit_tokens: ``host_hit_tokens`` split by the tier each block was in when the
            request asked for it (``"host"``, or the lower tier it was promoted from).
        prefill_tokens: tokens computed before the first token, recomputations included.
        prefill_flops: FLOPs of those tokens.
        recomputed_tokens: tokens computed again after a preemption that came after the
            first token.
        loaded_bytes: bytes of that successful, verified load.
        promoted_bytes: the part of them read up from a lower tier for this request.
        first_token_s / finish_s: modelled clock times (None until they happen).
        preemptions / failed_loads / corrupt_loads: how often each setback happened.
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    engine_hit_tokens: int = 0
    host_hit_tokens: int = 0
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0
    prefill_flops: int = 0
    recomputed_tokens: int = 0
    loaded_bytes: int = 0
    promoted_bytes: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0
    failed_loads: int = 0
    corrupt_loads: int = 0


class EngineRequest:
    """One request inside the engine (see the module docstring).

    ``tokens`` holds the prompt followed by the output tokens emitted so far; the engine
    computes ``num_computed`` of them. ``block_hashes`` covers every full hash block of
    ``tokens`` and is extended by ``emit``.
    """

    def __init__(self, source: WorkloadRequest, hasher: BlockHasher,
                 arrival_s: float | None = None) -> None:
        self.source = source
        self.request_id = source.request_id
        self.tokens: array[int] = array(TOKEN_TYPECODE, source.prompt)
        self.num_prompt_tokens = len(source.prompt)
        self.output_length = source.output_length
        self.hash_context: HashContext = source.hash_context
        self._hasher = hasher
        self.block_hashes: list[BlockHash] = hasher.extend([], self.tokens, self.hash_context)
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_emitted = 0
        self.high_water = 0
        """The most tokens ever computed (recomputation after a preemption stays below)."""
        self.send_full_table = True
        """The next schedule sends the whole block table (first one after admission)."""
        self.resumed = False
        """Set by a preemption; cleared by the next schedule."""
        self.pending_hits = (0, 0)
        """(engine, host) hit tokens of the load in progress."""
        self.pending_origin: dict[tuple[str, int], int] = {}
        """Blocks of the load in progress by (tier they came from, group) (cascades)."""
        self.started = False
        """Whether the request ran once (its hits are then recorded)."""
        self.record = RequestRecord(
            request_id=source.request_id,
            arrival_s=source.arrival_s if arrival_s is None else arrival_s,
            prompt_tokens=self.num_prompt_tokens, output_tokens=source.output_length)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def remaining_outputs(self) -> int:
        return self.output_length - self.num_emitted

    def emit(self, count: int) -> None:
        """Append the next ``count`` output tokens (the workload's, or derived ones)."""
        start = self.num_emitted
        given = self.source.output_tokens
        if given is not None:
            self.tokens.extend(given[start:start + count])
        else:
            self.tokens.extend(derive_tokens(f"output/{self.request_id}/{start}", count))
        self.num_emitted += count
        self._hasher.extend(self.block_hashes, self.tokens, self.hash_context)

    def __repr__(self) -> str:
        return (f"EngineRequest({self.request_id!r}, {self.status.value}, "
                f"computed {self.num_computed}/{self.num_tokens})")
