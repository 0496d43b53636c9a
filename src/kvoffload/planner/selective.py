"""Hit-point store policies (``hybrid``, ``value``): window blocks and Mamba states only where
a hit is likely, and hints that keep the tier's memory for those.

``HitPointStorePolicy`` asks its admission (``kvoffload.planner.admission``, whose docstring
explains hit points, resume points and spare blocks) which window and Mamba blocks to
store, and keeps per request what that decided:

* **resume points**: a prefill's computed point is stored provisionally; once the prefill
  moves past it the blocks a later point does not need are demoted, unless they are a
  cheap checkpoint (``CHECKPOINT_SHARE``) or, where Mamba states exist only at step ends,
  the deepest state a likely hit point between the two can use;
* **spare blocks**: admitted only because the tier had room, demoted when the request ends;
* **decode blocks** no hit at the end of the turn can use, demoted when the request ends.

Client hints (``RequestControls.continues``, ``session_id``) steer the admission per
request (``continues_hint``); without them it learns as before. Under ``value`` a hint
also decides the request's insertion (``stores_cold``): cold when the conversation ends,
normal when it goes on.

With a ``PrefixValuer`` (the ``value`` policy) it also sends value hints (compute saved
per byte) for every key a request stores, and runs the insertion duel
(``kvoffload.planner.insertion``), storing cold requests' blocks cold while bimodal
insertion is ahead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from kvoffload.config import ResolvedGroup
from kvoffload.keys import OffloadKey, key_groups
from kvoffload.planner.admission import Admit, HitPointAdmission, window_at
from kvoffload.planner.insertion import InsertionDuel, is_hot_request
from kvoffload.planner.lookup import lookup_order
from kvoffload.planner.positions import useful_blocks
from kvoffload.planner.state import RequestState
from kvoffload.planner.store_policy import StorePolicy, StorePolicyContext, StoreSelection
from kvoffload.planner.valuation import PrefixValuer
from kvoffload.tiers.base import TierHints

CHECKPOINT_SHARE = 0.1
"""A prefill's passed resume point stays (is not demoted) when its window blocks and
state charge at most this share of the full-attention blocks the request stored since
its last kept point (or its first hit): a cheap checkpoint where a later request may
branch off. On the shared trace that keeps every resume point of gpt-oss-20b (a window
is one block) and one every ~53k tokens on Gemma 3 (a window is 4 blocks of 52 layers)."""

Provisional = tuple[int, int, OffloadKey]
"""(group, offloaded block, key) of a block stored only for a resume point."""


class _HitPointSelection(StoreSelection):
    """One store's admission verdicts, with the blocks stored for the resume point
    (``provisional``) and for free room only (``spare``)."""

    def __init__(self, admission: HitPointAdmission, st: RequestState, resume: int,
                 continues: bool | None) -> None:
        self._admission = admission
        self._hashes = st.request.block_hashes
        self._prompt = st.request.num_prompt_tokens
        self._continues = continues
        self.resume = resume
        self.provisional: list[Provisional] = []
        self.spare: list[OffloadKey] = []

    def admit(self, group: ResolvedGroup, block: int, key: OffloadKey) -> bool:
        verdict = self._admission.admit(group, block, self._hashes, self._prompt,
                                        self._continues)
        return self._take(group, block, key, verdict)

    def admit_blocks(self, group: ResolvedGroup, blocks: Sequence[int],
                     keys: Sequence[OffloadKey]) -> list[bool]:
        verdicts = self._admission.admit_blocks(group, blocks, self._hashes, self._prompt,
                                                self._continues)
        take = self._take
        return [verdict is Admit.YES or take(group, block, key, verdict)
                for block, key, verdict in zip(blocks, keys, verdicts, strict=True)]

    def _take(self, group: ResolvedGroup, block: int, key: OffloadKey,
              verdict: Admit) -> bool:
        """Whether the block is stored given the admission's ``verdict``, recording it as
        provisional or spare when that is why."""
        if verdict is Admit.YES:
            return True
        if self.resume and self._admission.admit_for_resume(group, block, self.resume):
            self.provisional.append((group.index, block, key))
            return True
        if verdict is Admit.SPARE_ROOM:
            self.spare.append(key)
            return True
        return False


class HitPointStorePolicy(StorePolicy):
    """Store window blocks and states at likely hit points (module docstring).

    Args:
        context: the planner's configuration, tier (which receives the hints) and stats.
        admission: the hit-point rules.
        valuer: value hints and the insertion duel when given (the ``value`` policy).
    """

    MAX_SESSIONS = 1 << 16
    """Session ids remembered (least recent forgotten), for ``continues_hint``."""

    def __init__(self, context: StorePolicyContext, admission: HitPointAdmission,
                 valuer: PrefixValuer | None = None) -> None:
        config = self.config = context.config
        self.tier = context.tier
        self._stats = context.stats
        self._alignment = config.hit_alignment
        self._admission = admission
        self._valuer = valuer
        self._groups = config.resolved
        self._full = [g for g in lookup_order(self._groups) if g.window_blocks is None]
        self.learns_points = 0 < len(self._full) < len(self._groups)
        """Hit points are learned in a hybrid layout only (full attention and a window or
        Mamba group)."""
        self.values_keys = valuer is not None
        self._charge = [g.block_bytes if config.charges_bytes else 1 for g in self._groups]
        self._step_end_states = config.states_at_step_ends
        self._point_charge = sum(self._charge[g.index] * (g.window_blocks or 1)
                                 for g in self._groups if g.window_blocks is not None)
        """What the window blocks and state of one hit point charge, all groups."""
        self._full_charge_per_token = sum(self._charge[g.index] / g.offloaded_block_size
                                          for g in self._groups if g.window_blocks is None)
        self._insertion = self._new_insertion()
        self._sessions: OrderedDict[str, None] = OrderedDict()
        """Session ids of requests looked up so far, least recent first."""

    def continues_hint(self, st: RequestState) -> bool | None:
        """The request's hint to the admission: its own ``continues``; else True when an
        earlier request had its ``session_id`` (a later turn of a session seen before);
        else None (learned)."""
        continues = st.controls.continues
        if continues is None and st.policy.session_seen:
            return True
        return continues

    def _new_insertion(self) -> InsertionDuel | None:
        """A fresh insertion duel at the tier's budget (value hints only)."""
        if self._valuer is None or not self._full:
            return None
        config = self.config
        return InsertionDuel(config.host_capacity_bytes if config.charges_bytes
                             else config.num_host_slots, self._full[0].offloaded_block_size)

    @property
    def admission(self) -> HitPointAdmission:
        return self._admission

    @property
    def insertion(self) -> InsertionDuel | None:
        return self._insertion

    # ---------------------------------------------------------------- lookups

    def observe_lookup(self, st: RequestState, full_end: int, hit_end: int) -> None:
        hashes = st.request.block_hashes
        self._admission.observe_lookup(full_end, hit_end, hashes)
        if full_end > hit_end:
            self._admission.learn_miss(hashes, full_end)

    def first_lookup(self, st: RequestState, num_computed_tokens: int, hit_end: int) -> None:
        pst = st.policy
        pst.first_hit_tokens = hit_end
        session = st.controls.session_id
        if session is not None:
            sessions = self._sessions
            pst.session_seen = session in sessions
            sessions[session] = None
            sessions.move_to_end(session)
            if len(sessions) > self.MAX_SESSIONS:
                sessions.popitem(last=False)
        duel = self._insertion
        if duel is None:
            return
        full = self._full[0]
        duel.observe_lookup(st.groups[full.index].keys,
                            num_computed_tokens // full.offloaded_block_size,
                            hit_end - num_computed_tokens)
        pst.cold_candidate = not is_hot_request(st.request.request_id)
        pst.duel_cold = pst.cold_candidate and duel.bimodal_ahead

    def touch_skip(self, st: RequestState, finishing: bool) -> AbstractSet[OffloadKey]:
        pst = st.policy
        if finishing:
            return frozenset(pst.cold_keys).union(pst.passed_keys)
        return frozenset(pst.passed_keys)

    def preempted(self, st: RequestState) -> None:
        if self._insertion is None:
            return
        # It reloads its prefix when it resumes: cold blocks of it (whoever stored them)
        # become normal after all.
        keys = [key for gs in st.groups for key in gs.keys]
        self.tier.hint(TierHints(warm=tuple(keys)))
        self._insertion.observe_preempt(keys)
        st.policy.cold_keys = []

    # ----------------------------------------------------------------- stores

    def select(self, st: RequestState, offloadable: int) -> StoreSelection:
        resume = self._admission.resume_point(offloadable, st.request.num_prompt_tokens)
        if resume and self._step_end_states and resume not in st.state_ends:
            resume = 0  # no Mamba state there: the last resume point stays the one
        return _HitPointSelection(self._admission, st, resume, self.continues_hint(st))

    def stored(self, st: RequestState, selection: StoreSelection,
               candidates: Sequence[OffloadKey], stored: Sequence[OffloadKey]) -> None:
        assert isinstance(selection, _HitPointSelection)
        resume = selection.resume
        if resume and not self._holds_window(st, resume):
            resume = 0  # a block of its window (or its state) was never stored: keep the last
        self._track_resume_point(st, resume, selection.provisional, stored)
        resume_keys = frozenset(key for _, _, key in selection.provisional)
        pst = st.policy
        if self._insertion is not None:
            charge = self._charge
            self._insertion.observe_store(
                list(zip(candidates, map(charge.__getitem__, key_groups(candidates)),
                         strict=True)),
                pst.cold_candidate, normal=resume_keys)
        if self._insertion is not None and stores_cold(self.continues_hint(st),
                                                       pst.duel_cold):
            # Cold insertion (bimodal, or a conversation that ends): the newly stored keys
            # go in cold, except the window and state blocks stored only for the resume
            # point (a preemption reloads them).
            cold = [key for key in stored if key not in resume_keys]
            pst.cold_keys.extend(cold)
            self._stats.cold_stored_keys += self.tier.hint(TierHints(cool=tuple(cold)))
        if selection.spare:
            fresh = set(stored)
            pst.spare_keys.extend(key for key in selection.spare if key in fresh)

    def value_stored(self, st: RequestState, frontier: int,
                     chosen: Sequence[Sequence[int]]) -> None:
        assert self._valuer is not None
        self.tier.hint(TierHints(values=tuple(self._valuer.runs(
            frontier, chosen, [gs.keys for gs in st.groups], self._reuse(st)))))

    def _track_resume_point(self, st: RequestState, point: int,
                            provisional: list[Provisional], stored: Sequence[OffloadKey]
                            ) -> None:
        """Record the blocks stored only for a resume at ``point``; when the prefill moved
        past the previous resume point, demote that point's blocks that ``point`` does not
        need itself, unless it is a cheap checkpoint (``CHECKPOINT_SHARE``) or
        ``_keeps_resume_point``."""
        pst = st.policy
        if point > pst.resume_point:
            still: list[Provisional] = []
            if pst.resume_keys and self._cheap_checkpoint(st):
                pst.kept_point = pst.resume_point  # its blocks stay as stored
            elif pst.resume_keys and not self._keeps_resume_point(st, point):
                passed: list[OffloadKey] = []
                for entry in pst.resume_keys:
                    group, block, key = entry
                    if block in window_at(self._groups[group], point):
                        still.append(entry)
                    else:
                        passed.append(key)
                self._demote(passed)
                pst.passed_keys.extend(passed)
            pst.resume_keys = still
            pst.resume_point = point
        if provisional:
            fresh = set(stored)
            pst.resume_keys.extend(entry for entry in provisional if entry[2] in fresh)

    def _cheap_checkpoint(self, st: RequestState) -> bool:
        """Whether the blocks of the request's resume point charge at most
        ``CHECKPOINT_SHARE`` of the full-attention blocks it stored since its last kept
        point (or its first hit)."""
        pst = st.policy
        since = max(pst.kept_point, pst.first_hit_tokens)
        full = (pst.resume_point - since) * self._full_charge_per_token
        return 0 < self._point_charge <= CHECKPOINT_SHARE * full

    def _holds_window(self, st: RequestState, point: int) -> bool:
        """Whether the tier holds (ready or being written) every window block and state a
        hit at ``point`` reads: else ``point`` cannot be resumed from."""
        tier = self.tier
        return all(gs.keys[k] in tier
                   for g, gs in zip(self._groups, st.groups, strict=True)
                   if g.window_blocks is not None for k in window_at(g, point))

    def _keeps_resume_point(self, st: RequestState, stop: int) -> bool:
        """Whether the blocks of the request's resume point stay (are not demoted) when
        its prefill moves on to ``stop``: in a layout with Mamba groups, a state exists
        only where a step ended, so when a likely hit point lies in ``[resume point,
        stop)``, the resume point is the deepest one a hit there can use."""
        request = st.request
        return self._step_end_states and self._admission.hit_point_between(
            st.policy.resume_point, stop, request.block_hashes, request.num_prompt_tokens,
            self.continues_hint(st))

    def _demote(self, keys: list[OffloadKey]) -> None:
        """Tell the tier (and the insertion duel's directories) that no likely hit uses
        ``keys``."""
        self.tier.hint(TierHints(demote=tuple(keys)))
        if self._insertion is not None:
            self._insertion.observe_demote(keys)

    # -------------------------------------------------------------- lifecycle

    def finished(self, st: RequestState) -> None:
        pst = st.policy
        pst.cold_keys = []
        pst.passed_keys = []
        request = st.request
        if self.learns_points:
            self._admission.record_prompt_end(request.block_hashes, request.num_prompt_tokens)
            if request.num_tokens > request.num_prompt_tokens:
                self._admission.record_turn_end(request.block_hashes,
                                                request.num_prompt_tokens, request.num_tokens)
        if self._valuer is not None:
            self._value_finished(st)
        self._demote_finished(st)

    def _value_finished(self, st: RequestState) -> None:
        """Value every key the request stored or reused as its whole prefix."""
        assert self._valuer is not None
        frontier = max(min(gs.next_stored, len(gs.keys)) * g.offloaded_block_size
                       for g, gs in zip(self._groups, st.groups, strict=True))
        if frontier <= 0:
            return
        blocks: list[Sequence[int]] = []
        for g, gs in zip(self._groups, st.groups, strict=True):
            stop = min(gs.next_stored, len(gs.keys))
            blocks.append(range(stop) if g.window_blocks is None
                          else useful_blocks(g, self._alignment, 0, stop))
        self.tier.hint(TierHints(values=tuple(self._valuer.runs(
            frontier, blocks, [gs.keys for gs in st.groups], self._reuse(st)))))

    @staticmethod
    def _reuse(st: RequestState) -> float:
        """Share of the request's prompt that was cached when it arrived."""
        prompt = st.request.num_prompt_tokens
        return min(1.0, st.policy.first_hit_tokens / prompt) if prompt > 0 else 0.0

    def _demote_finished(self, st: RequestState) -> None:
        """Tell the tier which of the request's stored blocks no likely hit can use."""
        request = st.request
        pst = st.policy
        worthless: list[OffloadKey] = []
        for g, gs in zip(self._groups, st.groups, strict=True):
            if g.window_blocks is None:
                continue
            blocks = self._admission.demote_on_finish(g, 0, min(gs.next_stored, len(gs.keys)),
                                                      request.num_prompt_tokens,
                                                      request.num_tokens)
            worthless.extend(gs.keys[k] for k in blocks)
        # The last resume point lies at or before the prompt's end point, a likely hit
        # point, so where states exist only at step ends (``_keeps_resume_point``) its
        # state may be the deepest one a hit there can use: kept. Else it is kept only as
        # a cheap checkpoint.
        if not self._step_end_states and not self._cheap_checkpoint(st):
            worthless.extend(entry[2] for entry in pst.resume_keys)
        pst.resume_keys = []
        # Stored only because the tier had room: first to go once memory is short.
        worthless.extend(pst.spare_keys)
        pst.spare_keys = []
        if worthless:
            self._demote(worthless)

    def reset(self, live: Sequence[RequestState]) -> None:
        self._admission.forget_cached()
        super().reset(live)
        self._insertion = self._new_insertion()  # its directories modelled what is gone


