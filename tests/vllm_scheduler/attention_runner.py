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
from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 16
HEAD = 8  # K|V per token: 2 * HEAD floats
WINDOW = 48

Groups = Sequence[tuple[list[str], int | None]]
"""Per group, its attention layers (none for a Mamba group) and window (None: full)."""


@dataclass(frozen=True)
class Drafts:
    """A speculative drafter's layers (module docstring).

    Attributes:
        names: the drafter's layer names (in draft groups, or merged into a target group).
        proof: ``num_speculative_tokens + 1``: how many of a request's last computed
            positions are provisional.
    """

    names: frozenset[str]
    proof: int


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


def draft_values(tokens: list[int], positions: range, layer: int, *, final: bool,
                 ) -> torch.Tensor:
    """What a drafter's layer holds at ``positions``: once final, the token, the position,
    the layer, the next token (``tokens`` must reach one past ``positions``), then a mix
    of the four; while provisional, -1 instead of the next token and another mix."""
    token = torch.tensor(tokens[positions.start:positions.stop], dtype=torch.int64)
    position = torch.arange(positions.start, positions.stop, dtype=torch.int64)
    out = torch.empty((len(positions), 2 * HEAD), dtype=torch.float32)
    out[:, 0], out[:, 1], out[:, 2] = token, position, float(layer)
    if final:
        assert positions.stop < len(tokens), "a final draft value needs the next token"
        nxt = torch.tensor(tokens[positions.start + 1:positions.stop + 1], dtype=torch.int64)
        out[:, 3] = nxt
        out[:, 4:] = ((token * 31 + position * 7 + layer + nxt * 13) % 997 + 1000
                      ).unsqueeze(1)
    else:
        out[:, 3] = -1.0
        out[:, 4:] = ((token * 31 + position * 7 + layer) % 997 + 3000).unsqueeze(1)
    return out


def expected_pages(layers: list[str], position: int, tokens: list[int],
                   drafts: Drafts | None = None) -> list[torch.Tensor]:
    """The pages the forward pass wrote in engine block ``position`` of a group of
    ``layers``, one per layer (vLLM's CPU layout ``(heads, block_size, 2 * head_size)``);
    a drafter's layer holds its final values there (NaN, which nothing equals, where
    ``tokens`` does not reach the token after the block: such a block is still volatile)."""
    span = range(position * BLOCK, (position + 1) * BLOCK)
    pages = []
    for li, name in enumerate(layers):
        if drafts is None or name not in drafts.names:
            pages.append(kv_values(tokens, span, li).unsqueeze(0))
        elif span.stop < len(tokens):
            pages.append(draft_values(tokens, span, li, final=True).unsqueeze(0))
        else:
            pages.append(torch.full((1, BLOCK, 2 * HEAD), float("nan")))
    return pages


def positions_read(window: int | None, start: int) -> range:
    """Cached positions the step's first token attends to in a group."""
    return range(0 if window is None else max(0, start - window + 1), start)


def check(caches: dict[str, Any], groups: Groups, rid: str, tokens: list[int],
          tables: Any, *, start: int, drafts: Drafts | None = None) -> int:
    """Check what a step of ``rid`` starting at ``start`` reads; the positions checked.
    ``tokens`` are the request's own, at least one past ``start``."""
    checked = 0
    for (layers, window), table in zip(groups, tables, strict=True):
        read = positions_read(window, start)
        if not layers or not read:
            continue  # a Mamba group (``mamba_runner``), or nothing cached yet
        blocks, offsets = _slots(table, read)
        for layer_index, name in enumerate(layers):
            got = caches[name][blocks, 0, offsets]
            if drafts is not None and name in drafts.names:
                _check_draft(got, tokens, read, layer=layer_index, proof=drafts.proof,
                             where=(rid, name, blocks))
                continue
            want = kv_values(tokens, read, layer_index)
            if not torch.equal(got, want):
                i = int((got != want).any(dim=1).nonzero()[0])
                raise AssertionError(
                    f"request {rid}: layer {name} position {read[i]} (block "
                    f"{int(blocks[i])}) holds {got[i, :3].tolist()}, expected "
                    f"{want[i, :3].tolist()}")
        checked += len(read)
    return checked


def _check_draft(got: torch.Tensor, tokens: list[int], read: range, *, layer: int,
                 proof: int, where: tuple[str, str, torch.Tensor]) -> None:
    """A drafter's layer: final values of the request's own tokens, or provisional ones in
    the last ``proof`` positions before the step (the request's volatile tail). ``where``:
    the request, the layer's name and the engine block of each position read."""
    rid, name, blocks = where
    final = draft_values(tokens, read, layer, final=True)
    ok = (got == final).all(dim=1)
    tail = max(read.start, read.stop - proof)
    if tail < read.stop:
        span = range(tail, read.stop)
        provisional = draft_values(tokens, span, layer, final=False)
        ok[tail - read.start:] |= (got[tail - read.start:] == provisional).all(dim=1)
    if bool(ok.all()):
        return
    i = int((~ok).nonzero()[0])
    row = got[i].tolist()
    what = ("a provisional value" if row[3] == -1.0 else
            f"the final value for next token {int(row[3])}" if row[:3] == final[i, :3].tolist()
            else f"{row[:4]}")
    raise AssertionError(
        f"request {rid}: draft layer {name} position {read[i]} (block {int(blocks[i])}) "
        f"holds {what}, expected the final value for next token {int(final[i, 3])}")


def write(caches: dict[str, Any], groups: Groups, tokens: list[int], tables: Any, *,
          start: int, end: int, drafts: Drafts | None = None) -> None:
    """Write what a step computing tokens ``[start, end)`` writes (a drafter's layers
    aside: ``write_drafts``)."""
    span = range(start, end)
    for (layers, _), table in zip(groups, tables, strict=True):
        if not layers:
            continue
        blocks, offsets = _slots(table, span)
        for layer_index, name in enumerate(layers):
            if drafts is None or name not in drafts.names:
                caches[name][blocks, 0, offsets] = kv_values(tokens, span, layer_index)


def write_drafts(caches: dict[str, Any], groups: Groups, drafts: Drafts, tables: Any, *,
                 step_tokens: list[int], verified: list[int], start: int, end: int,
                 computed: int) -> None:
    """What the drafter writes in a step that computed ``[start, end)`` (speculated tokens
    included) and left ``computed`` positions verified: final values from ``proof``
    positions before the step up to ``proof`` before ``computed`` (the earlier ones stay
    as they are: final already, or a load's), provisional ones from there, or from
    ``start``, to ``end`` (a rejected token's included: a later step rewrites it). Never
    before ``start`` anything but final values of the request's own tokens: a block
    shared with another request holds the same there."""
    proof = drafts.proof
    final_span = range(max(0, start - proof), max(0, computed - proof))
    volatile = range(max(start, computed - proof), end)
    for (layers, _), table in zip(groups, tables, strict=True):
        for layer_index, name in enumerate(layers):
            if name not in drafts.names:
                continue
            for span, final, tokens in ((final_span, True, verified),
                                        (volatile, False, step_tokens)):
                if len(span):
                    blocks, offsets = _slots(table, span)
                    caches[name][blocks, 0, offsets] = draft_values(tokens, span, layer_index,
                                                                    final=final)


def _slots(table: Any, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine block, offset in it) of every position of a request's block table."""
    blocks = torch.tensor([table[p // BLOCK] for p in positions], dtype=torch.int64)
    offsets = torch.tensor([p % BLOCK for p in positions], dtype=torch.int64)
    return blocks, offsets
