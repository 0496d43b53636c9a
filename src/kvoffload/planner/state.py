"""Per-request, per-group and per-job bookkeeping of the planner.

Plain mutable records owned by ``Planner``; no logic beyond small helpers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.jobs import Direction, JobId
from kvoffload.keys import OffloadKey
from kvoffload.planner.contract import NO_CONTROLS, RequestControls, RequestInfo


@dataclass
class PolicyRequestState:
    """What a store policy keeps for one live request (under ``StorePolicy``, only
    ``first_hit_tokens``).

    Every list holds keys this request stored or passed: the state of a key itself (demoted,
    cold, valued) is the tier's, which answers it.
    """

    first_hit_tokens: int = 0
    """Tokens of the prompt already cached (engine or tier) at the first lookup."""
    session_seen: bool = False
    """An earlier request had this request's ``session_id`` (hit-point policies)."""
    resume_point: int = 0
    """The prefill point (tokens) whose windows and states ``resume_keys`` hold."""
    resume_keys: list[tuple[int, int, OffloadKey]] = field(default_factory=list)
    """(group, offloaded block, key) stored only because a resume at ``resume_point``
    needs them (provisional: demoted once a later resume point does not need them, or the
    request finishes, unless kept as a cheap checkpoint)."""
    kept_point: int = 0
    """The last resume point (tokens) whose blocks were kept as a cheap checkpoint
    (``selective.CHECKPOINT_SHARE``); 0 for none."""
    passed_keys: list[OffloadKey] = field(default_factory=list)
    """Blocks of resume points the prefill moved past, demoted: the request's own
    touches (a lookup after a preemption, its finish) leave them demoted."""
    spare_keys: list[OffloadKey] = field(default_factory=list)
    """Window blocks and states the request stored only because the tier had free room
    (``Admit.SPARE_ROOM``): demoted when it finishes."""
    cold_candidate: bool = False
    """Bimodal insertion stores this request's blocks cold (not ``is_hot_request``)."""
    duel_cold: bool = False
    """The insertion duel's verdict at the request's first lookup: a cold candidate that
    arrived while bimodal insertion was ahead. Its new blocks go in cold when this holds
    and it has no ``continues`` hint, or when its hint says it ends
    (``selective.stores_cold``, applied at each store, so a hint set later counts from
    then on)."""
    cold_keys: list[OffloadKey] = field(default_factory=list)
    """Keys the request stored cold (bimodal insertion, or its hint says it ends): the
    touch at its finish leaves them cold. Cleared on a preemption, which warms the
    request's whole prefix."""

    def forget_stores(self) -> None:
        """The cache was reset: nothing the request stored is left."""
        self.resume_point = self.kept_point = 0
        self.resume_keys = []
        self.spare_keys = []
        self.passed_keys = []
        self.cold_keys = []


@dataclass
class GroupState:
    """One request's view of one group.

    Attributes:
        keys: offload key of every complete offloaded block so far.
        block_ids: engine block id at every logical position seen so far (0 = null).
        num_freed: leading positions the engine has freed; their ids are stale.
        next_stored: index of the next offloaded block to consider for storing.
        num_hit_blocks: offloaded blocks hit (device + offload) at the first lookup;
            drives which window blocks are kept warm.
    """

    keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_freed: int = 0
    next_stored: int = 0
    num_hit_blocks: int = 0


@dataclass
class PlannedLoad:
    """A load decided by a lookup, waiting for the engine's allocation."""

    num_local_tokens: int
    end: int