def stores_cold(continues: bool | None, duel_cold: bool) -> bool:
    """Whether a request's newly stored blocks go in cold (``value``), given its
    ``continues`` hint (``HitPointStorePolicy.continues_hint``) and the insertion duel's
    verdict at its first lookup (``PolicyRequestState.duel_cold``): a client that says the
    conversation ends stores them cold (no later turn reads what only this prompt has; a
    branch that does finds them while they last, and its hit makes them normal), one that
    says it goes on stores them normally (its next turn reads them), whatever the duel
    says; without a hint, the duel decides."""
    if continues is not None:
        return not continues
    return duel_cold


def hybrid_store_policy(context: StorePolicyContext) -> HitPointStorePolicy:
    """The ``hybrid`` policy's store side: hit points at prompt ends, turn ends, resume
    points and learned misses (no granule points), no value hints."""
    config = context.config
    admission = HitPointAdmission(config.hash_block_size, config.hit_alignment,
                                  lambda: not context.tier.is_full(), granule_points=0)
    return HitPointStorePolicy(context, admission)


def value_store_policy(context: StorePolicyContext) -> HitPointStorePolicy:
    """The ``value`` policy's store side: hit points with the last multiples of the learned
    sharing granule (two at first, up to eight as learned), value hints and the insertion
    duel."""
    config = context.config
    admission = HitPointAdmission(config.hash_block_size, config.hit_alignment,
                                  lambda: not context.tier.is_full(),
                                  granule_points=2, max_granule_points=8)
    return HitPointStorePolicy(context, admission,
                               PrefixValuer(config, context.prefill_flops))
