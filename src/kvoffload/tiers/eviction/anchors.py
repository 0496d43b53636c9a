"""Anchor links of the value policy (``AnchorLinks``): which keys a key's hits depend on.

A window block or Mamba state is useless without the full-attention key of its hit point
(its *anchor*, ``ValueHint.anchor``). ``ValuePolicy`` records each such link once (the
first hint that names it) and, when an anchor leaves, demotes the keys that depended on
it for good. This module keeps the links in both directions; the policy decides what a
departed anchor means for its dependents.
"""

from __future__ import annotations

from collections.abc import Container, Set

from kvoffload.errors import InvariantError
from kvoffload.keys import OffloadKey


class AnchorLinks:
    """Dependent -> anchor links and their reverse, kept in step (plain bookkeeping)."""

    __slots__ = ("_anchor_of", "_dependents")

    def __init__(self) -> None:
        self._anchor_of: dict[OffloadKey, OffloadKey] = {}
        self._dependents: dict[OffloadKey, set[OffloadKey]] = {}

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is linked to an anchor already."""
        return key in self._anchor_of

    def link(self, key: OffloadKey, anchor: OffloadKey) -> None:
        """``key`` depends on ``anchor`` (``key`` must not be linked yet)."""
        self._anchor_of[key] = anchor
        self._dependents.setdefault(anchor, set()).add(key)

    def forget(self, key: OffloadKey) -> Set[OffloadKey]:
        """``key`` left the tier: drop its own link and return the keys that depended on it
        (their links are dropped too; the caller demotes those still present)."""
        anchor = self._anchor_of.pop(key, None)
        if anchor is not None:
            siblings = self._dependents.get(anchor)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._dependents[anchor]
        deps = self._dependents.pop(key, None)
        if not deps:
            return frozenset()
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

    def check_integrity(self, present: Container[OffloadKey]) -> None:
        """Raise ``InvariantError`` unless both directions agree and name present keys."""
        for dep, anchor in self._anchor_of.items():
            if dep not in present or anchor not in present:
                raise InvariantError("value: an anchor link names an absent key")
            if dep not in self._dependents.get(anchor, ()):
                raise InvariantError("value: anchor links disagree")
        if sum(len(d) for d in self._dependents.values()) != len(self._anchor_of):
            raise InvariantError("value: dependents and anchors disagree")
