"""The rules of each KV-cache group kind, in one table (``KIND_RULES``).

Every module that treats a group by its kind asks this table instead of testing the kind:
the configuration (how many offloaded blocks a hit needs, the hit alignment), the lookup
fixpoint's order, the planner's load and store positions, the value of a prefix and the
reference engine's labels.

Two window sizes exist for a sliding-window group of ``W`` tokens, both right for their
purpose:

* **offload rule** (``window_blocks``): a hit at token ``t`` reads the offloaded blocks
  covering tokens ``[t - W, t)``, at most ``ceil(W / offloaded block)`` of them (blocks are
  stored whole, so the rule counts whole blocks of the offloaded size);
* **engine retention** (``engine_retention_blocks``): while a request runs, the engine keeps
  the blocks holding its last ``W - 1`` tokens (the next token attends to them and to
  itself), ``ceil((W - 1) / block)`` engine blocks, and frees those before.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvoffload.config import GroupSpec


class GroupKind(str, Enum):
    """What one block of a group holds, and therefore what a cache hit needs from it."""

    FULL_ATTENTION = "full_attention"
    """K/V of ``block_size`` tokens; a hit at token t needs every block before t."""
    SLIDING_WINDOW = "sliding_window"
    """K/V of ``block_size`` tokens; a hit at t needs the blocks covering the last W tokens."""
    MAMBA = "mamba"
    """One recurrent-state snapshot after the block's last token; a hit at t needs that state."""


class KindRules:
    """The rules one group kind follows. Subclasses set the class attributes."""

    kind: ClassVar[GroupKind]
    whole_prefix: ClassVar[bool] = False
    """A hit needs every block before it (full attention): looked up once, never re-checked
    by the fixpoint."""
    takes_window: ClassVar[bool] = False
    """Its spec gives a ``sliding_window`` (and must)."""
    takes_state_alignment: ClassVar[bool] = False
    """Its spec may give a ``state_alignment``."""
    loads_every_position: ClassVar[bool] = True
    """A load writes every engine position from its first to the hit's end (no nulls)."""
    holds_state: ClassVar[bool] = False
    """A block holds one recurrent state, that after its last token (Mamba): only that
    position is stored, and only where a step ended there."""
    attention_cost: ClassVar[bool] = True
    """Its prefill cost grows with the attended span (attention), not only with tokens."""
    takes_proof_tokens: ClassVar[bool] = False
    """Its spec may give ``proof_tokens`` (a draft model's layers): its blocks are keyed,
    stored and hit that many tokens late. Only where a hit needs every block before it:
    a window's blocks would have slid out before they could be stored, and a Mamba state
    is the state at its block's end."""

    def window_blocks(self, spec: GroupSpec, offloaded_block_size: int) -> int | None:
        """Offloaded blocks a hit needs just before its end; None: every block before it."""
        del spec, offloaded_block_size
        return None

    def alignment(self, spec: GroupSpec, offloaded_block_size: int) -> int:
        """A hit must be a multiple of this many tokens for this group."""
        del spec
        return offloaded_block_size

    def lookup_rank(self, spec: GroupSpec, block_tokens: int) -> tuple[int, int]:
        """Sort key of the lookup fixpoint (stable): full attention first, then the groups
        a hit needs a window of, widest window in tokens first (a Mamba state is a window
        of one block of ``block_tokens``). Each group visited can only shrink the hit."""
        del spec, block_tokens
        return (0, 0)

    def load_start(self, spec: GroupSpec, first: int, end_tokens: int) -> int:
        """The first engine position a load ending at ``end_tokens`` writes, given that the
        engine holds positions before ``first``."""
        del spec, end_tokens
        return first

    def engine_retention_blocks(self, spec: GroupSpec) -> int | None:
        """Engine blocks a running request keeps at its end; None: all of them."""
        del spec
        return None

    def label(self, spec: GroupSpec) -> str:
        """How reports name a group of this kind."""
        del spec
        return "full attention"


class FullAttentionRules(KindRules):
    """Every token attends to every earlier one: a hit needs every block before it."""

    kind = GroupKind.FULL_ATTENTION
    whole_prefix = True
    takes_proof_tokens = True


class SlidingWindowRules(KindRules):
    """Tokens attend to the last ``W``: a hit needs the blocks covering them."""

    takes_window = True
    loads_every_position = False
    """Positions before the window may be null in the engine's table."""

    kind = GroupKind.SLIDING_WINDOW

    def window_blocks(self, spec: GroupSpec, offloaded_block_size: int) -> int | None:
        assert spec.sliding_window is not None
        return math.ceil(spec.sliding_window / offloaded_block_size)

    def lookup_rank(self, spec: GroupSpec, block_tokens: int) -> tuple[int, int]:
        assert spec.sliding_window is not None
        return (1, -math.ceil(spec.sliding_window / block_tokens) * block_tokens)

    def load_start(self, spec: GroupSpec, first: int, end_tokens: int) -> int:
        assert spec.sliding_window is not None
        return max(first, (end_tokens - spec.sliding_window) // spec.block_size)

    def engine_retention_blocks(self, spec: GroupSpec) -> int | None:
        assert spec.sliding_window is not None
        return -(-(spec.sliding_window - 1) // spec.block_size)

    def label(self, spec: GroupSpec) -> str:
        return f"sliding window {spec.sliding_window}"


class MambaRules(KindRules):
    """A recurrent state: a hit needs exactly the state at its end."""

    takes_state_alignment = True
    holds_state = True
    attention_cost = False

    kind = GroupKind.MAMBA

    def window_blocks(self, spec: GroupSpec, offloaded_block_size: int) -> int | None:
        return 1

    def alignment(self, spec: GroupSpec, offloaded_block_size: int) -> int:
        if spec.state_alignment is None:
            return offloaded_block_size
        return math.lcm(offloaded_block_size, spec.state_alignment)

    def lookup_rank(self, spec: GroupSpec, block_tokens: int) -> tuple[int, int]:
        return (1, -block_tokens)

    def load_start(self, spec: GroupSpec, first: int, end_tokens: int) -> int:
        return max(first, end_tokens // spec.block_size - 1)

    def engine_retention_blocks(self, spec: GroupSpec) -> int | None:
        return 1

    def label(self, spec: GroupSpec) -> str:
        return "mamba"


KIND_RULES: dict[GroupKind, KindRules] = {
    GroupKind.FULL_ATTENTION: FullAttentionRules(),
    GroupKind.SLIDING_WINDOW: SlidingWindowRules(),
    GroupKind.MAMBA: MambaRules(),
}
"""The rules of each group kind."""
