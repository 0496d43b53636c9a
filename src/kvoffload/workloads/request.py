"""The workload request type and deterministic token derivation.

Token ids are stored compactly (``array('i')``, 4 bytes per token): a trace of tens of
thousands of long prompts would not fit as Python lists. Synthetic token ids come from
``derive_tokens``: SHAKE-128 of a label, read as little-endian 16-bit values, so they are
in ``[0, 65536)`` (within every preset's vocabulary), identical across processes, platforms
and Python versions, and equal exactly when the labels are equal.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from kvoffload.keys import BlockHash, BlockHasher, HashContext
from kvoffload.planner.contract import RequestControls

TokenIds: TypeAlias = "array[int]"
"""A compact sequence of token ids (``array('i')``); treat it as read-only."""

TOKEN_TYPECODE = "i"
MAX_SYNTHETIC_TOKEN = 1 << 16
"""Synthetic token ids are in ``[0, MAX_SYNTHETIC_TOKEN)``."""


def derive_tokens(label: str, num_tokens: int) -> array[int]:
    """``num_tokens`` deterministic token ids derived from ``label``."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    digest = hashlib.shake_128(label.encode()).digest(2 * num_tokens)
    # Widen each little-endian 16-bit word to a little-endian int32 by slice copies (C
    # speed; a per-token Python loop is 3x slower and this runs for every trace block).
    wide = bytearray(4 * num_tokens)
    wide[0::4] = digest[0::2]
    wide[1::4] = digest[1::2]
    tokens = array(TOKEN_TYPECODE)
    tokens.frombytes(wide)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


def as_token_ids(tokens: Sequence[int]) -> array[int]:
    """``tokens`` as a compact ``array('i')`` (returned as is when it already is one)."""
    if isinstance(tokens, array) and tokens.typecode == TOKEN_TYPECODE:
        return tokens
    return array(TOKEN_TYPECODE, tokens)


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload, as an engine would receive it.

    Attributes:
        request_id: unique within the workload.
        arrival_s: arrival time in seconds from the workload's start (open loop).
        prompt: the prompt's token ids (converted to ``array('i')``; do not mutate).
        output_length: tokens to generate (>= 1).
        session_id: the conversation or agent session it belongs to, if any.
        turn: its index within the session, if any.
        cache_salt: per-tenant salt; requests with different salts never share cache.
        output_tokens: the tokens the engine should emit when it decodes, when the
            workload knows them (so that a later turn's prompt, which repeats them, hits
            the cache); ``len(output_tokens) == output_length``. None: the engine picks.
        parent_id: the request whose prompt and output this prompt extends (the previous
            turn, or the agent step it branched from); a closed-loop replayer may hold
            this request until the parent finished.
        controls: what the request's client asks of the cache and tells it (caps and
            hints, ``RequestControls``), set on the planner when the engine receives it;
            None: nothing.
    """

    request_id: str
    arrival_s: float
    prompt: array[int]
    output_length: int
    session_id: str | None = None
    turn: int | None = None
    cache_salt: str | None = None
    output_tokens: array[int] | None = None
    parent_id: str | None = None
    controls: RequestControls | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", as_token_ids(self.prompt))
        if self.output_tokens is not None:
            object.__setattr__(self, "output_tokens", as_token_ids(self.output_tokens))
            if len(self.output_tokens) != self.output_length:
                raise ValueError(f"request {self.request_id}: {len(self.output_tokens)} "
                                 f"output tokens, output_length {self.output_length}")
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.output_length < 1:
            raise ValueError(f"request {self.request_id}: output_length must be >= 1, got "
                             f"{self.output_length}")
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: negative arrival time "
                             f"{self.arrival_s}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def hash_context(self) -> HashContext:
        """What besides tokens enters the request's block hashes (its cache salt)."""
        return HashContext(cache_salt=self.cache_salt)

    def prompt_hashes(self, hasher: BlockHasher) -> list[BlockHash]:
        """The chained hashes of the prompt's full blocks under ``hasher``."""
        return hasher.hashes(self.prompt, self.hash_context)
