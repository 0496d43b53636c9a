"""Anchor links of the value policy (``AnchorLinks``): which keys a key's hits depend on.

A window block or Mamba state is useless without the full-attention key of its hit point
(its *anchor*, ``ValueHint.anchor``). ``ValuePolicy`` records each such link once (the
first hint that names it) and, when an anchor leaves, demotes the keys that depended on
it for good. This module keeps the links in both directions; the policy decides what a
departed anchor means for its dependents.
"""

from __future__ import annotations

from collections.abc import Collection, Container

from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey


class AnchorLinks:
    """Dependent -> anchor links and their reverse, kept in step (plain bookkeeping).

    An anchor's dependents are most often one key (a window block or state at the
    anchor's position): that key is kept as it is, and a set is made only for a second
    one (one object less per anchor)."""

    __slots__ = ("_anchor_of", "_dependents")

    def __init__(self) -> None:
        self._anchor_of: dict[OffloadKey, OffloadKey] = {}
        self._dependents: dict[OffloadKey, OffloadKey | set[OffloadKey]] = {}

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is linked to an anchor already."""
        return key in self._anchor_of

    def link(self, key: OffloadKey, anchor: OffloadKey) -> None:
        """``key`` depends on ``anchor`` (``key`` must not be linked yet)."""
        self._anchor_of[key] = anchor
        dependents = self._dependents
        deps = dependents.get(anchor)
        if deps is None:
            dependents[anchor] = key
        elif isinstance(deps, set):
            deps.add(key)
        else:
            dependents[anchor] = {deps, key}  # as set() then add(deps), add(key)

    def forget(self, key: OffloadKey) -> Collection[OffloadKey]:
        """``key`` left the tier: drop its own link and return the keys that depended on it
        (their links are dropped too; the caller demotes those still present)."""
        anchor = self._anchor_of.pop(key, None)
        dependents = self._dependents
        if anchor is not None:
            siblings = dependents.get(anchor)
            if isinstance(siblings, set):
                siblings.discard(key)
                if not siblings:
                    del dependents[anchor]
            elif siblings == key:
                del dependents[anchor]
        found = dependents.pop(key, None)
        if not found:
            return ()
        deps: Collection[OffloadKey] = found if isinstance(found, set) else (found,)
        for dep in deps:
            self._anchor_of.pop(dep, None)
        return deps

    def clear(self) -> None:
        """Drop every link."""
        self._anchor_of.clear()
        self._dependents.clear()

    def debug_state(self) -> list[tuple[OffloadKey, OffloadKey]]:
        """The (dependent, anchor) links, sorted."""
        return sorted(self._anchor_of.items())

    def _of(self, anchor: OffloadKey) -> Collection[OffloadKey]:
        """The keys that depend on ``anchor``."""
        deps = self._dependents.get(anchor)
        if deps is None:
            return ()
        return deps if isinstance(deps, set) else (deps,)

    def check_integrity(self, present: Container[OffloadKey]) -> None:
        """Raise ``InvariantError`` unless both directions agree and name present keys."""
        for dep, anchor in self._anchor_of.items():
            if dep not in present or anchor not in present:
                raise InvariantError("value: an anchor link names an absent key")
            if dep not in self._of(anchor):
                raise InvariantError("value: anchor links disagree")
        if sum(len(self._of(a)) for a in self._dependents) != len(self._anchor_of):
            raise InvariantError("value: dependents and anchors disagree")
        if any(isinstance(d, set) and not d for d in self._dependents.values()):
            raise InvariantError("value: an anchor without dependents")
