"""What vLLM's model runner does with Mamba state blocks in the ``align`` cache mode.

Read from vLLM (0.32 and 0.33 alike): ``v1/worker/mamba_utils.preprocess_mamba``,
``model_executor/layers/mamba/checkpoint.compute_mamba_prefill_checkpoints`` and the
Mamba2 mixer. For one request in one step that computes tokens ``[start, end)`` of a
Mamba group with block size ``B``:

1. **Before the forward** (``preprocess_mamba``): the running state lives in block column
   ``cdiv(end, B) - 1``. If the state the step starts from sits in another column (the
   column of the request's previous step, or ``(start - 1) // B`` for a request that is
   new or back from preemption, i.e. the block a prefix hit or a load filled), it is
   copied there first.
2. **The forward** reads the state after ``start`` tokens from that running block (a
   first chunk, ``start == 0``, reads nothing) and writes the state after ``end`` tokens
   into it.
3. **In-chunk checkpoint** (Mamba2, whose spec has ``num_prefill_checkpoint_blocks=1``):
   when ``compute_mamba_prefill_checkpoints`` finds one for the row, the state after
   ``checkpoint`` tokens (the last alignment boundary before the chunk's last token) is
   also written into column ``cdiv(end, B) - 2``, from inside the same forward pass. The
   scheduler then does not split the prompt's last chunk at that boundary. Mamba1 has no
   such checkpoint: the scheduler ends chunks on block boundaries instead.

A state here is a value that depends only on the tokens before it and on the layer
(``state_tensors``): the first element is the token count, the second a digest of the
tokens. A load that brings the state of another prefix, another position or another
layer, or a copy that lands late, fails the check with the request, group and column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

CONV_SHAPE = (2, 3)
"""Floats of one layer's conv state per block (vLLM's Mamba2 keeps a conv and an SSM state)."""
SSM_SHAPE = (5,)
"""Floats of one layer's SSM state per block."""
_DIGEST_MOD = 16_777_213  # a prime below 2**24: every digest is exact in float32


def mamba_spec(block_size: int, kind: str) -> Any:
    """vLLM's ``MambaSpec`` in ``align`` mode: ``"mamba2"`` checkpoints inside a chunk
    (as vLLM's Mamba2 mixer declares), ``"mamba1"`` does not."""
    from vllm.v1.kv_cache_interface import MambaSpec

    checkpoints = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1} \
        if kind == "mamba2" else {}
    return MambaSpec(block_size=block_size, shapes=(CONV_SHAPE, SSM_SHAPE),
                     dtypes=(torch.float32, torch.float32), mamba_cache_mode="align",
                     **checkpoints)


def mamba_tensors(num_blocks: int) -> list[torch.Tensor]:
    """One layer's (conv, SSM) state tensors, blocks first, filled with -1."""
    return [torch.full((num_blocks, *CONV_SHAPE), -1.0),
            torch.full((num_blocks, *SSM_SHAPE), -1.0)]


def prefix_digests(tokens: Sequence[int]) -> list[int]:
    """``out[n]``: a digest of ``tokens[:n]``, for every n up to ``len(tokens)``."""
    out = [0]
    d = 0
    for t in tokens:
        d = _next_digest(d, t)
        out.append(d)
    return out


def _next_digest(digest: int, token: int) -> int:
    return (digest * 1_000_003 + token + 1) % _DIGEST_MOD


