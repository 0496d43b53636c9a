"""Insertion: whether a request's newly stored blocks enter the host tier *hot* or *cold*.

Under LRU insertion every stored block becomes the most recent one. When host memory is
small against the distance at which prefixes come back, that thrashes: every block is
evicted before it is asked for again. It is the common case for a host tier smaller
than the engine's own prefix cache, because stores are written as blocks are computed:
the blocks host memory holds are then the newest ones, which the engine still holds
too, and they are gone before the engine drops its copies.

Bimodal insertion (after Qureshi et al., "Adaptive insertion policies for high
performance caching", ISCA 2007) makes the blocks of most requests *cold*, first in line
for eviction, and keeps those of one request in ``HOT_EVERY`` normal. The cold ones make
room for each other; the hot ones stay long enough for their prefixes to come back, and
a block that is hit becomes normal. A request's blocks go cold when it finishes, not when
they are stored: while it runs, a preemption would reload them. When memory is
plentiful, bimodal insertion loses hits LRU would have had.

Which of the two is better depends on capacity against reuse distance, which nobody
configures. So, as DIP does with set dueling, ``InsertionDuel`` keeps two *shadow
directories* (keys and their charges only, no data) at the tier's budget, one inserting
everything normally and one bimodally, fed the stores the planner makes, the requests
that finish and the first lookup of every request. Each counts the full-attention tokens
it would have served beyond the engine's own hit, with recent lookups weighing most. The
planner uses bimodal insertion while that directory is clearly ahead (``LEAD``) of the
LRU one and of what the tier itself served while inserting normally (the directories
model plain LRU; the tier also ranks by value), LRU insertion otherwise. Hot or cold is
decided per request (a stable hash of its id), so a request's prefix stays together.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from kvoffload.keys import OffloadKey

HOT_EVERY = 8
"""Under bimodal insertion, one request in this many is inserted hot."""

LEAD = 1.25
"""Bimodal insertion is used only while its directory scores this many times LRU's: the
directories model plain LRU, while the tier's own policy also ranks by value, so a small
lead is not a reason to leave normal insertion (chosen on the sweeps in docs/policy.md)."""

DECAY = 0.995
"""Per lookup, how much each directory's past score still counts (about the last 200
lookups decide)."""


def is_hot_request(request_id: str) -> bool:
    """Whether bimodal insertion inserts ``request_id``'s blocks normally (stable)."""
    return zlib.crc32(request_id.encode()) % HOT_EVERY == 0


class ShadowDirectory:
    """Which keys a tier of ``budget`` charge units would hold under one insertion rule:
    an LRU order with cold keys inserted at its front. No data, only keys and charges."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._charges: OrderedDict[OffloadKey, int] = OrderedDict()  # front: evicted first
        self._used = 0
        self._used_keys: set[OffloadKey] = set()  # held keys looked up since insertion

    def __len__(self) -> int:
        return len(self._charges)

    def __contains__(self, key: object) -> bool:
        return key in self._charges

    def __iter__(self) -> Iterator[OffloadKey]:
        """Held keys, the next to evict first."""
        return iter(self._charges)

    @property
    def used(self) -> int:
        """Charge units held."""
        return self._used

    def insert(self, keys: Sequence[tuple[OffloadKey, int]]) -> list[OffloadKey]:
        """Insert (key, charge) pairs not held yet, as the most recent: room is made
        first, from the front. Keys held already are left. Returns the keys inserted."""
        charges = self._charges
        inserted = []
        for key, charge in keys:
            if key in charges or charge > self.budget:
                continue
            while self._used + charge > self.budget:
                victim, freed = charges.popitem(last=False)
                self._used -= freed
                self._used_keys.discard(victim)
            charges[key] = charge
            self._used += charge
            inserted.append(key)
        return inserted

    def demote(self, keys: Iterable[OffloadKey]) -> None:
        """Held keys go to the front (evicted first), the last one given first."""
        charges = self._charges
        for key in keys:
            if key in charges:
                charges.move_to_end(key, last=False)

    def cool(self, keys: Sequence[OffloadKey]) -> None:
        """Held keys not looked up since their insertion go to the front (evicted
        first), the last one given first."""
        self.demote(key for key in keys if key not in self._used_keys)

    def lookup(self, keys: Sequence[OffloadKey], start: int) -> int:
        """How many of ``keys[start:]`` are held in a row; the held keys of that prefix
        (``keys[:start]`` too) become the most recent, the first one last."""
        charges = self._charges
        found = 0
        for key in keys[start:]:
            if key not in charges:
                break
            found += 1
        for key in reversed(keys[:start + found]):
            if key in charges:
                charges.move_to_end(key)
                self._used_keys.add(key)
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
        self._cold: dict[str, list[OffloadKey]] = {}
        """Per running cold request, the keys it inserted into ``bimodal``."""
        self.block_tokens = block_tokens
        self.lru_score = 0.0
        self.bimodal_score = 0.0
        self.served_score = 0.0
        """What the tier itself served while inserting normally (it ranks by value, which
        the LRU directory does not model): bimodal insertion must beat this too."""

    @property
    def bimodal_ahead(self) -> bool:
        """Whether bimodal insertion would have served clearly more tokens lately
        (``LEAD`` times LRU insertion's)."""
        return self.bimodal_score > LEAD * max(self.lru_score, self.served_score)

    def inserts_hot(self, request_id: str) -> bool:
        """Whether ``request_id``'s blocks go in hot under the insertion ahead now."""
        return not self.bimodal_ahead or is_hot_request(request_id)

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

    def observe_store(self, keys: Sequence[tuple[OffloadKey, int]], request_id: str) -> None:
        """The planner stored ``keys`` (with their charges) for ``request_id``."""
        self.lru.insert(keys)
        inserted = self.bimodal.insert(keys)
        if inserted and not is_hot_request(request_id):
            self._cold.setdefault(request_id, []).extend(inserted)

    def observe_demote(self, keys: Sequence[OffloadKey]) -> None:
        """The planner demoted ``keys`` (no likely hit uses them): both directories
        evict them first, as the tier does."""
        self.lru.demote(keys)
        self.bimodal.demote(keys)

    def observe_finish(self, request_id: str) -> None:
        """``request_id`` finished: under bimodal insertion, its keys go cold now."""
        self.bimodal.cool(self._cold.pop(request_id, ()))
