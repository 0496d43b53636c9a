"""``KVOffloadConnector``: kvoffload as a vLLM v1 KV connector (vLLM 0.32.x to 0.34.x).

Loaded by vLLM from ``--kv-transfer-config``::

    {"kv_connector": "KVOffloadConnector",
     "kv_connector_module_path": "kvoffload.integrations.vllm",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"host_memory_bytes": "8GiB"}}

vLLM builds one instance with the SCHEDULER role (in the engine core) and one per worker
with the WORKER role. The scheduler role drives kvoffload's ``Planner`` over a host tier
(``SchedulerSide``); the worker role runs a ``TransferWorker`` over vLLM's caches
(``WorkerSide``), with the CPU backend on vLLM's CPU platform and the CUDA backend on a
GPU. The connector declares ``SupportsHMA``: every KV-cache group (full attention,
sliding window, Mamba) is offloaded by its own rule, so hybrid models keep vLLM's hybrid
memory allocator. Under speculative decoding with an EAGLE, EAGLE-3 or MTP drafter (vLLM
0.33 and 0.34), the groups holding the drafter's layers are offloaded too, keyed one block
late (``compat.speculative_draft_kv``, ``translate.draft_group_spec``).

Lower tiers (``"tiers": ["host", "disk", "remote"]`` with ``disk_path``/``disk_capacity``
and ``remote_url``; see ``options``) sit behind host memory: the scheduler's planner talks
to a ``CascadeTier`` and every worker runs the plans' tier jobs. Unless the options name
one, the ``model_id`` that namespaces stored blocks is the served model, its revision and
its dtype, so engines serving the same weights share blocks and others never do.

The scheduler and the workers translate the same ``KVCacheConfig`` with the same options,
so they agree on the host slot count; a worker whose tensors do not match raises
``LayoutError`` at registration, before any byte moves.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm.compat import check_engine_features, runner_writes_before_flush
from kvoffload.integrations.vllm.cpu_cores import engine_advice
from kvoffload.integrations.vllm.metadata import KVOffloadMetadata
from kvoffload.integrations.vllm.options import ConnectorOptions
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.integrations.vllm.stats import KVOffloadPromMetrics, KVOffloadStats
from kvoffload.integrations.vllm.translate import check_parallelism, translate
from kvoffload.integrations.vllm.version import check_vllm_version
from kvoffload.integrations.vllm.worker_side import WorkerSide
from kvoffload.tiers.config import TierConfig

logger = logging.getLogger(__name__)


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """kvoffload's vLLM connector; see the module docstring for the configuration."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        check_vllm_version()
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.options = ConnectorOptions.from_extra_config(extra)
        num_workers = check_parallelism(vllm_config.parallel_config)
        draft = check_engine_features(vllm_config, kv_cache_config)
        self.layout = translate(kv_cache_config, proof_tokens=draft.proof_tokens,
                                every_group_draft=draft.every_group)
        self.offload_config = self.layout.offload_config(self.options, num_workers)
        self.tier_config = with_model_id(self.options.tier_config, vllm_config,
                                         draft.proof_tokens)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
            if policy != "recompute":
                logger.warning("kvoffload: kv_load_failure_policy is %r: a failed load fails "
                               "its request. Set it to 'recompute' to recompute instead.",
                               policy)
            advice = engine_advice(vllm_config)
            if advice is not None:
                logger.warning("kvoffload: %s", advice)
            events = vllm_config.kv_events_config
            self.scheduler_side = SchedulerSide(
                self.offload_config,
                enable_events=bool(events is not None and events.enable_kv_cache_events),
                tiers=self.tier_config, load_deadline_s=self.options.load_deadline_s)
        else:
            rank = int(vllm_config.parallel_config.rank) % num_workers
            self.worker_side = WorkerSide(
                self.offload_config, self.layout.layer_names, self.layout.num_blocks,
                rank=rank, tiers=self.tier_config, staging_bytes=self.options.staging_bytes,
                fence_store_reads=runner_writes_before_flush(vllm_config))
        logger.info("kvoffload: %s role, groups %s, %d host slots of %d bytes, tiers %s",
                    role.name, [g.name for g in self.layout.groups],
                    self.offload_config.num_host_slots, self.offload_config.slot_bytes,
                    list(self.options.tiers))

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is only a future miss."""
        return False

    @property
    def scheduler(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("scheduler-side call on a WORKER-role KVOffloadConnector")
        return self.scheduler_side

    @property
    def worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("worker-side call on a SCHEDULER-role KVOffloadConnector")
        return self.worker_side

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 and 0.34 ask at start-up; False makes them refuse
        ``--enable-sleep-mode`` (the worker keeps views of the caches: ``compat``)."""
        return False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """No: kvoffload keys blocks by vLLM's plain block hashes (the ones 0.32 and every
        tier written by an earlier engine use), not by lookahead hashes, which differ and
        are published only once a speculative drafter's tokens after the block exist.
        vLLM 0.34 asks this and leaves lookahead hashing off for a connector that says
        False (0.33 turns it off whenever a connector is set; 0.32 has no such hashes);
        ``compat`` refuses an engine where it is on anyway. Stated here rather than
        inherited so that a change of vLLM's default cannot turn it on."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # Every block's pages contiguous: [layer][block][heads][tokens][K|V].
        return "LBHNC"

    # -- worker role --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+ before it releases the caches' memory (sleep; 0.34's extensible KV
        cache also on ``release_kv_cache_memory`` and weight updates): every transfer is
        waited for and none runs until ``restore_kv_caches``."""
        self.worker.unregister()

    def restore_kv_caches(self) -> None:
        self.worker.restore()

    def _meta(self) -> KVOffloadMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVOffloadMetadata) else None

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVOffloadMetadata):
            self.worker.flush(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            self.worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete before vLLM schedules the request: nothing to wait for here."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Stores run per step after the forward pass (``wait_for_save``), not per layer."""

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is not None:
            self.worker.submit_stores(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        finished, failed = self.worker.transfer_results(self._meta())
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker_side is None:
            return None
        return self.worker_side.take_worker_meta()

    # -- scheduler role -----------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Any) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks.get_block_ids(),
                                                num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Any, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler.request_finished(request)
        return False, None

    def take_events(self) -> Iterable[Any]:
        return self.scheduler.take_events()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache()

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while stores are in flight, so their reports arrive."""
        return self.scheduler_side is not None and self.scheduler_side.has_pending_work()

    # -- both ---------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVOffloadStats | None:
        if self.scheduler_side is None:
            return None
        return self.scheduler_side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVOffloadStats:
        return KVOffloadStats(data=data) if data is not None else KVOffloadStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVOffloadPromMetrics:
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames,
                                    per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()


__all__ = ["KVOffloadConnector"]


def with_model_id(tiers: TierConfig, vllm_config: Any, proof_tokens: int = 0) -> TierConfig:
    """``tiers`` with ``model_id`` filled from vLLM's model config when the options left
    it empty: ``<model>@<revision>:<dtype>`` (what changes the KV bytes besides the
    layout, which the namespace covers on its own), followed, where draft groups are
    offloaded (``proof_tokens`` > 0), by ``+<method>:<draft model>@<revision>/<proof>``:
    another drafter of the same shapes writes other draft KV, and another proof keys the
    draft blocks differently."""
    if tiers.model_id or not tiers.enabled:
        return tiers
    model = vllm_config.model_config
    model_id = f"{model.model}@{model.revision or 'main'}:{model.dtype}"
    spec = getattr(vllm_config, "speculative_config", None)
    if proof_tokens > 0 and spec is not None:
        draft = getattr(spec, "draft_model_config", None)
        name = getattr(draft, "model", None) or getattr(spec, "model", None) or model.model
        revision = getattr(draft, "revision", None) or "main"
        model_id += f"+{spec.method}:{name}@{revision}/{proof_tokens}"
    return dataclasses.replace(tiers, model_id=model_id)
