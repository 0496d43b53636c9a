"""A model laid out for one engine block size: ``ModelLayout`` and its ``ModelGroup``s.

Contract. ``ModelPreset.layout`` (``kvoffload.models.preset``) decides which KV-cache groups
a model has and their real sizes; this module holds the result and decides the bytes that
are *moved*. A ``ModelLayout`` is a frozen value: its groups in the engine's order, each a
``ModelGroup`` holding the group spec the worker moves (``spec``) beside the real figures
accounting uses (``real_page_bytes``, ``real_spec``, ``bytes_per_token``,
``bytes_per_state``). A ``ModelGroup`` is a model's group as kvoffload sizes it; how a
worker lays a group's tensors out is another thing (``kvoffload.worker.layout.GroupLayout``).

Scaled layouts. Moving real pages (a Nemotron-H state is ~4 MiB per layer) makes tests and
simulations slow, so ``layout(..., scale_bytes=N)`` shrinks the pages that are *moved*
(``scale_pages``): the smallest group's page becomes ``N`` bytes and the others keep their
ratio to it (rounded up to 8 bytes). The layout keeps the real sizes beside the moved ones,
so that accounting (capacity, bytes saved, TTFT) can use the real numbers; ``describe()``
says which.

This module imports nothing of ``kvoffload.models`` at run time (``ModelPreset`` is named
for type checking only, as the type of ``ModelLayout.preset``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvoffload.config import GroupSpec
from kvoffload.group_kinds import KIND_RULES

if TYPE_CHECKING:
    from kvoffload.models.preset import ModelPreset

_PAGE_ALIGN = 8
"""Moved (scaled) pages are rounded up to a multiple of this many bytes."""


@dataclass(frozen=True)
class ModelGroup:
    """One KV-cache group of a ``ModelLayout``: the spec it moves and its real sizes.

    Attributes:
        spec: the group spec whose ``page_bytes`` is what is *moved* (scaled or real).
        real_page_bytes: bytes of one block of one layer in the real model.
        bytes_per_token: real bytes per token across the group's layers (0 for Mamba).
        bytes_per_state: real bytes of one state snapshot across the group's layers
            (0 for attention groups).
    """

    spec: GroupSpec
    real_page_bytes: int
    bytes_per_token: int
    bytes_per_state: int

    @property
    def is_scaled(self) -> bool:
        return self.spec.page_bytes != self.real_page_bytes

    @property
    def real_block_bytes(self) -> int:
        """Real bytes of one engine block across the group's layers."""
        return self.real_page_bytes * self.spec.num_layers

    @property
    def real_spec(self) -> GroupSpec:
        """The group spec with the real page size."""
        return replace(self.spec, page_bytes=self.real_page_bytes)

    @classmethod
    def unscaled(cls, spec: GroupSpec, *, bytes_per_token: int = 0,
             bytes_per_state: int = 0) -> ModelGroup:
        """The unscaled group whose ``spec`` has the real page size."""
        return cls(spec=spec, real_page_bytes=spec.page_bytes,
                   bytes_per_token=bytes_per_token, bytes_per_state=bytes_per_state)


@dataclass(frozen=True)
class ModelLayout:
    """A preset laid out for one engine block size.

    ``specs`` are what the worker moves (possibly scaled); ``real_specs`` and the real byte
    figures of each ``ModelGroup`` are what accounting uses.
    """

    preset: ModelPreset
    block_size: int
    groups: tuple[ModelGroup, ...]
    scale_bytes: int | None

    @property
    def specs(self) -> tuple[GroupSpec, ...]:
        """Group specs with the moved page sizes (equal to the real ones when unscaled)."""
        return tuple(g.spec for g in self.groups)

    @property
    def real_specs(self) -> tuple[GroupSpec, ...]:
        """Group specs with the real page sizes."""
        return tuple(g.real_spec for g in self.groups)

    @property
    def is_scaled(self) -> bool:
        return any(g.is_scaled for g in self.groups)

    def describe(self) -> str:
        """A human-readable table of the layout, saying whether moved bytes are scaled."""
        head = (f"{self.preset.name}: block_size {self.block_size} tokens; "
                + ("moved pages SCALED (smallest page -> "
                   f"{self.scale_bytes} B); accounting uses real sizes"
                   if self.is_scaled else "moved pages are the real sizes"))
        lines = [head]
        for i, g in enumerate(self.groups):
            s = g.spec
            what = (f"{g.bytes_per_state} B/state" if KIND_RULES[s.kind].holds_state
                    else f"{g.bytes_per_token} B/token")
            window = f" W={s.sliding_window}" if s.sliding_window is not None else ""
            lines.append(f"  group {i} {s.name}{window}: {s.num_layers} layers, "
                         f"block {s.block_size} tokens, page {g.real_page_bytes} B real / "
                         f"{s.page_bytes} B moved, {what}")
        return "\n".join(lines)


def scale_pages(groups: Sequence[ModelGroup], scale_bytes: int | None) -> tuple[ModelGroup, ...]:
    """``groups`` (unscaled) with their moved pages scaled so that the smallest real page
    becomes ``scale_bytes`` bytes and the others keep their ratio to it, rounded up to
    ``_PAGE_ALIGN``; unchanged when ``scale_bytes`` is None. Real sizes are kept."""
    if scale_bytes is None:
        return tuple(groups)
    smallest = min(g.real_page_bytes for g in groups)
    return tuple(replace(g, spec=replace(g.spec, page_bytes=_round_up(
        math.ceil(g.real_page_bytes * scale_bytes / smallest), _PAGE_ALIGN))) for g in groups)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
