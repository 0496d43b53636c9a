"""Which engine block positions a load writes and a store reads, per group.

Pure functions of a group, a request's block table and the hit alignment; the planner
calls them when it plans a job. The rules (``docs/architecture.md``, rule 5):

* a load of tokens ``[local, end)`` writes every missing block of a full-attention group,
  the blocks of a window group that cover its last ``W`` tokens before ``end``, and the
  one state of a Mamba group at ``end``;
* a store writes an offloaded block only when some aligned hit can use it
  (``useful_blocks``), from live (not null, not freed) engine blocks; a Mamba block only
  when a step of the request ended at its last token (its state is that of the boundary).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.config import ResolvedGroup
from kvoffload.errors import InvariantError
from kvoffload.jobs import NULL_BLOCK_ID, GroupTransfer
from kvoffload.keys import OffloadKey
from kvoffload.planner.state import GroupState, PlannedLoad


def load_positions(g: ResolvedGroup, ids: Sequence[int], planned: PlannedLoad) -> list[int]:
    """Engine block positions of group ``g`` the hit needs that the engine lacks.

    Raises ``InvariantError`` when the engine's table ``ids`` lacks a block the load must
    write (too short, or a null where full attention or a Mamba state needs one).
    """
    bs = g.spec.block_size
    end_pos = planned.end // bs
    rules = g.rules
    first = rules.load_start(g.spec, planned.num_local_tokens // bs, planned.end)
    if len(ids) < end_pos:
        raise InvariantError(f"group {g.index}: block table has {len(ids)} blocks, the "
                             f"load needs {end_pos}")
    positions = [p for p in range(first, end_pos) if ids[p] != NULL_BLOCK_ID]
    if rules.loads_every_position and len(positions) != end_pos - first:
        raise InvariantError(f"group {g.index} ({g.kind.value}): null block where the "
                             "load must write; allocate a block for every needed position")
    if positions and positions[-1] - positions[0] + 1 != len(positions):
        raise InvariantError(f"group {g.index}: null blocks inside the loaded range")
    return positions


def useful_blocks(g: ResolvedGroup, alignment: int, start: int, stop: int) -> Sequence[int]:
    """Blocks in ``[start, stop)`` of window or Mamba group ``g`` that some hit aligned to
    ``alignment`` tokens can use: with hits every ``step`` blocks and a window of ``W``,
    block ``k`` serves one iff ``k % step >= step - W``. No other block of the group is
    ever stored."""
    assert g.window_blocks is not None
    step = alignment // g.offloaded_block_size
    width = min(g.window_blocks, step)
    if width == step:
        return range(start, stop)
    if width == 1:
        return range(start + (step - 1 - start % step), stop, step)
    return [k for seg in range(start - start % step, stop, step)
            for k in range(max(start, seg + step - width), min(seg + step, stop))]


def store_positions(g: ResolvedGroup, gs: GroupState, k: int, alignment: int,
                    state_ends: set[int] | None) -> list[int] | None:
    """Engine positions to store for offloaded block ``k``, or None to skip it.

    Window and Mamba blocks come from ``useful_blocks`` (so a Mamba block ends at a hit
    alignment point, and some aligned hit's window uses a window block). Skipped: blocks
    that are null or freed, Mamba states that no step of the request produced (when
    ``state_ends`` is given, i.e. ``mamba_states_every_block`` is off: a step ending
    mid-block leaves the block holding another state), and partial window blocks whose
    missing part a hit's window would need. A null or freed full-attention block raises
    ``InvariantError`` (the engine freed what a hit needs).
    """
    f = g.factor
    lo, hi = k * f, (k + 1) * f
    ids = gs.block_ids
    obs = g.offloaded_block_size
    if g.rules.holds_state:
        last = hi - 1  # the state after the block's last token
        if (last < gs.num_freed or ids[last] == NULL_BLOCK_ID
                or (state_ends is not None and (k + 1) * obs not in state_ends)):
            return None
        return [last]
    live = [p for p in range(max(lo, gs.num_freed), hi) if ids[p] != NULL_BLOCK_ID]
    if g.window_blocks is None:
        if len(live) != f:
            raise InvariantError(f"group {g.index} (full attention): null or freed block "
                                 f"at offloaded block {k}")
        return live
    if not live:
        return None
    assert g.spec.sliding_window is not None
    step = alignment // obs
    first_hit_block = (k // step + 1) * step
    if live[0] > lo and (first_hit_block * obs - g.spec.sliding_window
                         < live[0] * g.spec.block_size):
        return None
    return live


def group_store_transfers(g: ResolvedGroup, gs: GroupState,
                          chosen: list[tuple[int, list[int]]],
                          slot_of: dict[OffloadKey, int]) -> list[GroupTransfer]:
    """Transfers for the chosen offloaded blocks ``(block, positions)`` of one group.

    One transfer per run of adjacent blocks, so ``first_block_index + i`` names the
    position of each block (blocks already in the tier split a run). Only the first
    block of a run may be partial (nulls are a prefix). A Mamba group stores only the
    last state of each block, one transfer per block.
    """
    ids = gs.block_ids
    if g.rules.holds_state:
        return [GroupTransfer(g.index, (ids[p[0]],), p[0], (slot_of[gs.keys[k]],))
                for k, p in chosen]
    runs: list[list[tuple[int, list[int]]]] = []
    for k, positions in chosen:
        if runs and runs[-1][-1][0] == k - 1:
            if len(positions) != g.factor:
                raise InvariantError(f"group {g.index}: a partial block inside a run")
            runs[-1].append((k, positions))
        else:
            runs.append([(k, positions)])
    return [GroupTransfer(
        g.index,
        tuple(ids[p] for _, positions in run for p in positions),
        run[0][1][0],
        tuple(slot_of[gs.keys[k]] for k, _ in run),
    ) for run in runs]


def load_transfers(groups: Sequence[ResolvedGroup], states: Sequence[GroupState],
                   tables: Sequence[Sequence[int]], planned: PlannedLoad
                   ) -> tuple[list[OffloadKey], list[tuple[GroupTransfer, int]]]:
    """What a planned load reads and writes: the keys in read order, and per group that
    writes something its transfer (slots not yet filled) with how many of the keys it
    reads. ``tables`` are the request's engine block tables, one per group."""
    keys: list[OffloadKey] = []
    parts: list[tuple[GroupTransfer, int]] = []
    for g, gs, table in zip(groups, states, tables, strict=True):
        positions = load_positions(g, table, planned)
        if not positions:
            continue
        f = g.factor
        group_keys = gs.keys[positions[0] // f:positions[-1] // f + 1]
        keys.extend(group_keys)
        parts.append((GroupTransfer(g.index, tuple(table[p] for p in positions),
                                    positions[0], ()), len(group_keys)))
    return keys, parts


def with_slots(parts: Sequence[tuple[GroupTransfer, int]], slots: Sequence[int]
               ) -> tuple[GroupTransfer, ...]:
    """The transfers of ``load_transfers`` with the tier's slots of their keys, in order."""
    filled: list[GroupTransfer] = []
    cursor = 0
    for t, count in parts:
        filled.append(GroupTransfer(t.group, t.block_ids, t.first_block_index,
                                    tuple(slots[cursor:cursor + count])))
        cursor += count
    return tuple(filled)
