"""The eviction-policy interface, the per-key state record, and the policy registry.

A policy is the tier's key store *and* its eviction order: it maps every key the tier holds
to a ``BlockState`` (ref count and slot) and decides which idle keys to give up. Keeping
both in one structure means one dict entry per key, which matters with millions of keys.

The tier owns the meaning of the state (it sets ``ref``) and the slots; the policy only
reads ``ref`` to know what it may evict (and, for ARC, whether a touch counts).

Ref count meaning (``BlockState.ref``):

* ``WRITING`` (-1): inserted by ``prepare_store``, bytes in flight; not readable, never
  evicted.
* ``0``: ready and idle; evictable unless protected.
* ``> 0``: ready and pinned by that many load jobs; never evicted.

A tier builds its policy from the cache-policy registry (``kvoffload.policies``): the entry
named by ``OffloadConfig.eviction_policy`` says which class evicts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from collections.abc import Set as AbstractSet
from operator import attrgetter, itemgetter
from typing import Any, ClassVar, NamedTuple

from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey

WRITING = -1
"""``BlockState.ref`` of a key whose bytes are being written."""


class BlockState:
    """Per-key bookkeeping: ref count, slot and group. Mutable; three fields, no ``__dict__``.

    ``ref`` follows the module docstring (-1 writing, 0 idle, >0 pinned). ``slot`` is the
    tier slot holding the block. ``group`` is the key's group index (``key_group``), kept
    here so that the tier's hot paths need not decode it from the key again.
    """

    __slots__ = ("group", "ref", "slot")

    def __init__(self, slot: int, ref: int = WRITING, group: int = 0) -> None:
        self.slot = slot
        self.ref = ref
        self.group = group

    @property
    def ready(self) -> bool:
        """Readable: the write completed."""
        return self.ref >= 0

    @property
    def evictable(self) -> bool:
        """Ready and not pinned (the policy may still refuse it if protected)."""
        return self.ref == 0

    def __repr__(self) -> str:
        return f"BlockState(slot={self.slot}, ref={self.ref}, group={self.group})"


class ValueHint(NamedTuple):
    """What a present key is worth, for value-aware eviction (``set_values``).

    Attributes:
        key: the key.
        saved: prefill compute (FLOPs) a hit through this key saves, per the planner.
        nbytes: bytes the hit needs, all groups together (the ratio is the value per byte).
        anchor: the full-attention key this key is useless without (a window block or a
            Mamba state of one hit point), or ``None``.
    """

    key: OffloadKey
    saved: float
    nbytes: float
    anchor: OffloadKey | None = None


class ValueRun(NamedTuple):
    """One value for many present keys (a request's keys of one group): the
    ``ValueHint`` of each key in turn, without an object per key.

    Attributes:
        keys: the keys, in the order their hints would be given.
        saved: prefill compute (FLOPs) a hit through them saves.
        nbytes: bytes that hit needs, all groups together.
        anchors: each key's anchor (``ValueHint.anchor``), or ``None``: no key has one.
    """

    keys: Sequence[OffloadKey]
    saved: float
    nbytes: float
    anchors: Sequence[OffloadKey | None] | None = None

    def hints(self) -> list[ValueHint]:
        """The same hints, one ``ValueHint`` per key."""
        anchors = self.anchors if self.anchors is not None else [None] * len(self.keys)
        return [ValueHint(key, self.saved, self.nbytes, anchor)
                for key, anchor in zip(self.keys, anchors, strict=True)]


Victims = list[tuple[OffloadKey, BlockState]]
"""Evicted keys with their (now detached) states, in eviction order."""


class EvictionPolicy(ABC):
    """Holds a tier's keys in eviction order and picks victims.

    Contract:

    * ``insert`` adds a key that is not present; ``remove`` drops a present key without
      treating it as an eviction (ARC keeps no ghost for it). Both raise
      ``InvariantError`` on misuse.
    * ``touch`` reorders present keys so the *first* key given ends most recent; keys not
      present are ignored (ARC adapts on ghost keys).
    * ``evict(n, protected)`` is atomic: it removes exactly ``n`` keys whose ``ref`` is 0
      and that are not in ``protected`` and returns them, or returns ``None`` and changes
      nothing. It never picks a writing (-1) or pinned (>0) key.
    * A scan for victims is linear in the entries it passes over, never quadratic.
    """

    name: ClassVar[str] = ""

    new_state: ClassVar[Callable[..., BlockState]] = BlockState
    """Makes the state of a key about to be inserted, as ``BlockState(slot, ref, group)``
    does: the tier builds its new keys' states with it, so that a policy that keeps more
    per key (a ``BlockState`` subclass) keeps one object per key."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"policy capacity must be >= 1, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> BlockState | None:
        """The key's state, or ``None`` if not present. Changes nothing."""

    @property
    def state_of(self) -> Callable[[OffloadKey], BlockState | None]:
        """A function that answers as ``get`` does, for the tier's per-key loops: where the
        policy keeps every present key in one dict, that dict's own ``get`` (no Python
        frame per key). It stays valid for the policy's whole life, ``clear`` included.
        Default: ``get``."""
        return self.get

    @abstractmethod
    def __len__(self) -> int:
        """Keys present (ready or writing); ghost entries are not counted."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(OffloadKey(key)) is not None

    @abstractmethod
    def insert(self, key: OffloadKey, state: BlockState) -> None:
        """Add an absent key as most recent (ARC: into T1). Present key: ``InvariantError``."""

    def insert_all(self, keys: Sequence[OffloadKey], states: Sequence[BlockState]) -> None:
        """``insert`` each key with its state, in order (the last key ends most recent).

        Either every key is absent and all are inserted, or ``InvariantError`` is raised
        and nothing changes; ``keys`` must not repeat a key (the caller dedups). Default:
        one ``insert`` per key after checking that none is present."""
        if len(keys) != len(states):
            raise InvariantError(f"{self.name}: {len(keys)} keys but {len(states)} states")
        if any(self.get(key) is not None for key in keys):
            raise InvariantError(f"{self.name}: insert of a key already present")
        for key, state in zip(keys, states, strict=True):
            self.insert(key, state)

    @abstractmethod
    def remove(self, key: OffloadKey) -> BlockState:
        """Drop a present key (not an eviction) and return its state. Absent: ``InvariantError``."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark present keys used, processing in reverse so ``keys[0]`` ends most recent."""

    def demote(self, keys: Sequence[OffloadKey]) -> None:
        """Hint: present keys are worth little; evict them before others. Default: ignore."""
        del keys

    def cool(self, keys: Sequence[OffloadKey]) -> int:
        """Hint: present keys not used since their insertion are cold: evict them before
        keys inserted or used normally (a value-aware policy: while those are more than
        its ``normal_share`` of the keys held), oldest first, until they are used.
        Returns how many went cold. Default: ignore (0)."""
        del keys
        return 0

    def warm(self, keys: Sequence[OffloadKey]) -> None:
        """Hint: present cold keys become normal, as if used (``keys[0]`` most recent);
        other keys are left as they are. Default: ignore."""
        del keys

    @abstractmethod
    def evict(self, n: int, protected: AbstractSet[OffloadKey]) -> Victims | None:
        """Remove and return ``n`` idle, unprotected keys; ``None`` (no change) if impossible."""

    def evict_bytes(self, need_bytes: int, need_keys: int, protected: AbstractSet[OffloadKey],
                    size_of: Callable[[OffloadKey], int]) -> Victims:
        """Remove idle, unprotected keys, in this policy's order, until they hold at least
        ``need_bytes`` (by ``size_of``) and number at least ``need_keys``; return them.

        The caller (a tier that charges bytes) checks first that enough such keys exist;
        if they do not, ``InvariantError`` is raised after a partial eviction. The default
        takes one victim at a time through ``evict``.
        """
        victims: Victims = []
        freed = 0
        while freed < need_bytes or len(victims) < need_keys:
            one = self.evict(1, protected)
            if not one:
                raise InvariantError(f"{self.name}: evict_bytes found too few idle keys")
            victims.extend(one)
            freed += size_of(one[0][0])
        return victims

    def set_values(self, values: Sequence[ValueHint | ValueRun]) -> None:
        """Hint: what present keys are worth (``ValueHint``, or a ``ValueRun`` for many
        keys at once: the same as its hints in order); absent keys are ignored.

        Value-aware policies rank keys by it; the default ignores it.
        """
        del values

    @abstractmethod
    def items(self) -> Iterator[tuple[OffloadKey, BlockState]]:
        """Present keys with their states, next victim first. Do not mutate while iterating."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every key (and all adaptive state)."""

    @abstractmethod
    def debug_state(self) -> dict[str, object]:
        """A comparable copy of everything that decides future behaviour (for tests)."""

    def check_integrity(self) -> None:
        """Raise ``InvariantError`` if the policy's structures are inconsistent."""
        if len(self) > self.capacity:
            raise InvariantError(f"{self.name}: {len(self)} keys exceed capacity {self.capacity}")
        for _, state in self.items():
            if state.ref < WRITING:
                raise InvariantError(f"{self.name}: ref count {state.ref} below -1")


def take_idle(entries: Iterator[tuple[OffloadKey, BlockState]], n: int,
              protected: AbstractSet[OffloadKey]) -> Victims:
    """Up to ``n`` idle (ref 0), unprotected entries of ``entries``, in order; ``entries``
    stops right after the last one taken, so a later call goes on from there (one scan
    per list and ``evict`` call, however many pinned or writing keys sit in the way)."""
    taken: Victims = []
    if n <= 0:
        return taken
    take = taken.append
    for entry in entries:
        if entry[1].ref == 0 and entry[0] not in protected:
            take(entry)
            n -= 1
            if not n:
                break
    return taken


_KEY = itemgetter(0)
_STATE = itemgetter(1)
_REF = attrgetter("ref")


def drop(entries: MutableMapping[OffloadKey, Any], keys: Iterable[OffloadKey]) -> None:
    """``del entries[key]`` for every key (each must be there)."""
    for key in keys:
        del entries[key]


NORMAL_SHARE = 0.9
"""While cold keys are held, normal keys are evicted before them once they are more than
this share of the keys held (``ValuePolicy.normal_share``): the newest cold keys are the
stores of running requests, which a preempted request reloads. (On the shared trace at
2-10 % capacity, 0.8 and 0.95 did no better.)"""


def cold_goes_first(normal: int, total: int, share: float) -> bool:
    """The share rule for cold keys: whether the next victim is a cold key rather than a
    normal one, with ``normal`` of the ``total`` keys left normal (and both kinds left):
    yes once normal keys are at most ``share`` of them. Also used by the planner's shadow
    directories (``kvoffload.planner.insertion``), which model the value policy."""
    return normal <= share * total


class DictStatePolicy(EvictionPolicy):
    """An eviction policy that keeps every present key's state in one dict,
    ``self._states`` (which the subclass may pass in: an ``OrderedDict`` that is also its
    order). ``get``, ``state_of``, ``len`` and ``in`` answer from it; the subclass keeps it
    exact: a key is in it exactly while it is present."""

    def __init__(self, capacity: int,
                 states: dict[OffloadKey, BlockState] | None = None) -> None:
        super().__init__(capacity)
        self._states: dict[OffloadKey, BlockState] = {} if states is None else states

    def get(self, key: OffloadKey) -> BlockState | None:
        return self._states.get(key)

    @property
    def state_of(self) -> Callable[[OffloadKey], BlockState | None]:
        """The state dict's own ``get``."""
        return self._states.get

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and key in self._states
