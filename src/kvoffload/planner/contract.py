"""The engine-facing types of the planner (``docs/architecture.md``, "The engine contract").

An engine adapter maps its own request and scheduler-output objects onto these small types;
the planner never sees an engine's classes. The reference engine and the vLLM connector
both speak only this contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvoffload.jobs import JobId
from kvoffload.keys import BlockHash


class RequestInfo(Protocol):
    """What the planner reads from an engine request. The engine keeps it up to date.

    ``block_hashes`` holds the chained hashes of every full hash block of the request's
    tokens so far (prompt and generated), at the configured ``hash_block_size``.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...


@dataclass(frozen=True)
class RequestControls:
    """What one request allows the cache to do with it (``Planner.set_controls``).

    Attributes:
        max_store_tokens: store at most the first this many tokens of the request (rounded
            down to whole offloaded blocks, and to a step end for Mamba groups); 0 stores
            nothing, for a request whose context must not outlive it. None: no cap.
        max_load_tokens: load at most this many tokens beyond the engine's own prefix hit;
            0 loads nothing. None: no cap.
        continues: what the client knows of the conversation's future, a hint to the
            hit-point policies (``hybrid``, ``value``; ``lru`` and ``arc`` ignore it).
            True: a later request will continue this one, so its end state is kept: the
            ends of its prompt and of its turn are hit points (their window blocks and
            Mamba states are stored, not spare, not demoted when it finishes). False: it
            will not, so only what other requests may share is stored: the prompt's end
            and the points after it are not hit points (their window blocks and states
            are spare while the tier has room, else not stored); full-attention blocks,
            granule points and points learned from misses stay. Under ``value`` (with a
            full-attention group) the hint also sets how the request's new blocks enter
            host memory: cold for False (evicted before normal blocks unless those are
            more than ``NORMAL_SHARE`` of what is held), normally for True, whatever the
            insertion duel says.
            None: the policy learns whether turn ends are hit points and how to insert,
            as without hints.
        session_id: the conversation or agent session the request belongs to. A hit-point
            policy remembers the sessions it saw (the last 65536): a request whose session
            an earlier request had is taken as continuing (``continues=True``) unless it
            says ``continues`` itself; the first request of a session is learned as
            without hints.

    Hints change only what is stored and kept, never what a hit may load: a load still
    reads only blocks the tier holds whole.
    """

    max_store_tokens: int | None = None
    max_load_tokens: int | None = None
    continues: bool | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_store_tokens", "max_load_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{name} must be a whole number >= 0 or None, "
                                 f"got {value!r}")
        if self.continues is not None and type(self.continues) is not bool:
            raise ValueError(f"continues must be True, False or None, got {self.continues!r}")
        sid = self.session_id
        if sid is not None and (type(sid) is not str or not sid):
            raise ValueError(f"session_id must be a non-empty string or None, got {sid!r}")

    @property
    def has_hints(self) -> bool:
        """Whether the request says something of its future (``continues``, ``session_id``)."""
        return self.continues is not None or self.session_id is not None

    def store_end(self, offloadable: int) -> int:
        """The last token a store may cover when ``offloadable`` tokens are computed."""
        cap = self.max_store_tokens
        return offloadable if cap is None else min(offloadable, cap)

    def load_end(self, num_computed_tokens: int, end: int) -> int:
        """The end of a load the engine's hit of ``num_computed_tokens`` may reach."""
        cap = self.max_load_tokens
        return end if cap is None else min(end, num_computed_tokens + cap)


NO_CONTROLS = RequestControls()
"""A request that sets no controls: everything a hit can use is stored and loaded."""


@dataclass(frozen=True)
class ScheduledRequest:
    """One request the engine scheduled this step.

    Attributes:
        request: the request.
        new_block_ids: per group, the engine block ids appended to the request's block
            table this step (id 0 = null). After a preemption the table restarts, and
            ``resumed`` is set: these ids then form the whole new table.
        num_computed_tokens: tokens whose KV exists before this step.
        num_scheduled_tokens: tokens computed this step.
        resumed: the request comes back from preemption with a fresh block table.
        num_freed_blocks: per group, how many leading blocks of the table the engine has
            freed (turned null) by now because they left the window; ``None`` when the
            engine frees nothing early. The planner never stores from a freed position,
            even if it saw a real id there before.
        state_ends: token counts below the step's end at which this step also leaves a
            Mamba state in every Mamba group's block ending there (an engine that
            checkpoints inside a prefill chunk); the step's own end needs no mention.
    """

    request: RequestInfo
    new_block_ids: tuple[tuple[int, ...], ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    resumed: bool = False
    num_freed_blocks: tuple[int, ...] | None = None
    state_ends: tuple[int, ...] = ()

    @property
    def offloadable(self) -> int:
        """Tokens whose KV exists once this step ran (at most the request's length)."""
        return min(self.num_computed_tokens + self.num_scheduled_tokens,
                   self.request.num_tokens)

    @property
    def may_be_idle(self) -> bool:
        """No new blocks, not resumed, no ``state_ends``: the step may need nothing of the
        planner (``Planner.step_is_idle`` says whether it does)."""
        return not (self.resumed or self.state_ends or any(self.new_block_ids))


@dataclass(frozen=True)
class StepInput:
    """One engine step, as the planner needs it.

    Attributes:
        scheduled: the requests that run this step. A request scheduled with no new
            blocks, not resumed and with no ``state_ends`` may be left out when
            ``Planner.step_is_idle`` says the step needs nothing of it (a decode step
            between two block boundaries: the usual case); an engine with nothing to
            save may list every request.
        preempted: ids of requests preempted this step (their blocks are freed now).
        other_allocations: block ids the engine allocated this step outside ``scheduled``
            (e.g. for another connector's load); they are fenced like any allocation.
    """

    scheduled: tuple[ScheduledRequest, ...] = ()
    preempted: tuple[str, ...] = ()
    other_allocations: tuple[int, ...] = ()


@dataclass(frozen=True)
class MatchResult:
    """Answer of ``get_num_new_matched_tokens``.

    Attributes:
        num_tokens: tokens loadable beyond the engine's own prefix hit; ``None`` means
            "ask again next step" (a block is still being written or loaded).
        load_async: True when the engine must wait for ``finished_loads`` before running
            the request.
    """

    num_tokens: int | None
    load_async: bool = False

    @property
    def is_deferred(self) -> bool:
        return self.num_tokens is None


@dataclass(frozen=True)
class LoadFailure:
    """A load that failed: the engine must recompute from ``valid_tokens`` on.

    ``valid_tokens`` is the engine's own prefix hit at lookup time; every token after it
    that the load was to provide must be recomputed.
    """

    request_id: str
    valid_tokens: int


@dataclass(frozen=True)
class ReportOutcome:
    """What ``update_from_worker_reports`` tells the engine.

    Attributes:
        finished_loads: requests whose load is over (success or failure); the engine may
            run them (or free them, if they were aborted).
        failed_loads: the subset of ``finished_loads`` that failed.
        failed_stores: number of store jobs that failed (their slots are free again).
        released_loads: loads the engine gave up on (``Planner.abandon_load``) that are
            now over; the engine blocks they were writing may be reused from now on.
    """

    finished_loads: tuple[str, ...] = ()
    failed_loads: tuple[LoadFailure, ...] = ()
    failed_stores: int = 0
    released_loads: tuple[JobId, ...] = ()
