"""Admission: which offloaded blocks of window and Mamba groups are worth storing.

Full-attention blocks are always stored: a hit at any point needs all of them. A window
group's block serves only hits whose window covers it, and a Mamba state serves only a hit
exactly at its position. Storing the rest wastes memory that full-attention blocks (or
other hit points) could use.

``HitPointAdmission`` stores window blocks and Mamba states only around *likely hit points*
(the null store policy, ``kvoffload.planner.store_policy.StorePolicy``, stores them all):

* the end of the request's prompt (a repeated or retried prompt hits there);
* every point after the prompt (the decode frontier: the end of this turn is where the
  next turn of a conversation hits); those that turn out not to be the end of the turn
  are demoted (evicted first) when the request finishes. Whether turn ends are likely
  hit points is learned: where later prompts do not repeat the output (a reasoning
  model whose thinking is dropped from the history; a trace whose turns repeat only the
  prompts), no later prompt's full-attention prefix reaches a turn end (ends at it, or
  less than one hit point past it: the earlier request may have stored the block holding
  its last token, and the engine's own cache may end between hit points). Once at least
  ``TURN_END_EVIDENCE`` turn ends were recorded and fewer than ``TURN_END_SHARE`` of them
  were reached (both counts decay, so this follows a changing workload), points after
  the prompt are no longer hit points: their blocks are stored only as spare (below).
  Full-attention blocks are stored as always, so the count goes on. A cache reset
  forgets the turn ends not reached yet (they can no longer be);
* points learned from misses: when a lookup found the full-attention prefix longer than
  the hit it could give, because a window or Mamba group lacked blocks there, that point
  is remembered, and any later request passing through it stores its windows there;
* the last ``granule_points`` multiples of the *sharing granule* at or before the prompt's
  end. Requests often share prefixes in fixed units (a chat template's turns, a trace's
  hash blocks): the granule is learned from where full-attention prefixes found in the
  tier end (the largest power-of-two multiple of the hit alignment that divides at least
  ``granule_share`` of them), so a later turn that shares this prompt up to its last
  complete unit finds the window or state it needs there. How many multiples is learned
  from where later prompts branch off finished ones: each finished prompt marks its last
  ``max_granule_points`` multiples before its last token with their depth (0 for the
  last; a multiple two prompts share keeps the smaller depth) and, when the prompt ends
  on a multiple, that end too (it is a hit point anyway: counted, never kept for). A
  lookup whose full-attention prefix reaches a marked point (counting blocks still being
  written, so a deferred lookup counts what its answer will) counts that depth once per
  mark, whether or not the window or state is stored, so the count is not biased by
  what was kept. Prompts continued before they finish are not counted. Once
  ``GRANULE_EVIDENCE`` continuations were counted (decayed: about 74 in a row), the multiples
  kept are those down to the deepest depth at which at least ``GRANULE_DEPTH_SHARE`` of
  them branched, and never fewer than at first (on the built-in agentic workload, where
  four in five continuations branch at the prompt's end, going down to one multiple lost
  0.4 points on gpt-oss-20b at 30 % capacity); the counts decay, so this follows a
  changing workload, and they start again when the granule changes. A lookup that finds
  full attention without the window or state for any other reason (a branch point
  inside some other prompt) does not raise the count: the learned points below serve
  those.

Resume points. A request preempted during its prefill restarts from the last point it
stored whole, so the point where its computed prefill stands is a certain hit point
while it stands there: the planner stores that point's windows and state
*provisionally*, and demotes them (evicts them first) once the prefill has moved past it
and stored a later one, or the request finishes. Without this, a preempted request under
selective admission recomputes its prompt from the last granule point. A Mamba state
exists only where a step ended, so a resume point's state is kept instead when a likely
hit point lies between it and the next one: it is the deepest state a hit there can use.

While the tier has free room it admits everything: selective admission only matters
when memory is short, and must not lose hits that storing everything would have had. A
block admitted only for that reason is *spare* (``Admit.SPARE_ROOM``): the planner demotes
it when its request finishes (unless it belongs to the prefill's resume point, which
follows the rules above), so that once memory is short it goes before any block a likely
hit needs. Without this, the window blocks and states stored while the tier was
filling stayed as long as their prefixes, and outnumbered those at likely hit points (on
the shared trace, 41 % of Gemma 3's window blocks held at 30 % capacity).

Hints. A request may say whether its conversation continues (``continues``, from
``RequestControls``): True makes its prompt's end and the points after it hit points
whatever was learned; False makes neither a hit point (the granule multiples and learned
points still are, and so are the full-attention blocks, which are not asked). None: the
rules above.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum
from typing import TypeVar

from kvoffload.config import ResolvedGroup
from kvoffload.keys import BlockHash

_V = TypeVar("_V")

_AT_END = -1
"""The depth recorded for a prompt's end that lies on a granule multiple."""


