"""Insertion: whether a request's newly stored blocks enter the host tier *hot* or *cold*.

Under LRU insertion every stored block becomes the most recent one. When host memory is
small against the distance at which prefixes come back, that thrashes: every block is
evicted before it is asked for again. It is the common case for a host tier smaller
than the engine's own prefix cache, because stores are written as blocks are computed:
the blocks host memory holds are then the newest ones, which the engine still holds
too, and they are gone before the engine drops its copies. At the smallest capacities
the blocks of the requests running at once are already more than host memory holds.

Bimodal insertion (after Qureshi et al., "Adaptive insertion policies for high
performance caching", ISCA 2007) stores the blocks of most requests *cold*, first in line
for eviction, as they are written, and those of one request in ``HOT_EVERY`` normally
(a stable hash of its id, so a prefix stays together). The cold ones make room for each
other; the others stay long enough for their prefixes to come back, and a block that is
hit becomes normal. The window and state blocks stored only for a prefill's resume point
(the planner's) are stored normally too: a preemption reloads them.

Three rules keep what it costs small:

* The value policy evicts normal keys before cold ones while normal keys are more than
  ``NORMAL_SHARE`` of the keys held (``ValuePolicy.normal_share``), so the newest cold
  stores, which running requests reload after a preemption, always keep some room.
* A preempted request's cold blocks become normal when the engine preempts it: it will
  reload them when it resumes.
* Which insertion is better depends on capacity against reuse distance, which nobody
  configures. So, as DIP does with set dueling, ``InsertionDuel`` keeps two *shadow
  directories* (keys and their charges only, no data) at the tier's budget, one
  inserting everything normally and one bimodally, fed the stores the planner makes, its
  demotions and preemptions, and the first lookup of every request. Each counts the
  full-attention tokens it would have served beyond the engine's own hit, recent
  lookups weighing most. The planner stores requests cold only while the bimodal
  directory is clearly ahead (``LEAD``) of the LRU one and of what the tier itself
  served while inserting normally (the directories model neither value ranking nor
  blocks pinned while they are written). A request is hot or cold from its arrival on.

A client's ``continues`` hint overrides the duel for its request
(``selective.stores_cold``): a conversation that ends stores cold, one that goes on
stores normally. The directories still model the hint-free choice (a cold candidate is
bimodal's cold), so they measure insertion, not the hints; what the tier itself served,
which bimodal insertion must also beat, includes what the hints kept, so where many
requests carry hints the duel stores the others cold less readily.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from itertools import filterfalse, islice, takewhile

from kvoffload.keys import OffloadKey
from kvoffload.tiers.eviction.base import NORMAL_SHARE, cold_goes_first

HOT_EVERY = 8
"""Under bimodal insertion, one request in this many is inserted normally."""

LEAD = 1.25
"""Bimodal insertion is used only while its directory scores this many times LRU's
(chosen on the sweeps in docs/policy.md)."""

DECAY = 0.995
"""Per lookup, how much each directory's past score still counts (about the last 200
lookups decide)."""


def is_hot_request(request_id: str) -> bool:
    """Whether bimodal insertion inserts ``request_id``'s blocks normally (stable)."""
    return zlib.crc32(request_id.encode()) % HOT_EVERY == 0


