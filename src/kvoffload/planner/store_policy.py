"""The store policy: what the planner stores beyond the rules of a hit, and what it tells the
tier about the keys it stored.

The planner keeps the transfer contract (``kvoffload.planner.planner``): what a hit needs,
which blocks are readable, pinned or fenced, when a job is done. Within it, a store policy
makes the choices that may change without breaking a rule:

* which blocks of window and Mamba groups are worth storing (full-attention blocks are
  always stored: every hit needs all of them);
* which stored keys to demote (evicted first), store cold (bimodal insertion) or value
  (compute saved per byte), through one ``TierHints`` at a time;
* what it learns from lookups and finished requests.

``StorePolicy`` itself is the null object: it stores every block a hit could use and sends
no hints (the behaviour of ``lru`` and ``arc``). ``kvoffload.planner.selective`` holds the
hit-point policies (``hybrid``, ``value``). The policy registry
(``kvoffload.policies``) says which store policy a policy name comes with.

Call order, per request: ``first_lookup`` once, then any number of ``select``/``stored``
pairs (one per store the planner plans; ``stored`` only if the tier reserved the slots),
``preempted`` whenever the engine preempts it, ``finished`` once. The planner calls
``observe_lookup`` only when ``learns_points`` is set, and ``value_stored`` only when
``values_keys`` is set.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.config import ResolvedGroup
from kvoffload.keys import OffloadKey

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig
    from kvoffload.metrics import PlannerStats
    from kvoffload.planner.admission import AdmissionPolicy
    from kvoffload.planner.insertion import InsertionDuel
    from kvoffload.planner.state import RequestState
    from kvoffload.planner.valuation import PrefillFlops
    from kvoffload.tiers.base import Tier


@dataclass(frozen=True)
class StorePolicyContext:
    """What a store policy is built from (``kvoffload.policies.CachePolicy.store``).

    Attributes:
        config: the offload configuration.
        tier: the planner's tier; a policy sends it hints and asks what it holds.
        stats: the planner's counters (a policy adds what it did).
        prefill_flops: the model's prefill cost of tokens ``[start, end)``, or None for a
            layout-based estimate.
    """

    config: OffloadConfig
    tier: Tier
    stats: PlannerStats
    prefill_flops: PrefillFlops | None = None


class StoreSelection:
    """Which window and Mamba blocks one planned store takes (this one: all of them).

    ``admit`` is asked once per candidate block of a window or Mamba group, in group then
    block order (through ``admit_blocks``, once per group); a policy's selection may
    record why it said yes, for ``stored``.
    """

    def admit(self, group: ResolvedGroup, block: int, key: OffloadKey) -> bool:
        """Whether offloaded block ``block`` (key ``key``) of window or Mamba group
        ``group`` is stored."""
        del group, block, key
        return True

    def admit_blocks(self, group: ResolvedGroup, blocks: Sequence[int],
                     keys: Sequence[OffloadKey]) -> list[bool]:
        """``admit`` of each of ``blocks`` (keys ``keys``) in turn: how a store asks."""
        return [self.admit(group, block, key)
                for block, key in zip(blocks, keys, strict=True)]


ADMIT_ALL = StoreSelection()


class StorePolicy:
    """Store every block a hit could use; no hints (the null store policy)."""

    learns_points = False
    """Whether ``observe_lookup`` learns something (the planner skips its extra work
    otherwise)."""
    values_keys = False
    """Whether ``value_stored`` sends value hints (the planner skips building them)."""

    @property
    def admission(self) -> AdmissionPolicy | None:
        """The admission rules of window and Mamba blocks, if the policy has any."""
        return None

    @property
    def insertion(self) -> InsertionDuel | None:
        """The duel between LRU and bimodal insertion, if the policy runs one."""
        return None

    def observe_lookup(self, st: RequestState, full_end: int, hit_end: int) -> None:
        """A lookup found full-attention blocks up to ``full_end`` tokens and can hit up to
        ``hit_end`` once the stores in flight land."""
        del st, full_end, hit_end

    def first_lookup(self, st: RequestState, num_computed_tokens: int, hit_end: int) -> None:
        """The request's first answered lookup: the engine had ``num_computed_tokens``, the
        hit reaches ``hit_end``."""
        st.policy.first_hit_tokens = hit_end
        del num_computed_tokens

    def touch_skip(self, st: RequestState, finishing: bool) -> AbstractSet[OffloadKey]:
        """Keys the request's own touch (its lookups; its finish when ``finishing``) leaves
        as they are."""
        del st, finishing
        return frozenset()

    def preempted(self, st: RequestState) -> None:
        """The engine preempted the request: it reloads its prefix when it resumes."""
        del st

    def select(self, st: RequestState, offloadable: int) -> StoreSelection:
        """The selection for a store while ``offloadable`` tokens of the request are
        computed."""
        del st, offloadable
        return ADMIT_ALL

    def stored(self, st: RequestState, selection: StoreSelection,
               candidates: Sequence[OffloadKey], stored: Sequence[OffloadKey]) -> None:
        """The tier reserved slots for ``stored`` (the ``candidates`` not present yet)."""
        del st, selection, candidates, stored

    def value_stored(self, st: RequestState, frontier: int,
                     chosen: Sequence[Sequence[int]]) -> None:
        """The store writes offloaded blocks ``chosen[group]`` of the request; its blocks
        are complete up to ``frontier`` tokens."""
        del st, frontier, chosen

    def finished(self, st: RequestState) -> None:
        """The request ended (after its final touch)."""
        del st

    def reset(self, live: Sequence[RequestState]) -> None:
        """The cache was reset: forget what refers to gone blocks, in the policy and in
        the ``live`` requests' states."""
        for st in live:
            st.policy.forget_stores()
