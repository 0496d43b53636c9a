"""Store planning: which of a request's newly complete blocks one store job writes.

``StorePlanner.plan`` is called for each scheduled request of a step. It keeps rule 7 of
``docs/architecture.md``: store progress (``GroupState.next_stored``) advances only when
the blocks were stored, found present or skipped; a failed ``prepare_store`` (no room)
leaves it in place to retry next step. Every complete full-attention block is stored (a
draft group's once the tokens its key covers are computed too: ``key_lag_blocks``); window
and Mamba blocks only where some aligned hit can use them (``positions.useful_blocks``)
and the store policy admits them. The caller (the planner) turns the result into a job and
fences it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.config import OffloadConfig
from kvoffload.jobs import NULL_BLOCK_ID, GroupTransfer
from kvoffload.keys import OffloadKey
from kvoffload.metrics import PlannerStats
from kvoffload.planner.positions import group_store_transfers, store_positions, useful_blocks
from kvoffload.planner.state import RequestState
from kvoffload.planner.store_policy import StorePolicy, StoreSelection
from kvoffload.tiers.base import Tier

Candidates = list[list[tuple[int, list[int]]]]
"""Per group, ``(offloaded block, engine positions)`` a store may write."""


@dataclass(frozen=True)
class PlannedStore:
    """A store the tier reserved slots for.

    Attributes:
        keys: the keys it writes (``PrepareStoreResult.keys_to_store``).
        transfers: one per run of adjacent blocks per group.
        windowed_block_ids: engine blocks of window and Mamba groups it reads (fenced at
            once: the engine may free them while the request runs).
        other_block_ids: the rest (fenced once the request finishes).
    """

    keys: tuple[OffloadKey, ...]
    transfers: tuple[GroupTransfer, ...]
    windowed_block_ids: tuple[int, ...]
    other_block_ids: tuple[int, ...]


class StorePlanner:
    """Plans the store jobs of one planner (module docstring)."""

    def __init__(self, config: OffloadConfig, tier: Tier, policy: StorePolicy,
                 stats: PlannerStats) -> None:
        self.tier = tier
        self._policy = policy
        self._stats = stats
        self._groups = config.resolved
        self._alignment = config.hit_alignment
        self._state_groups = [g for g in self._groups if g.rules.holds_state]
        self.step_end_states = config.states_at_step_ends
        """Mamba states exist only where a step ended (``RequestState.state_ends``)."""

    def plan(self, st: RequestState, offloadable: int) -> PlannedStore | None:
        """A store of the request's blocks complete at ``offloadable`` tokens, or None
        (nothing new, nothing admitted, everything present, or no room: retried)."""
        if offloadable < st.store_due:
            return None  # no block completed since the last store (the common decode step)
        limits = [min(offloadable // g.offloaded_block_size - g.key_lag_blocks, len(gs.keys),
                      len(gs.block_ids) // g.factor)
                  for g, gs in zip(self._groups, st.groups, strict=True)]
        if all(limit <= gs.next_stored for limit, gs in zip(limits, st.groups, strict=True)):
            st.store_due = min((gs.next_stored + g.key_lag_blocks + 1) * g.offloaded_block_size
                               for g, gs in zip(self._groups, st.groups, strict=True))
            return None
        selection = self._policy.select(st, offloadable)
        candidates = self._candidates(st, limits, selection)
        keys = [st.groups[g].keys[k] for g, entries in enumerate(candidates)
                for k, _ in entries]
        if not keys:
            self._advance(st, limits)
            return None
        result = self.tier.prepare_store(keys)
        if result is None:
            self._stats.store_retries += 1
            return None
        self._advance(st, limits)
        self._policy.stored(st, selection, keys, result.keys_to_store)
        if not result.keys_to_store:
            return None
        slot_of = dict(zip(result.keys_to_store, result.slots, strict=True))
        return self._planned(st, limits, candidates, slot_of, result.keys_to_store)

    def _candidates(self, st: RequestState, limits: list[int],
                    selection: StoreSelection) -> Candidates:
        """Every complete full-attention block, and the window and Mamba blocks some hit
        can use that ``selection`` admits."""
        candidates: Candidates = []
        states = st.state_ends if self.step_end_states else None
        alignment = self._alignment
        for g, gs, limit in zip(self._groups, st.groups, limits, strict=True):
            first = gs.next_stored
            f = g.factor
            if (g.window_blocks is None and first < limit and gs.num_freed <= first * f
                    and NULL_BLOCK_ID not in gs.block_ids[first * f:limit * f]):
                # Every block live (the usual case): what store_positions would say,
                # without a call per block.
                candidates.append([(k, list(range(k * f, (k + 1) * f)))
                                   for k in range(first, limit)])
                continue
            if g.window_blocks is None:
                candidates.append([(k, positions) for k in range(first, limit)
                                   if (positions := store_positions(g, gs, k, alignment,
                                                                    states))])
                continue
            found = [(k, positions) for k in useful_blocks(g, alignment, first, limit)
                     if (positions := store_positions(g, gs, k, alignment, states))]
            if found:
                keys = gs.keys
                admitted = selection.admit_blocks(g, [k for k, _ in found],
                                                  [keys[k] for k, _ in found])
                found = [entry for entry, ok in zip(found, admitted, strict=True) if ok]
            candidates.append(found)
        return candidates

    def _planned(self, st: RequestState, limits: list[int], candidates: Candidates,
                 slot_of: dict[OffloadKey, int], stored: tuple[OffloadKey, ...]
                 ) -> PlannedStore:
        """The transfers of the candidates the tier reserved slots for (``slot_of``)."""
        transfers: list[GroupTransfer] = []
        windowed_ids: list[int] = []
        other_ids: list[int] = []
        valued: list[list[int]] = []
        values_keys = self._policy.values_keys
        stats = self._stats
        for g, gs, entries in zip(self._groups, st.groups, candidates, strict=True):
            chosen = [(k, p) for k, p in entries if gs.keys[k] in slot_of]
            if values_keys:
                valued.append([k for k, _ in chosen])
            if not chosen:
                continue
            stats.add_blocks(stats.blocks_stored, g.index, len(chosen))
            group_transfers = group_store_transfers(g, gs, chosen, slot_of)
            transfers.extend(group_transfers)
            ids = [b for t in group_transfers for b in t.block_ids]
            (windowed_ids if g.is_windowed else other_ids).extend(ids)
        if values_keys:
            frontier = max(limit * g.offloaded_block_size
                           for g, limit in zip(self._groups, limits, strict=True))
            self._policy.value_stored(st, frontier, valued)
        return PlannedStore(stored, tuple(transfers), tuple(windowed_ids), tuple(other_ids))

    def _advance(self, st: RequestState, limits: list[int]) -> None:
        """Store progress reaches ``limits``; step ends below every Mamba group's progress
        are forgotten (no store needs them any more)."""
        for gs, limit in zip(st.groups, limits, strict=True):
            gs.next_stored = max(gs.next_stored, limit)
        if st.state_ends:
            done = min(st.groups[g.index].next_stored * g.offloaded_block_size
                       for g in self._state_groups)
            st.state_ends = {end for end in st.state_ends if end > done}