def state_tensors(digest: int, n: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (conv, SSM) state of ``layer`` after ``n`` tokens whose digest is ``digest``."""
    conv = torch.empty(CONV_SHAPE)
    conv.view(-1)[:] = torch.tensor([float(n), float(digest), float(layer), 0.0,
                                     float((digest * 7 + n) % 997), float(n % 13)])
    ssm = torch.tensor([float(n), float(digest), float(layer), 1.0,
                        float((digest * 11 + layer) % 991)])
    return conv, ssm


@dataclass
class MambaGroup:
    """One Mamba KV-cache group of the engine: its index, layers and spec."""

    index: int
    layers: list[str]
    spec: Any


@dataclass
class MambaRunner:
    """The model runner's Mamba handling (module docstring) over the caches of ``groups``."""

    groups: list[MambaGroup]
    caches: dict[str, list[torch.Tensor]]
    hash_block_size: int
    state_column: dict[str, int] = field(default_factory=dict)
    """Per request, the column its last step left the running state in (vLLM's
    ``mamba_state_idx``)."""
    checked_states: int = 0
    checkpoints_written: int = 0
    """In-chunk checkpoint states written into a real (non-null) block."""
    _digests: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    """Per request, tokens seen and their prefix digests (extended, never recomputed)."""

    def digests(self, rid: str, tokens: Sequence[int], end: int) -> list[int]:
        """``prefix_digests(tokens[:end])``, extending what was computed for ``rid``."""
        seen, digests = self._digests.get(rid, ([], [0]))
        if len(seen) > end or list(tokens[:len(seen)]) != seen:
            seen, digests = [], [0]
        d = digests[-1]
        for t in tokens[len(seen):end]:
            d = _next_digest(d, t)
            digests.append(d)
        seen.extend(tokens[len(seen):end])
        self._digests[rid] = (seen, digests)
        return digests

    def begin_step(self, so: Any) -> None:
        """Forget the running columns of requests finished, preempted, new or resumed
        (``cleanup_mamba_state_idx``; a new request may reuse a finished one's id)."""
        for rid in (*so.finished_req_ids, *(so.preempted_req_ids or ()),
                    *getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()),  # 0.32, 0.33
                    *(new.req_id for new in so.scheduled_new_reqs)):
            self.state_column.pop(rid, None)

    def copy_states(self, rid: str, tables: Sequence[Sequence[int]], start: int,
                    end: int) -> None:
        """Point 1 of the module docstring alone, for every Mamba group: copy the state the
        step starts from into its running column. ``run`` does it unless told the runner
        did it already (vLLM's V2 runner copies before the connector's
        ``handle_preemptions``, the V1 runner after)."""
        for group in self.groups:
            table = tables[group.index]
            bs = group.spec.block_size
            prev = self.state_column.get(rid, (start - 1) // bs)
            curr = -(-end // bs) - 1
            if prev not in (-1, curr):
                self._copy(group, table[prev], table[curr])

    def run(self, rid: str, tokens: Sequence[int], tables: Sequence[Sequence[int]],
            start: int, end: int, *, copied: bool = False) -> None:
        """One request's step over every Mamba group: copy (unless ``copied``), check,
        write, checkpoint."""
        if not copied:
            self.copy_states(rid, tables, start, end)
        digests = self.digests(rid, tokens, end)
        for group in self.groups:
            table = tables[group.index]
            bs = group.spec.block_size
            curr = -(-end // bs) - 1
            if start > 0:
                self._check(rid, group, table[curr], digests[start], start)
            self._write(group, table[curr], digests[end], end)
            checkpoint = self._checkpoint(group, start, end)
            if checkpoint is not None:
                position, column = checkpoint
                self._write(group, table[column], digests[position], position)
                if table[column] != 0:
                    self.checkpoints_written += 1
        self.state_column[rid] = -(-end // self.groups[0].spec.block_size) - 1

    def expected_pages(self, group: int, position: int, tokens: Sequence[int],
                       ) -> list[torch.Tensor]:
        """The state pages block ``position`` of Mamba group ``group`` holds once it holds
        its boundary state, per layer (conv, SSM): what a store of it must copy."""
        mamba = next(g for g in self.groups if g.index == group)
        n = (position + 1) * mamba.spec.block_size
        digest = prefix_digests(tokens[:n])[n]
        return [t for li in range(len(mamba.layers)) for t in state_tensors(digest, n, li)]

    def _checkpoint(self, group: MambaGroup, start: int, end: int) -> tuple[int, int] | None:
        """(tokens, column) of the in-chunk checkpoint vLLM's Mamba2 writes, if any."""
        from vllm.model_executor.layers.mamba.checkpoint import (
            compute_mamba_prefill_checkpoints,
        )

        if end - start <= 1:
            return None  # a decode row: vLLM's checkpoint builder sees prefill rows only
        offsets, cols = compute_mamba_prefill_checkpoints(
            [end], [end - start], hash_block_size=self.hash_block_size,
            mamba_block_size=group.spec.block_size,
            checkpoint_alignment=group.spec.prefill_checkpoint_alignment,
            drop_eagle_block=False, cache_hit_alignment_tokens=self.hash_block_size)
        if not offsets[0]:
            return None
        return start + offsets[0], cols[0]

    def _copy(self, group: MambaGroup, src: int, dst: int) -> None:
        for name in group.layers:
            for tensor in self.caches[name]:
                tensor[dst] = tensor[src]

    def _check(self, rid: str, group: MambaGroup, block: int, digest: int, n: int) -> None:
        for layer_index, name in enumerate(group.layers):
            for got, want in zip(self.caches[name], state_tensors(digest, n, layer_index),
                                 strict=True):
                if not torch.equal(got[block], want):
                    raise AssertionError(
                        f"request {rid}: Mamba group {group.index} layer {name}: the "
                        f"running block {block} holds the state "
                        f"{got[block].view(-1)[:3].tolist()}, expected the one after "
                        f"{n} tokens {want.view(-1)[:3].tolist()}")
        self.checked_states += 1

    def _write(self, group: MambaGroup, block: int, digest: int, n: int) -> None:
        for layer_index, name in enumerate(group.layers):
            for tensor, value in zip(self.caches[name], state_tensors(digest, n, layer_index),
                                     strict=True):
                tensor[block] = value