def window_at(group: ResolvedGroup, point: int) -> range:
    """The blocks of window or Mamba group ``group`` a hit at ``point`` tokens reads: its
    last ``W`` blocks, or the one state (empty for point 0)."""
    end = point // group.offloaded_block_size
    return range(max(0, end - (group.window_blocks or 1)), end)


class Admit(IntEnum):
    """An admission verdict; false only for ``NO``."""

    NO = 0
    """Not worth storing."""
    YES = 1
    """A likely hit point needs it (or the policy stores everything)."""
    SPARE_ROOM = 2
    """No likely hit point needs it, but the tier has free room: stored, and demoted when
    the request finishes (unless it is in the window of the prefill's resume point: then
    the resume point's rules apply)."""


class AdmissionPolicy(ABC):
    """Decides which window/Mamba blocks the planner stores. Full attention is not asked."""

    @abstractmethod
    def admit(self, group: ResolvedGroup, block: int, hashes: Sequence[BlockHash],
              num_prompt_tokens: int, continues: bool | None = None) -> Admit:
        """Whether offloaded block ``block`` of ``group`` is worth storing, and why.

        ``hashes`` are the request's chained hashes at ``hash_block_size`` granularity;
        ``continues`` is the request's hint (module doc: hints), None for none.
        """

    def admit_blocks(self, group: ResolvedGroup, blocks: Sequence[int],
                     hashes: Sequence[BlockHash], num_prompt_tokens: int,
                     continues: bool | None = None) -> list[Admit]:
        """``admit`` of each of ``blocks`` in turn (a policy may answer them in one pass)."""
        return [self.admit(group, block, hashes, num_prompt_tokens, continues)
                for block in blocks]

    def learn_miss(self, hashes: Sequence[BlockHash], point_tokens: int) -> None:
        """A lookup could have hit at ``point_tokens`` but a window or state was missing."""
        del hashes, point_tokens

    def observe_lookup(self, full_end: int, hit_end: int,
                       hashes: Sequence[BlockHash] = ()) -> None:
        """A lookup found full-attention blocks up to ``full_end`` (a place where requests
        share a prefix) and could hit up to ``hit_end``; ``hashes`` are the request's."""
        del full_end, hit_end, hashes

    def record_turn_end(self, hashes: Sequence[BlockHash], num_prompt_tokens: int,
                        num_tokens: int) -> None:
        """A request finished after producing output: ``num_tokens`` prompt and output
        tokens, ``hashes`` its chained hashes."""
        del hashes, num_prompt_tokens, num_tokens

    def record_prompt_end(self, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> None:
        """A request finished: its prompt had ``num_prompt_tokens`` tokens, ``hashes`` are
        its chained hashes."""
        del hashes, num_prompt_tokens

    def forget_cached(self) -> None:  # noqa: B027 (optional hook: nothing to forget)
        """The cache was reset: forget what refers to blocks that are gone."""

    def demote_on_finish(self, group: ResolvedGroup, stored_from: int, stored_to: int,
                         num_prompt_tokens: int, num_tokens: int) -> range:
        """Blocks in ``[stored_from, stored_to)`` to demote when the request finishes."""
        del group, num_prompt_tokens, num_tokens
        return range(stored_from, stored_from)

    def resume_point(self, frontier: int, num_prompt_tokens: int) -> int:
        """The hit point (tokens) to store provisionally while a request's prefill stands
        at ``frontier`` computed tokens, or 0 for none (module doc: resume points)."""
        del frontier, num_prompt_tokens
        return 0

    def hit_point_between(self, start: int, stop: int, hashes: Sequence[BlockHash],
                          num_prompt_tokens: int, continues: bool | None = None) -> bool:
        """Whether a likely hit point lies in ``[start, stop)`` (tokens). Default: no."""
        del start, stop, hashes, num_prompt_tokens, continues
        return False

    @staticmethod
    def admit_for_resume(group: ResolvedGroup, block: int, point: int) -> bool:
        """Whether ``block`` of window or Mamba group ``group`` belongs to the window or
        state of the resume point ``point`` (tokens; 0: none), so it is stored
        provisionally."""
        return block in window_at(group, point)


class HitPointAdmission(AdmissionPolicy):
    """Store window blocks and Mamba states only around likely hit points (module doc).

    Args:
        hash_block_size: tokens per hash block.
        alignment: every hit is a multiple of this many tokens.
        has_room: whether the tier still has free room (then everything is admitted).
        max_learned: how many learned hit points, turn ends and granule marks (each) to
            remember (least recent forgotten).
        granule_points: how many multiples of the sharing granule before the prompt's end
            are hit points at first (0: none).
        max_granule_points: how high the depths at which later prompts branch off finished
            ones can raise it (default ``granule_points``: fixed, nothing learned).
        granule_share: the share of observed prefix ends a granule must divide.
    """

    MAX_GRANULE_SHIFT = 12
    GRANULE_EVIDENCE = 64.0
    """Continuations counted at marked granule points (decayed) before their depths are
    trusted."""
    GRANULE_DEPTH_SHARE = 1 / 4
    """A depth at which at least this share of the counted continuations branched is kept,
    with every shallower one. (At 1/8, the shared trace, whose prompts are branched off at
    every depth, kept three multiples of gpt-oss-20b's windows and lost 0.6 points of host
    hit at 1 % capacity.)"""
    GRANULE_DECAY = 1 - 1 / 256
    """Every depth count is scaled by this at each continuation counted."""
    TURN_END_EVIDENCE = 32.0
    """Turn ends recorded (decayed count) before their share reached is trusted."""
    TURN_END_SHARE = 1 / 16
    """Turn ends are hit points while at least this share of them is reached."""
    TURN_END_DECAY = 1 - 1 / 256
    """Both turn-end counts are scaled by this at every turn end recorded."""

    def __init__(self, hash_block_size: int, alignment: int, has_room: Callable[[], bool],
                 *, max_learned: int = 1 << 16, granule_points: int = 2,
                 max_granule_points: int | None = None, granule_share: float = 0.75) -> None:
        self._hash_bs = hash_block_size
        self._alignment = alignment
        self._has_room = has_room
        self._max_learned = max_learned
        self._learned: OrderedDict[BlockHash, None] = OrderedDict()
        self._granule_points = granule_points
        self._initial_granule_points = granule_points
        self._max_granule_points = (granule_points if max_granule_points is None
                                    else max(granule_points, max_granule_points))
        self._granule_share = granule_share
        self._learns_depth = self._max_granule_points > granule_points
        self._granule_marks: OrderedDict[BlockHash, tuple[int, int]] = OrderedDict()
        """Marked granule points of finished prompts: hash -> (granule, depth)."""
        self._depth_counts = [0.0] * self._max_granule_points
        """Continuations counted at each depth below a prompt's end (decayed)."""
        self._at_end_count = 0.0
        """Continuations counted at a prompt's end on a granule multiple (decayed)."""
        self._divides = [0] * (self.MAX_GRANULE_SHIFT + 1)
        self.granule = alignment
        """The learned sharing granule in tokens (a power-of-two multiple of alignment)."""
        self._turn_ends: OrderedDict[BlockHash, None] = OrderedDict()
        """Recorded turn ends not reached yet (the hash at the point), oldest first."""
        self._turn_ends_recorded = 0.0
        self._turn_ends_reached = 0.0

    def _points(self, group: ResolvedGroup, block: int) -> range:
        """Aligned hit points (in tokens) whose window or state needs ``block``."""
        obs = group.offloaded_block_size
        window = group.window_blocks or 1
        first = (block + 1) * obs
        last = (block + window) * obs
        first += -first % self._alignment
        return range(first, last + 1, self._alignment)

    def is_hit_point(self, point: int, hashes: Sequence[BlockHash],
                     num_prompt_tokens: int, continues: bool | None = None) -> bool:
        """Whether ``point`` (aligned, in tokens) is a likely hit point of this request,
        whose hint is ``continues`` (module doc: hints)."""
        return self._any_hit_point((point,), hashes, num_prompt_tokens, continues)

    def _any_hit_point(self, points: Iterable[int], hashes: Sequence[BlockHash],
                       num_prompt_tokens: int, continues: bool | None) -> bool:
        """Whether one of ``points`` is a likely hit point (``is_hit_point``), asked in
        order up to the first that is: what the request's prompt decides is computed
        once, not per point."""
        # The prompt's end point: a repeat of the prompt hits at most one token short of
        # its end; a prompt extending it hits at its end (when that is a hit point).
        last = num_prompt_tokens - 1
        ends = ((num_prompt_tokens, last // self._alignment * self._alignment)
                if continues is not False else ())
        g = self.granule
        granule_floor = last // g * g - self._granule_points * g
        learned = self._learned
        hash_bs = self._hash_bs
        num_hashes = len(hashes)
        for point in points:
            if point > num_prompt_tokens:
                if self.turn_ends_hit if continues is None else continues:
                    return True
                continue
            if point in ends:
                return True
            if point % g == 0 and point > granule_floor:
                return True
            index = point // hash_bs - 1  # ``_hash_at``
            key = hashes[index] if 0 <= index < num_hashes else None
            if key is not None and key in learned:
                learned.move_to_end(key)
                return True
        return False

    def _hash_at(self, hashes: Sequence[BlockHash], point: int) -> BlockHash | None:
        """The chained hash of the prefix ending at ``point`` tokens, if the request has
        one there (``point`` a positive multiple of the hash block size it covers)."""
        index = point // self._hash_bs - 1
        return hashes[index] if 0 <= index < len(hashes) else None

    def _remember(self, points: OrderedDict[BlockHash, _V], key: BlockHash,
                  value: _V) -> None:
        """Put ``key`` last in ``points``, forgetting the oldest beyond ``max_learned``."""
        points[key] = value
        points.move_to_end(key)
        while len(points) > self._max_learned:
            points.popitem(last=False)

    @property
    def granule_points(self) -> int:
        """How many granule multiples before the prompt's end are hit points now."""
        return self._granule_points

    @property
    def turn_end_counts(self) -> tuple[float, float]:
        """(turn ends recorded, turn ends reached), both decayed (module doc)."""
        return self._turn_ends_recorded, self._turn_ends_reached

    @property
    def turn_ends_hit(self) -> bool:
        """Whether the ends of turns are likely hit points now (module doc)."""
        recorded = self._turn_ends_recorded
        return (recorded < self.TURN_END_EVIDENCE
                or self._turn_ends_reached >= self.TURN_END_SHARE * recorded)

    def observe_lookup(self, full_end: int, hit_end: int,
                       hashes: Sequence[BlockHash] = ()) -> None:
        """A lookup found full-attention blocks up to ``full_end`` and could hit up to
        ``hit_end``: learn the granule, count the depth of a marked granule point the
        prefix ends at, and count a recorded turn end that it reaches (module doc)."""
        self.observe_prefix_end(full_end)
        if full_end <= 0:
            return
        # A turn end lies at the last hit point at or below the full-attention frontier,
        # or one below that (the earlier request may have stored the full-attention block
        # holding its last token). The frontier need not be a hit point: where the
        # engine's own cache holds more of the prefix, it is where that cache ends.
        top = full_end // self._alignment * self._alignment
        for point in (top, top - self._alignment):
            key = self._hash_at(hashes, point)
            if key is not None and key in self._turn_ends:
                del self._turn_ends[key]  # each turn end counts once
                self._turn_ends_reached += 1.0
                break
        self._count_depth(self._hash_at(hashes, top))

    def _count_depth(self, key: BlockHash | None) -> None:
        """Count a continuation that branched at ``key`` if it is a marked granule point,
        and set how many multiples are kept (module doc)."""
        mark = self._granule_marks.pop(key, None) if key is not None else None
        if mark is None or mark[0] != self.granule:
            return
        counts = self._depth_counts
        for depth in range(len(counts)):
            counts[depth] *= self.GRANULE_DECAY
        self._at_end_count *= self.GRANULE_DECAY
        if mark[1] == _AT_END:
            self._at_end_count += 1.0
        else:
            counts[mark[1]] += 1.0
        total = sum(counts) + self._at_end_count
        if total < self.GRANULE_EVIDENCE:
            return
        deepest = max((depth for depth, n in enumerate(counts)
                       if n >= self.GRANULE_DEPTH_SHARE * total), default=-1)
        self._granule_points = max(self._initial_granule_points, deepest + 1)

    def observe_prefix_end(self, point_tokens: int) -> None:
        """A lookup found full-attention blocks up to ``point_tokens``: learn the granule."""
        if point_tokens <= 0 or point_tokens % self._alignment:
            return
        units = point_tokens // self._alignment
        divides = self._divides
        for shift in range(self.MAX_GRANULE_SHIFT + 1):
            if units % (1 << shift):
                break
            divides[shift] += 1
        total = divides[0]
        if total % 16 == 0:
            shift = 0
            while (shift < self.MAX_GRANULE_SHIFT
                   and divides[shift + 1] >= self._granule_share * total):
                shift += 1
            granule = self._alignment << shift
            if granule != self.granule:
                # Depths were counted in the old granule's units: start again.
                self.granule = granule
                self._depth_counts = [0.0] * self._max_granule_points
                self._at_end_count = 0.0
                self._granule_points = self._initial_granule_points

    def admit(self, group: ResolvedGroup, block: int, hashes: Sequence[BlockHash],
              num_prompt_tokens: int, continues: bool | None = None) -> Admit:
        if self._any_hit_point(self._points(group, block), hashes, num_prompt_tokens,
                               continues):
            return Admit.YES
        return Admit.SPARE_ROOM if self._has_room() else Admit.NO

    def admit_blocks(self, group: ResolvedGroup, blocks: Sequence[int],
                     hashes: Sequence[BlockHash], num_prompt_tokens: int,
                     continues: bool | None = None) -> list[Admit]:
        """``admit`` of each of ``blocks`` in turn, in one call: the same verdicts, and the
        same learned points refreshed in the same order (nothing they read changes
        between the blocks of one store, the tier's room included)."""
        obs = group.offloaded_block_size
        reach = ((group.window_blocks or 1) - 1) * obs  # ``_points``: last minus first
        alignment = self._alignment
        any_hit_point = self._any_hit_point
        otherwise: Admit | None = None
        verdicts: list[Admit] = []
        for block in blocks:
            first = (block + 1) * obs
            points = range(first + -first % alignment, first + reach + 1, alignment)
            if any_hit_point(points, hashes, num_prompt_tokens, continues):
                verdicts.append(Admit.YES)
                continue
            if otherwise is None:
                otherwise = Admit.SPARE_ROOM if self._has_room() else Admit.NO
            verdicts.append(otherwise)
        return verdicts

    def record_prompt_end(self, hashes: Sequence[BlockHash], num_prompt_tokens: int) -> None:
        """Mark the prompt's last ``max_granule_points`` granule multiples with their depth,
        so that a later prompt branching at one counts it (when the count can change)."""
        if not self._learns_depth:
            return
        g = self.granule
        base = (num_prompt_tokens - 1) // g * g
        marks = [(num_prompt_tokens, _AT_END)] if num_prompt_tokens % g == 0 else []
        marks += [(base - depth * g, depth) for depth in range(self._max_granule_points)]
        for point, depth in marks:
            key = self._hash_at(hashes, point)
            if key is None:
                continue
            old = self._granule_marks.get(key)
            # What serves a shallower mark of another prompt here serves this one too.
            kept = min(depth, old[1]) if old is not None and old[0] == g else depth
            self._remember(self._granule_marks, key, (g, kept))

    def record_turn_end(self, hashes: Sequence[BlockHash], num_prompt_tokens: int,
                        num_tokens: int) -> None:
        """Remember where this turn ended, to count later prompts that reach it: the last
        hit point before its last token (whose KV a continuation computes), if it lies
        past every prompt end point."""
        turn_end = (num_tokens - 1) // self._alignment * self._alignment
        if turn_end <= num_prompt_tokens // self._alignment * self._alignment:
            return
        key = self._hash_at(hashes, turn_end)
        if key is None:
            return
        self._turn_ends_recorded = self._turn_ends_recorded * self.TURN_END_DECAY + 1.0
        self._turn_ends_reached *= self.TURN_END_DECAY
        self._remember(self._turn_ends, key, None)

    def forget_cached(self) -> None:
        """Turn ends not reached yet never will be (their blocks are gone): forgotten,
        and taken out of the recorded count. Marked granule points are forgotten too."""
        self._turn_ends_recorded = max(self._turn_ends_reached,
                                       self._turn_ends_recorded - len(self._turn_ends))
        self._turn_ends.clear()
        self._granule_marks.clear()

    def learn_miss(self, hashes: Sequence[BlockHash], point_tokens: int) -> None:
        key = self._hash_at(hashes, point_tokens)
        if point_tokens % self._alignment == 0 and key is not None:
            self._remember(self._learned, key, None)

    def resume_point(self, frontier: int, num_prompt_tokens: int) -> int:
        """The last aligned point at or before ``frontier`` while the prompt is still being
        computed (after it, every point is a hit point already)."""
        if frontier >= num_prompt_tokens - 1:
            return 0
        return frontier // self._alignment * self._alignment

    def hit_point_between(self, start: int, stop: int, hashes: Sequence[BlockHash],
                          num_prompt_tokens: int, continues: bool | None = None) -> bool:
        first = start + -start % self._alignment
        return self._any_hit_point(range(first, stop, self._alignment), hashes,
                                   num_prompt_tokens, continues)

    def demote_on_finish(self, group: ResolvedGroup, stored_from: int, stored_to: int,
                         num_prompt_tokens: int, num_tokens: int) -> range:
        """Decode-phase blocks that no hit at the end of this turn can use."""
        obs = group.offloaded_block_size
        turn_end = (num_tokens - 1) // self._alignment * self._alignment
        keep_from = turn_end // obs - (group.window_blocks or 1)
        first_decode = max(stored_from, num_prompt_tokens // obs)
        return range(first_decode, max(first_decode, min(stored_to, keep_from)))

    @property
    def num_learned(self) -> int:
        return len(self._learned)

