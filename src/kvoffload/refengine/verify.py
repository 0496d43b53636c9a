"""Bytes mode's checks: what the forward pass writes, and every comparison against it.

``ByteChecks`` owns the engine's ``DeviceCaches`` (and, with the real worker, a
``HostAuditor``) and knows where each request's blocks sit:

* ``forward`` writes the contents of every block a step fills (``refengine.device``);
* ``check_hit`` compares the blocks the engine's own prefix cache hands a request;
* ``check_load`` compares the blocks a load wrote (the engine discards the load on any
  difference and recomputes);
* ``expect_stores`` and ``audit`` check the host arena: every block the tier can serve
  must hold what its store was to copy.

Counts go to the engine's ``EngineMetrics`` (``wrong_*_bytes``, ``verified_*``,
``audited_host_blocks``, ``misplaced_store_blocks``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvoffload.config import GroupSpec
from kvoffload.group_kinds import KIND_RULES
from kvoffload.jobs import NULL_BLOCK_ID, TierJob, TierOp, TransferJob
from kvoffload.keys import key_group
from kvoffload.refengine.block_pool import CacheHit, HybridBlockPool
from kvoffload.refengine.device import DeviceCaches, HostAuditor, full_block_seed
from kvoffload.refengine.metrics import EngineMetrics
from kvoffload.refengine.requests import EngineRequest
from kvoffload.tiers.host import HostTier

Work = tuple[EngineRequest, int, int]
"""A scheduled request with the first token and the number of tokens the step computes."""


class ByteChecks:
    """See the module docstring."""

    def __init__(self, device: DeviceCaches, auditor: HostAuditor | None, *,
                 pool: HybridBlockPool, specs: Sequence[GroupSpec], hash_block_size: int,
                 factor: int, metrics: EngineMetrics) -> None:
        self.device = device
        self.auditor = auditor
        self.pool = pool
        self.specs = tuple(specs)
        self.factor = factor
        self.metrics = metrics
        self._hpb = [g.block_size // hash_block_size for g in self.specs]

    def _seed(self, req: EngineRequest, group: int, pos: int) -> int:
        return full_block_seed(req.block_hashes[(pos + 1) * self._hpb[group] - 1])

    # ------------------------------------------------------------------ writing

    def forward(self, work: Sequence[Work]) -> None:
        """Write the contents of every block the step fills: attention blocks that become
        full, and a Mamba state when the step ends on a block boundary."""
        writes: list[tuple[list[int], list[int], list[int]]] = [([], [], [])
                                                                for _ in self.specs]
        for req, start, count in work:
            end = start + count
            tables = self.pool.block_table(req.request_id)
            for g, spec in enumerate(self.specs):
                bs = spec.block_size
                full_end = end // bs  # positions below this are full
                first = start // bs
                if KIND_RULES[spec.kind].holds_state:
                    if end % bs:
                        continue  # only the state at the step's end exists, and it is partial
                    first = full_end - 1
                ids, seeds, positions = writes[g]
                for pos in range(max(first, 0), full_end):
                    block = tables[g][pos]
                    if block != NULL_BLOCK_ID:
                        ids.append(block)
                        seeds.append(self._seed(req, g, pos))
                        positions.append(pos)
        for g, (ids, seeds, positions) in enumerate(writes):
            self.device.write(g, ids, seeds, positions)

    # ------------------------------------------------------------------ reading

    def _compare(self, req: EngineRequest, group: int, block_ids: list[int],
                 positions: list[int]) -> int:
        seeds = [self._seed(req, group, p) for p in positions]
        spec = self.specs[group]
        self.metrics.verified_blocks += len(block_ids)
        self.metrics.verified_bytes += len(block_ids) * spec.page_bytes * spec.num_layers
        return self.device.wrong_bytes(group, block_ids, seeds, positions)

    def check_hit(self, req: EngineRequest, hit: CacheHit) -> None:
        """Compare the blocks the engine's prefix cache hands ``req``."""
        for g, ids in enumerate(hit.block_ids):
            pairs = [(b, p) for p, b in enumerate(ids) if b != NULL_BLOCK_ID]
            if pairs:
                self.metrics.wrong_cached_bytes += self._compare(
                    req, g, [b for b, _ in pairs], [p for _, p in pairs])

    def check_load(self, req: EngineRequest, job: TransferJob) -> int:
        """Wrong bytes among the blocks ``job`` loaded for ``req`` (added to the metrics)."""
        wrong = 0
        for t in job.groups:
            positions = range(t.first_block_index, t.first_block_index + len(t.block_ids))
            wrong += self._compare(req, t.group, list(t.block_ids), list(positions))
        self.metrics.wrong_loaded_bytes += wrong
        return wrong

    # --------------------------------------------------------------- host arena

    def expect_stores(self, stores: Sequence[TransferJob],
                      requests: Mapping[str, EngineRequest]) -> None:
        """Tell the auditor what each stored (slot, sub-block) must end up holding.

        Positions come from the request's block table, not from ``first_block_index``: a
        transfer whose ids do not sit at consecutive positions from there breaks the
        ``GroupTransfer`` contract and is counted in ``metrics.misplaced_store_blocks``.
        """
        if self.auditor is None:
            return
        for job in stores:
            req = requests[job.request_id]
            tables = self.pool.block_table(job.request_id)
            for t in job.groups:
                where = {b: p for p, b in enumerate(tables[t.group]) if b != NULL_BLOCK_ID}
                per_slot: dict[int, dict[int, tuple[int, int]]] = {}
                for i, (block, slot, sub) in enumerate(t.pairs(self.factor)):
                    pos = where[block]
                    if pos != t.first_block_index + i:
                        self.metrics.misplaced_store_blocks += 1
                    per_slot.setdefault(slot, {})[sub] = (self._seed(req, t.group, pos), pos)
                for slot, subs in per_slot.items():
                    self.auditor.expect(t.group, slot, subs)

    def promoting(self, jobs: Sequence[TierJob]) -> None:
        """Host slots the plan's promotes fill: the auditor stops expecting what the
        stores before wrote there."""
        if self.auditor is None:
            return
        for job in jobs:
            if job.op is TierOp.PROMOTE:
                self.auditor.forget(job.slot)

    def audit(self, tier: HostTier) -> int:
        """Wrong bytes among the blocks ``tier`` can serve now (added to the metrics)."""
        if self.auditor is None:
            return 0
        keys = []
        for key in tier:
            slot, ref = tier.slot_of(key), tier.ref_count(key)
            if slot is not None and ref is not None and ref >= 0:
                keys.append((key_group(key), slot))
        compared, wrong = self.auditor.audit(keys)
        self.metrics.audited_host_blocks += compared
        self.metrics.wrong_host_bytes += wrong
        return wrong
