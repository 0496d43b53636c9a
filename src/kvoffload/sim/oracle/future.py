"""What a workload's future holds, read off its requests before a replay: the oracle's
knowledge (``kvoffload.sim.oracle.binding``).

``WorkloadFuture`` hashes every request of a workload exactly as the reference engine does
(``keys.BlockHasher`` at the configuration's hash block size, the request's cache salt) and
models each request's hit against an unbounded cache of everything the requests before it
held. Definitions (``t`` in tokens; ``A`` the configuration's hit alignment):

* A request's *known tokens* are its prompt followed by its output when the workload gives
  the output (``WorkloadRequest.output_tokens``); an output the engine derives is known to
  no other prompt, so it is left out.
* The *hit end* ``d(r)`` of request ``r`` is its longest prompt prefix whose last hash
  block some earlier request's known tokens contain (chained hashes: the whole prefix is
  shared), capped at the planner's largest hit (the prompt, minus its last token when a
  window or Mamba group recomputes it) and rounded down to a multiple of ``A``: where a
  lookup of ``r`` would end if nothing had been evicted. Requests are "earlier" and
  "later" in workload order: the order given, which is arrival order (the replay reads
  a workload in order); ``index_of`` numbers them so.
* ``r`` *uses* the keys a load of tokens ``[0, d(r))`` reads (``PrefixLookup.hit_keys``):
  every full-attention block, the last window of a sliding-window group, the state at
  ``d(r)`` of a Mamba group.
* A later request *hits request i's prompt at depth t* when its hit end is ``t`` and its
  prompt shares ``i``'s first ``t`` tokens.

Whether a conversation continues, the truth behind the simulator's client hints, is
``kvoffload.workloads.hints``' (a plain prefix rule that needs no layout).

It is a model: the engine's own prefix cache is an LRU of ``engine_tokens`` worth of hash
blocks touched in workload order (a use it serves is not a tier's); preemptions, the blocks
running requests hold and the order in which a replay admits held requests are not in it.
Every answer is a pure function of the requests given; nothing here reads what a replay
does.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

from kvoffload.config import OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.keys import BlockHash, BlockHasher, OffloadKey, make_offload_key
from kvoffload.workloads.request import TOKEN_TYPECODE, WorkloadRequest


class _EnginePrefixCache:
    """The engine's own prefix cache as the future models it: an LRU of ``blocks`` hash
    blocks, touched by each request's known tokens in workload order (0: none)."""

    def __init__(self, blocks: int) -> None:
        self._blocks = blocks
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()

    def hit(self, chain: Sequence[BlockHash], limit: int) -> int:
        """Hash blocks of ``chain``'s longest prefix held, at most ``limit``."""
        held = 0
        if self._blocks:
            for h in chain[:limit]:
                if h not in self._lru:
                    break
                held += 1
        return held

    def touch(self, chain: Sequence[BlockHash]) -> None:
        if not self._blocks:
            return
        lru = self._lru
        for h in chain:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self._blocks:
            lru.popitem(last=False)


NO_USE = 1 << 62
"""``next_use`` of a key no later request uses."""


