"""Where vLLM's ``align`` cache mode leaves Mamba states beyond a step's end.

A Mamba block holds the state after its last token only where the model runner wrote
that state. The planner assumes a step's end (``RequestState.state_ends``); vLLM's Mamba2
also writes the state at the prompt's last block boundary from *inside* the prompt's
last chunk (an in-chunk prefill checkpoint, ``num_prefill_checkpoint_blocks``), and its
scheduler then leaves the prompt in one chunk, so no step ends there. Without being told,
the connector would never store that state, and a repeated prompt would get no hit.

vLLM names every such state exactly: each step's ``SchedulerOutput.kv_connector_block_state
.boundary_state_offloads`` maps a request to ``(group, block id, tokens)`` for the Mamba
blocks this step's forward leaves holding the state after ``tokens`` tokens.
``checkpointed_state_ends`` turns that into ``ScheduledRequest.state_ends``: the token
counts at which *every* Mamba group's block ending there (position ``tokens // block_size
- 1`` of vLLM's current block table) is the block vLLM named. A state vLLM placed
elsewhere (a copy-on-write block of a sub-block hit) is left out, so the planner never
stores a block that does not hold the boundary state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def checkpointed_state_ends(scheduler_output: Any, mamba_groups: Sequence[tuple[int, int]],
                            block_tables: Mapping[int, Any]) -> dict[str, tuple[int, ...]]:
    """Per request, the token counts vLLM checkpointed a state at this step (module doc).

    Args:
        scheduler_output: vLLM's ``SchedulerOutput`` of the step.
        mamba_groups: ``(group index, block size)`` of every Mamba group.
        block_tables: per group index, vLLM's ``req_to_blocks`` (request id to its
            current blocks).
    """
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    offloads = getattr(state, "boundary_state_offloads", None)
    if not offloads or not mamba_groups:
        return {}
    sizes = dict(mamba_groups)
    out: dict[str, tuple[int, ...]] = {}
    for rid, entries in offloads.items():
        per_group: dict[int, set[int]] = {g: set() for g in sizes}
        for group, block_id, tokens in entries:
            size = sizes.get(group)
            if size is None or tokens <= 0 or tokens % size:
                continue
            blocks = block_tables[group].get(rid)
            position = tokens // size - 1
            if blocks and position < len(blocks) and blocks[position].block_id == block_id:
                per_group[group].add(tokens)
        ends = set.intersection(*per_group.values())
        if ends:
            out[rid] = tuple(sorted(ends))
    return out
