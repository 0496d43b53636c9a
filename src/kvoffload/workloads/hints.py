"""Client hints drawn from a workload's own future, for the simulator (``--hint-accuracy``).

A client often knows whether a conversation goes on (``RequestControls.continues``). A
replayed workload knows it exactly: this module computes that truth and hands it to each
request with a chosen accuracy, so that a run shows what such hints are worth.

Definitions, at ``block_tokens`` tokens per block (the engine's hit granularity is coarser,
so "at the end" means within one block of it):

* A request's *end* is the chained hash of its prompt's last full block (prompts shorter
  than one block have none: they never continue).
* A request *continues* when a later request (in workload order) has that hash among its
  own prompt's block hashes: the later prompt starts with this whole prompt (up to its last
  full block), so it hits at this prompt's end or beyond it (at the end of this turn's
  output, when it repeats it). This is what ``continues=True`` keeps: the windows and
  states at the prompt's end and the turn's end.

``with_hints`` gives every request ``continues`` = that truth, flipped with probability
``1 - accuracy`` by a ``random.Random(seed)`` drawn once per request in workload order, and
its ``session_id`` when the workload has one. Only requests inside the given sequence count
as a future: the last ones of a slice continue less.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import replace

from kvoffload.keys import BlockHash, BlockHasher
from kvoffload.planner.contract import NO_CONTROLS
from kvoffload.workloads.request import WorkloadRequest

HINT_BLOCK_TOKENS = 16
"""The block size at which ``continuations`` compares prompts by default."""


def continuations(requests: Sequence[WorkloadRequest],
                  block_tokens: int = HINT_BLOCK_TOKENS) -> list[bool]:
    """For each request, whether a later one continues it (module docstring)."""
    hasher = BlockHasher(block_tokens)
    later: set[BlockHash] = set()
    continued = [False] * len(requests)
    for index in range(len(requests) - 1, -1, -1):
        hashes = requests[index].prompt_hashes(hasher)
        if hashes:
            continued[index] = hashes[-1] in later
            later.update(hashes)
    return continued


def with_hints(requests: Iterable[WorkloadRequest], accuracy: float, seed: int = 0,
               block_tokens: int = HINT_BLOCK_TOKENS) -> list[WorkloadRequest]:
    """``requests`` with client hints in their ``controls`` (module docstring); controls a
    request already has (caps) are kept. ``accuracy`` is in ``[0, 1]``."""
    if not isinstance(accuracy, (int, float)) or isinstance(accuracy, bool) or \
            not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy must be a number in [0, 1], got {accuracy!r}")
    listed = list(requests)
    rng = random.Random(seed)
    hinted = []
    for request, truth in zip(listed, continuations(listed, block_tokens), strict=True):
        told = truth if rng.random() < accuracy else not truth
        session = request.session_id or None
        controls = replace(request.controls or NO_CONTROLS, continues=told,
                           session_id=session)
        hinted.append(replace(request, controls=controls))
    return hinted