@dataclass
class RequestState:
    """What the planner keeps for one live request.

    Invariant: ``jobs`` holds either exactly one load job or any number of store jobs.

    ``state_ends``: token counts, multiples of the hit alignment, at which one of the
    request's steps ended (or, ``ScheduledRequest.state_ends``, checkpointed a state)
    since its block table last restarted. A Mamba block holds the state after its last
    token only if a step ended (or checkpointed) exactly there; a step ending mid-block
    leaves the block with the step's input (or a partial) state, which must never be
    stored as the boundary state.
    """

    request: RequestInfo
    groups: list[GroupState]
    jobs: set[JobId] = field(default_factory=set)
    planned: PlannedLoad | None = None
    num_local_tokens: int = 0
    looked_up: bool = False
    hashes_keyed: int = 0
    """Block hashes the request had when its keys were last refreshed
    (``PrefixLookup.refresh_keys``; keys are only ever appended)."""
    store_due: int = 0
    """No group completes a block its store progress has not passed before this many
    tokens are offloadable (``StorePlanner.plan``; a lower bound: progress only grows,
    and ``Planner.reset_cache``, which sets it back, zeroes this too)."""
    deferred_steps: int = 0
    """"Ask again later" answers in a row (0: the lookup is not deferred)."""
    deferred_since: float = 0.0
    """When the first of them was given (the bound on waiting for a tier's answers)."""
    bounded_steps: int = 0
    """Of them, those given while no tier answer was outstanding, since the last one was
    (what ``max_deferred_steps`` bounds)."""
    bounded_since: float = 0.0
    """When the first of ``bounded_steps`` was given (what ``min_deferral_s`` bounds)."""
    awaiting_answers: bool = False
    """Whether the last deferral waited on outstanding tier answers."""
    finished: bool = False
    refuses_loads: bool = False
    """A load of the request failed or was abandoned: it is offered none again
    (``Planner.refuse_loads``)."""
    state_ends: set[int] = field(default_factory=set)
    controls: RequestControls = NO_CONTROLS
    """What the request allows: caps on the tokens stored and loaded (``set_controls``)."""
    policy: PolicyRequestState = field(default_factory=PolicyRequestState)
    """What the store policy keeps for the request (``kvoffload.planner.store_policy``)."""

    def reset_table(self) -> None:
        """Forget the engine's block table (and the step ends seen with it): a new lookup,
        a preemption or a resume hands over a fresh one."""
        for gs in self.groups:
            gs.block_ids = []
            gs.num_freed = 0
        self.state_ends.clear()

    def keeps_deferring(self, now: float, answer_wait_s: float, max_steps: int,
                        min_s: float) -> bool:
        """Whether a lookup about to answer "ask again later" at ``now`` may (counted here
        when it may; ``deferred_steps`` is the caller's).

        While a lower tier's answers about the keys it waits on are outstanding
        (``answer_wait_s`` > 0: a server not heard back from yet, or host memory with
        no room yet to promote them into) it may for
        ``max(min_s, answer_wait_s)`` seconds since its first deferral, however many
        steps pass (an idle engine steps far faster than a server answers). With nothing
        outstanding (blocks being written or promoted) it may for ``max_steps`` answers
        and ``min_s`` seconds, counted from the first deferral or from the first one after
        the tier's answers came. So every wait ends: within ``max(min_s, answer_wait_s)``
        plus the step bound.
        """
        if self.deferred_steps == 0:
            self.deferred_since = self.bounded_since = now
            self.bounded_steps = 0
            self.awaiting_answers = False
        if answer_wait_s > 0.0:
            self.awaiting_answers = True
            return now - self.deferred_since < max(min_s, answer_wait_s)
        if self.awaiting_answers:  # the answers came: promotes and writes start now
            self.awaiting_answers = False
            self.bounded_since = now
            self.bounded_steps = 0
        if self.bounded_steps < max_steps or now - self.bounded_since < min_s:
            self.bounded_steps += 1
            return True
        return False


@dataclass
class JobState:
    """One transfer job in flight.

    Attributes:
        keys: tier keys the job reads or writes (passed to ``complete_*``).
        reported_ranks: bit mask of the workers that reported this job.
        failed: some worker reported failure.
        windowed_block_ids: engine blocks of window/Mamba groups the job touches; fenced
            from creation (the engine may free them while the request runs).
        other_block_ids: the job's remaining engine blocks; fenced once the request
            finishes while the job is still in flight.
        fenced_other: whether ``other_block_ids`` are in the fence.
        num_local_tokens: for loads, the engine's own prefix hit (where a failed load
            makes the engine recompute from).
    """

    job_id: JobId
    request_id: str
    direction: Direction
    keys: tuple[OffloadKey, ...]
    windowed_block_ids: tuple[int, ...]
    other_block_ids: tuple[int, ...]
    reported_ranks: int = 0
    failed: bool = False
    fenced_other: bool = False
    num_local_tokens: int = 0
