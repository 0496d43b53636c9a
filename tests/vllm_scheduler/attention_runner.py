"""The scripted forward pass over the attention groups of ``kit``'s engines.

For every token it computes, the forward pass writes a value that depends only on the
token, its position and the layer (``kv_values``); before that it checks every cached
position the step's attention reads (all earlier tokens for full attention, the last
``window`` for a sliding window) against the same function. Any load of wrong or stale
bytes, or a late copy landing on blocks a forward pass already wrote, fails the check
with the request, the layer and the position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

BLOCK = 16
HEAD = 8  # K|V per token: 2 * HEAD floats
WINDOW = 48

Groups = Sequence[tuple[list[str], int | None]]
"""Per group, its attention layers (none for a Mamba group) and window (None: full)."""


def kv_values(tokens: list[int], positions: range, layer: int) -> torch.Tensor:
    """What the forward pass writes at ``positions`` of a request of ``tokens`` in
    ``layer``, one row per position: the token, the position, the layer, then a mix of
    the three (exact in float32: every field stays below 2**24)."""
    token = torch.tensor(tokens[positions.start:positions.stop], dtype=torch.int64)
    position = torch.arange(positions.start, positions.stop, dtype=torch.int64)
    out = torch.empty((len(positions), 2 * HEAD), dtype=torch.float32)
    out[:, 0], out[:, 1], out[:, 2] = token, position, float(layer)
    out[:, 3:] = ((token * 31 + position * 7 + layer) % 997).unsqueeze(1)
    return out


def expected_pages(layers: list[str], position: int, tokens: list[int]) -> list[torch.Tensor]:
    """The pages the forward pass wrote in engine block ``position`` of a group of
    ``layers``, one per layer (vLLM's CPU layout ``(heads, block_size, 2 * head_size)``)."""
    span = range(position * BLOCK, (position + 1) * BLOCK)
    return [kv_values(tokens, span, li).unsqueeze(0) for li in range(len(layers))]


def positions_read(window: int | None, start: int) -> range:
    """Cached positions the step's first token attends to in a group."""
    return range(0 if window is None else max(0, start - window + 1), start)


def check(caches: dict[str, Any], groups: Groups, rid: str, tokens: list[int],
          tables: Any, *, start: int) -> int:
    """Check what a step of ``rid`` starting at ``start`` reads; the positions checked."""
    checked = 0
    for (layers, window), table in zip(groups, tables, strict=True):
        read = positions_read(window, start)
        if not layers or not read:
            continue  # a Mamba group (``mamba_runner``), or nothing cached yet
        blocks, offsets = _slots(table, read)
        for layer_index, name in enumerate(layers):
            got = caches[name][blocks, 0, offsets]
            want = kv_values(tokens, read, layer_index)
            if not torch.equal(got, want):
                i = int((got != want).any(dim=1).nonzero()[0])
                raise AssertionError(
                    f"request {rid}: layer {name} position {read[i]} (block "
                    f"{int(blocks[i])}) holds {got[i, :3].tolist()}, expected "
                    f"{want[i, :3].tolist()}")
        checked += len(read)
    return checked


def write(caches: dict[str, Any], groups: Groups, tokens: list[int], tables: Any, *,
          start: int, end: int) -> None:
    """Write what a step computing tokens ``[start, end)`` writes."""
    span = range(start, end)
    for (layers, _), table in zip(groups, tables, strict=True):
        if not layers:
            continue
        blocks, offsets = _slots(table, span)
        for layer_index, name in enumerate(layers):
            caches[name][blocks, 0, offsets] = kv_values(tokens, span, layer_index)


def _slots(table: Any, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine block, offset in it) of every position of a request's block table."""
    blocks = torch.tensor([table[p // BLOCK] for p in positions], dtype=torch.int64)
    offsets = torch.tensor([p % BLOCK for p in positions], dtype=torch.int64)
    return blocks, offsets