class WorkloadFuture:
    """The future of one workload under one offload configuration (module docstring).

    Build it with ``WorkloadFuture.build``; requests are numbered in workload
    order (``index_of``).
    """

    def __init__(self, requests: Sequence[WorkloadRequest], config: OffloadConfig,
                 hash_seed: str = "kvoffload", unstored_tail: int = 0,
                 engine_tokens: int = 0) -> None:
        ids = [r.request_id for r in requests]
        self._index = {rid: i for i, rid in enumerate(ids)}
        if len(self._index) != len(ids):
            raise ValueError("workload request ids must be unique")
        lagged = [g.spec.name or str(g.index) for g in config.resolved if g.key_lag_blocks]
        if lagged:
            raise ConfigError("proof_tokens", f"group(s) {lagged} hold a draft model's layers, "
                              "which the oracle's future does not model",
                              "Run the oracle on a layout without proof_tokens.")
        self.alignment = config.hit_alignment
        recompute_last = config.has_windowed_group
        self._groups = config.resolved
        self._suffixes = [make_offload_key(BlockHash(b""), g.index) for g in self._groups]
        hasher = BlockHasher(config.hash_block_size, seed=hash_seed)
        hbs = self._hbs = config.hash_block_size
        seen: set[BlockHash] = set()
        sure: set[BlockHash] = set()
        engine = _EnginePrefixCache(engine_tokens // hbs)
        self._chains: list[list[BlockHash]] = []
        self._known: list[int] = []
        self._hit_end: list[int] = []
        self._uses: dict[OffloadKey, list[int]] = {}
        self._engine_uses: dict[OffloadKey, list[int]] = {}
        self._depth: dict[OffloadKey, int] = {}
        self._used_by: list[list[OffloadKey]] = []
        self._hit_points: dict[BlockHash, list[int]] = {}
        for r, request in enumerate(requests):
            tokens = request.prompt
            if request.output_tokens is not None:
                tokens = array(TOKEN_TYPECODE, request.prompt)
                tokens.extend(request.output_tokens)
            chain = hasher.hashes(tokens, request.hash_context)
            max_end = len(request.prompt) - (1 if recompute_last else 0)
            ends = sorted({self._shared(chain, max_end, seen),
                           self._shared(chain, max_end, sure)} - {0})
            for end in ends:
                self._hit_points.setdefault(chain[end // hbs - 1], []).append(r)
            served = bool(ends) and ends[-1] <= engine.hit(chain, max_end // hbs) * hbs
            self._used_by.append(self._record_uses(r, chain, ends, served))
            stored = len(tokens) - (unstored_tail if request.output_tokens is not None
                                    else 0)
            seen.update(chain)
            engine.touch(chain)
            sure.update(chain[:max(len(request.prompt), stored) // hbs])
            self._chains.append(chain)
            self._known.append(len(tokens))
            self._hit_end.append(ends[-1] if ends else 0)

    def _record_uses(self, r: int, chain: Sequence[BlockHash], ends: Sequence[int],
                     served: bool) -> list[OffloadKey]:
        """Record the keys request ``r``'s hit reads (ending at any of ``ends``,
        ascending; the engine serves them all when ``served``); return them."""
        used: dict[OffloadKey, None] = {}
        if not ends:
            return []
        uses = self._engine_uses if served else self._uses
        for g, suffix in zip(self._groups, self._suffixes, strict=True):
            obs, hpb = g.offloaded_block_size, g.hashes_per_block
            if g.window_blocks is None:
                blocks: Sequence[int] = range(ends[-1] // obs)
            else:
                blocks = sorted({j for end in ends for j in range(
                    max(0, end // obs - g.window_blocks), end // obs)})
            for j in blocks:
                key = cast("OffloadKey", chain[(j + 1) * hpb - 1] + suffix)
                uses.setdefault(key, []).append(r)
                self._depth[key] = (j + 1) * obs
                used[key] = None
        return list(used)

    def _shared(self, chain: Sequence[BlockHash], max_end: int,
                cached: set[BlockHash]) -> int:
        """Tokens of ``chain``'s longest prefix in ``cached``, at most ``max_end``,
        rounded down to the hit alignment."""
        shared = 0
        for h in chain[:max_end // self._hbs]:
            if h not in cached:
                break
            shared += 1
        return shared * self._hbs // self.alignment * self.alignment

    @classmethod
    def build(cls, requests: Sequence[WorkloadRequest], config: OffloadConfig,
              hash_seed: str = "kvoffload", unstored_tail: int = 0,
              engine_tokens: int = 0) -> WorkloadFuture:
        """The future of ``requests`` under ``config``;
        ``unstored_tail``: output tokens at the end of a request that are never stored
        (the engine computes no KV for its last decode step's tokens); ``engine_tokens``:
        the engine's own prefix cache, modelled (``engine_uses``; 0: not modelled)."""
        return cls(requests, config, hash_seed, unstored_tail, engine_tokens)

    def __len__(self) -> int:
        return len(self._hit_end)

    def index_of(self, request_id: str) -> int:
        """The request's position in the workload; ``KeyError`` if it is not in it."""
        return self._index[request_id]

    def hit_end(self, r: int) -> int:
        """``d(r)``: tokens of request ``r``'s prompt a lookup would hit, nothing evicted."""
        return self._hit_end[r]

    def keys_used_by(self, r: int) -> Sequence[OffloadKey]:
        """The keys request ``r``'s hit reads (module docstring), in group then block
        order."""
        return self._used_by[r]

    def uses(self, key: OffloadKey) -> Sequence[int]:
        """The requests that read ``key`` from a tier, ascending (empty if none)."""
        return self._uses.get(key, ())

    def engine_uses(self, key: OffloadKey) -> Sequence[int]:
        """The requests whose hit reads ``key`` from the engine's own prefix cache, as
        modelled (ascending; empty if none): not in ``uses``."""
        return self._engine_uses.get(key, ())

    def depth(self, key: OffloadKey) -> int:
        """Tokens of the prefix that ends with ``key``'s block (0 for a key no request
        uses)."""
        return self._depth.get(key, 0)

    def next_use(self, key: OffloadKey, after: int) -> int:
        """The first request after request ``after`` (workload order) that uses ``key``;
        ``NO_USE`` if none does."""
        uses = self._uses.get(key)
        if not uses:
            return NO_USE
        at = bisect_right(uses, after)
        return uses[at] if at < len(uses) else NO_USE

    def hits_later(self, i: int, t: int) -> bool:
        """Whether a request after ``i`` hits ``i``'s prompt at depth ``t`` tokens (its hit
        end is ``t`` and it shares ``i``'s first ``t`` tokens)."""
        if t <= 0 or t % self._hbs or t // self._hbs > len(self._chains[i]):
            return False
        later = self._hit_points.get(self._chains[i][t // self._hbs - 1], ())
        return bisect_right(later, i) < len(later)

    def reach(self, i: int) -> int:
        """The deepest point (tokens) of request ``i``'s known tokens at which a later
        request's hit ends; 0 if none."""
        chain = self._chains[i]
        step = self.alignment // self._hbs
        for k in range(len(chain) // step, 0, -1):
            later = self._hit_points.get(chain[k * step - 1], ())
            if later and bisect_right(later, i) < len(later):
                return k * self.alignment
        return 0