class ShadowDirectory:
    """Which keys a tier of ``budget`` charge units would hold, ordered as the value
    policy orders them with value weight 0: demoted keys first (in the order demoted),
    then normal keys while they are more than ``normal_share`` of the keys held, cold
    keys otherwise, each kind least recent first. No data, only keys and charges."""

    def __init__(self, budget: int, normal_share: float = NORMAL_SHARE) -> None:
        self.budget = budget
        self.normal_share = normal_share
        self._normal: OrderedDict[OffloadKey, int] = OrderedDict()  # front: evicted first
        self._cold: OrderedDict[OffloadKey, int] = OrderedDict()
        self._demoted: OrderedDict[OffloadKey, int] = OrderedDict()
        self._used = 0

    def __len__(self) -> int:
        return len(self._normal) + len(self._cold) + len(self._demoted)

    def __contains__(self, key: object) -> bool:
        return key in self._normal or key in self._cold or key in self._demoted

    def __iter__(self) -> Iterator[OffloadKey]:
        """Held keys, the next to evict first."""
        yield from self._demoted
        normal, cold = list(self._normal), list(self._cold)
        n = c = 0
        while n < len(normal) or c < len(cold):
            normal_left, cold_left = len(normal) - n, len(cold) - c
            if cold_left and (not normal_left or cold_goes_first(
                    normal_left, normal_left + cold_left, self.normal_share)):
                yield cold[c]
                c += 1
            else:
                yield normal[n]
                n += 1

    @property
    def used(self) -> int:
        """Charge units held."""
        return self._used

    def is_cold(self, key: OffloadKey) -> bool:
        """Whether ``key`` is held cold."""
        return key in self._cold

    def _evict_one(self) -> None:
        if self._demoted:
            segment = self._demoted
        elif self._cold and (not self._normal or cold_goes_first(
                len(self._normal), len(self), self.normal_share)):
            segment = self._cold
        else:
            segment = self._normal
        _, freed = segment.popitem(last=False)
        self._used -= freed

    def insert(self, keys: Sequence[tuple[OffloadKey, int]], cold: bool = False,
               normal: AbstractSet[OffloadKey] = frozenset()) -> None:
        """Insert (key, charge) pairs not held yet as the most recent normal keys, or cold
        ones if ``cold`` (except those in ``normal``), making room first in eviction
        order. Keys held already, and keys larger than the budget, are left."""
        held_normal, held_cold, held_demoted = self._normal, self._cold, self._demoted
        charges = dict(keys)
        if len(charges) == len(keys):  # no key repeated
            new = list(filterfalse(held_demoted.__contains__, filterfalse(
                held_cold.__contains__, filterfalse(held_normal.__contains__, charges))))
            new_charges = list(map(charges.__getitem__, new))
            total = sum(new_charges)
            if self._used + total <= self.budget and (not cold or normal.isdisjoint(new)):
                # Room for every new key: what the loop below does, without a step per key.
                (held_cold if cold else held_normal).update(zip(new, new_charges, strict=True))
                self._used += total
                return
        budget = self.budget
        for key, charge in keys:
            if (key in held_normal or key in held_cold or key in held_demoted
                    or charge > budget):
                continue
            while self._used + charge > budget:
                self._evict_one()
            (held_cold if cold and key not in normal else held_normal)[key] = charge
            self._used += charge

    def warm(self, keys: Sequence[OffloadKey]) -> None:
        """Held cold keys become the most recent normal ones, the first one last."""
        for key in reversed(keys):
            if key in self._cold:
                self._normal[key] = self._cold.pop(key)

    def demote(self, keys: Sequence[OffloadKey]) -> None:
        """Held keys are evicted before any other, in the order given (a key demoted
        already goes to the end of that order)."""
        normal, cold, demoted = self._normal, self._cold, self._demoted
        for key in keys:
            charge = normal.pop(key, None)
            if charge is None:
                charge = cold.pop(key, None)
                if charge is None:
                    charge = demoted.pop(key, None)
                    if charge is None:
                        continue
            demoted[key] = charge

    def lookup(self, keys: Sequence[OffloadKey], start: int) -> int:
        """How many of ``keys[start:]`` are held in a row; the held keys of that prefix
        (``keys[:start]`` too) become the most recent normal keys, the first one last
        (demoted keys stay demoted)."""
        normal, cold, demoted = self._normal, self._cold, self._demoted
        if not cold and not demoted:
            # Only normal keys held (the LRU directory): the same, without a Python step
            # per key.
            found = len(list(takewhile(normal.__contains__, keys[start:])))
            deque(map(normal.move_to_end,
                      filter(normal.__contains__, reversed(keys[:start + found]))), maxlen=0)
            return found
        # Held keys in a row, a run of one kind at a time (no Python step per key).
        rest = keys[start:]
        found = 0
        while found < len(rest):
            key = rest[found]
            kind = (normal if key in normal else cold if key in cold
                    else demoted if key in demoted else None)
            if kind is None:
                break
            found += len(list(takewhile(kind.__contains__, islice(rest, found, None))))
        # Every held normal or cold key of the prefix ends most recent, the first one last:
        # cold ones join the normal keys, then all of them move to the end in that order.
        prefix = keys[:start + found][::-1]
        warmed = list(dict.fromkeys(filter(cold.__contains__, prefix)))  # a key once
        if warmed:
            normal.update(zip(warmed, map(cold.pop, warmed), strict=True))
        deque(map(normal.move_to_end, filter(normal.__contains__, prefix)), maxlen=0)
        return found


class InsertionDuel:
    """Chooses between LRU and bimodal insertion by two shadow directories (module doc).

    Args:
        budget: the host tier's budget, in the units ``charges`` are given in.
        block_tokens: tokens per full-attention offloaded block (scores are in tokens).
    """

    def __init__(self, budget: int, block_tokens: int) -> None:
        self.lru = ShadowDirectory(budget)
        self.bimodal = ShadowDirectory(budget)
        self.block_tokens = block_tokens
        self.lru_score = 0.0
        self.bimodal_score = 0.0
        self.served_score = 0.0
        """What the tier itself served while inserting normally (it ranks by value, which
        the LRU directory does not model): bimodal insertion must beat this too."""

    @property
    def bimodal_ahead(self) -> bool:
        """Whether bimodal insertion would have served clearly more tokens lately
        (``LEAD`` times LRU insertion's, and what the tier served inserting normally)."""
        return self.bimodal_score > LEAD * max(self.lru_score, self.served_score)

    def observe_lookup(self, full_keys: Sequence[OffloadKey], engine_blocks: int,
                       served: int) -> None:
        """A request's first lookup: ``full_keys`` are its full-attention keys, the first
        ``engine_blocks`` of which the engine has itself; the tier served ``served``
        tokens beyond them."""
        if not self.bimodal_ahead:  # LRU insertion now: the tier itself shows what it serves
            self.served_score = self.served_score * DECAY + served
        tokens = self.block_tokens
        self.lru_score = self.lru_score * DECAY + tokens * self.lru.lookup(
            full_keys, engine_blocks)
        self.bimodal_score = self.bimodal_score * DECAY + tokens * self.bimodal.lookup(
            full_keys, engine_blocks)

    def observe_store(self, keys: Sequence[tuple[OffloadKey, int]], cold: bool,
                      normal: AbstractSet[OffloadKey] = frozenset()) -> None:
        """The planner stored ``keys`` (with their charges) for a request that bimodal
        insertion stores ``cold``, except the keys in ``normal``."""
        self.lru.insert(keys)
        self.bimodal.insert(keys, cold, normal)

    def observe_demote(self, keys: Sequence[OffloadKey]) -> None:
        """The planner demoted ``keys`` (no likely hit uses them): both directories
        evict them first, as the tier does."""
        self.lru.demote(keys)
        self.bimodal.demote(keys)

    def observe_preempt(self, keys: Sequence[OffloadKey]) -> None:
        """A request with prefix ``keys`` was preempted: cold ones become normal."""
        self.bimodal.warm(keys)
