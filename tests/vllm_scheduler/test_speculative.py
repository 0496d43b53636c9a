"""Speculative decoding with a drafter that keeps KV (EAGLE, EAGLE-3, MTP) inside vLLM's real
``Scheduler`` and ``AsyncScheduler`` (``kit``, ``speculative=(method, k)``).

The drafter's layers hold at a position KV computed from the token after it, and the last
``k + 1`` positions a request computed are still provisional (``attention_runner``'s
draft values): kvoffload keys, stores and hits a draft group one block late
(``GroupSpec.proof_tokens = k + 1``, set by ``compat.speculative_draft_kv`` and
``translate.draft_group_spec``). Every position a step reads is checked against what a
recompute of the request's own tokens writes, every store against the final draft values
(a store of a volatile block fails), and the outputs against the scripted model's greedy
tokens (what the engine gives without speculation and without offloading). The negative
controls run the same stories with the lag taken out of the translation and show that the
checks catch it. vLLM 0.32, which does not mark draft layers, refuses draft KV at start-up.

The prompts that share a prefix share it up to a position inside a block (``prefix_len``
168 and 136, not multiples of the 16-token block), except where a story diverges at a
block's end on purpose with vLLM's own cache dropped. vLLM's own prefix cache keeps one
block per block hash: a request whose hit reaches past a block it shares with another
request up to that block's end (a hit of its own blocks after a preemption, for
instance) gets the other request's copy, whose last draft position was computed from the
other request's next token. That is vLLM's (it costs acceptance, never output: the
target verifies every draft), the checks here would report it, and kvoffload, which
stores what the engine's blocks hold, would keep it.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from integration.markers import VLLM

pytestmark = VLLM

kit = pytest.importorskip("vllm_scheduler.kit")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kit.model_dir(tmp_path_factory.mktemp("spec") / "llama")


@pytest.fixture(scope="module")
def marks_drafts() -> bool:
    """Whether the installed vLLM marks draft layers (``KVCacheSpec.is_draft``, 0.33 on)."""
    import dataclasses

    from vllm.v1.kv_cache_interface import KVCacheSpec

    return "is_draft" in {f.name for f in dataclasses.fields(KVCacheSpec)}


@pytest.fixture
def needs_draft_marks(marks_drafts: bool) -> None:
    if not marks_drafts:
        pytest.skip("vLLM 0.32 marks no drafter's layer: every group is keyed late there "
                    "(test_draft_groups_are_offloaded_one_block_late; the runs need the "
                    "marks to tell the draft group's values from the target's)")


def greedy(prompt: list[int], n: int) -> list[int]:
    """The scripted model's greedy tokens: what the engine gives without speculation and
    without offloading (the runner samples ``kit.next_token`` whatever it accepts)."""
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(kit.next_token(seq))
        seq.append(out[-1])
    return out


def assert_drained(eng: kit.Engine) -> None:
    planner = eng.side.planner
    planner.check_integrity()
    assert planner.num_jobs == 0 and planner.fence_size == 0
    usage = eng.side.tier.usage()
    assert usage.pinned_slots == 0 and usage.writing_slots == 0


def draft_groups(eng: kit.Engine) -> list[int]:
    return [g.index for g in eng.connector.offload_config.resolved if g.key_lag_blocks]


def without_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the translation keeps draft groups, but without their proof
    tokens (keyed, stored and hit like the target's own blocks)."""
    from kvoffload.integrations.vllm import translate

    monkeypatch.setattr(translate, "draft_group_spec", lambda spec, proof, where: spec)


def diverging_prompts(seed: int = 7) -> tuple[list[int], list[int], list[int]]:
    """A 80-token prompt, and two prompts sharing its first 48 and 64 tokens (three and
    four whole blocks) but not the token after them."""
    rng = random.Random(seed)
    a = [rng.randrange(10, 30_000) for _ in range(80)]
    b = a[:48] + [a[48] + 1] + [rng.randrange(10, 30_000) for _ in range(21)]
    c = a[:64] + [a[64] + 1] + [rng.randrange(10, 30_000) for _ in range(21)]
    return a, b, c


# -- start-up --------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "method", "k"), [
    ("draft", "eagle", 3), ("draft", "eagle3", 2), ("draft", "mtp", 1),
    ("merged-draft", "eagle", 3), ("hybrid+draft", "mtp", 2)])
def test_draft_groups_are_offloaded_one_block_late(root: Path, marks_drafts: bool,
                                                   layout: str, method: str, k: int) -> None:
    """vLLM 0.33 and 0.34: the groups holding the drafter's layers (a group of its own,
    or the target's full-attention group the draft layer was merged into) get
    ``num_speculative_tokens + 1`` proof tokens, the others none. vLLM 0.32 marks no
    drafter's layer: every group gets them, and a sliding-window group is refused."""
    if not marks_drafts:
        from kvoffload.integrations.vllm.translate import UnsupportedSpecError

        if "hybrid" in layout:
            with pytest.raises(UnsupportedSpecError, match=r"may hold\) a speculative drafter's "
                                                r"layers and is a sliding_window group"):
                kit.build(root, kit.Layout(layout), speculative=(method, k))
            return
        with kit.engine(root, kit.Layout(layout), speculative=(method, k)) as eng:
            for connector in (eng.connector, eng.worker):
                assert all(g.proof_tokens == k + 1 for g in connector.layout.groups)
        return
    with kit.engine(root, kit.Layout(layout), speculative=(method, k)) as eng:
        marked = [i for i, g in enumerate(eng.scheduler.kv_cache_config.kv_cache_groups)
                  if g.is_eagle_group]
        assert marked
        for connector in (eng.connector, eng.worker):  # both roles translate alike
            groups = connector.layout.groups
            assert [i for i, g in enumerate(groups) if g.proof_tokens] == marked
            assert all(groups[i].proof_tokens == k + 1 for i in marked)
            assert [g.index for g in connector.offload_config.resolved
                    if g.key_lag_blocks == 1] == marked


# -- runs ------------------------------------------------------------------------------


@pytest.mark.usefixtures("needs_draft_marks")
@pytest.mark.parametrize(("layout", "method", "k", "async_scheduling"), [
    ("draft", "eagle", 3, False), ("merged-draft", "mtp", 2, False),
    ("hybrid+draft", "eagle3", 3, False), ("draft", "eagle", 3, True),
    ("merged-draft", "mtp", 2, True), ("hybrid+draft", "eagle", 3, True)])
def test_a_second_pass_loads_draft_blocks_equal_to_a_recompute(
        root: Path, layout: str, method: str, k: int, async_scheduling: bool) -> None:
    """Two passes over prompts sharing long prefixes, vLLM's own cache dropped between
    them: the second is served by loads of every group, draft groups included, and every
    draft position a step reads holds the final value of the request's own tokens
    (``attention_runner``), every stored draft block its final values (``stored_bytes``).
    Drafts were both accepted and rejected, and the outputs are the greedy tokens."""
    batch = kit.prompts(16, prefix_len=168)
    with kit.engine(root, kit.Layout(layout), speculative=(method, k),
                    async_scheduling=async_scheduling) as eng:
        kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)], max_tokens=20)
        assert eng.scheduler.reset_prefix_cache()
        kit.feed(eng, [(f"b{i}", p) for i, p in enumerate(batch)], max_tokens=20)
        loaded = eng.side.planner.stats.blocks_loaded
        assert all(loaded.get(g, 0) > 0 for g in range(len(eng.groups)))
        assert draft_groups(eng)
        assert eng.checked_positions > 10_000 and eng.stores.checked_pages > 100
        assert 0 < eng.accepted < eng.drafted
        for i, prompt in enumerate(batch):
            assert eng.outputs[f"a{i}"] == eng.outputs[f"b{i}"] == greedy(prompt, 20)
        assert_drained(eng)


@pytest.mark.usefixtures("needs_draft_marks")
@pytest.mark.parametrize("layout", ["draft", "hybrid+draft", "merged-draft"])
def test_a_prompt_that_diverges_after_a_block_gets_a_hit_one_block_shorter(
        root: Path, layout: str) -> None:
    """A request stores its prompt; prompts sharing its first 48 or 64 tokens but not the
    token after them are offered 32 and 48 tokens (the target's blocks would give 48 and
    64): the last shared block's draft KV was computed from a next token they do not
    have. The full prompt again gets everything but its last (partial) block."""
    a, b, c = diverging_prompts()
    with kit.engine(root, kit.Layout(layout), speculative=("eagle", 3)) as eng:
        eng.add("a", a, max_tokens=4)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        for rid, prompt in (("b", b), ("c", c), ("again", a)):
            eng.add(rid, prompt, max_tokens=4)
            eng.run()
            assert eng.scheduler.reset_prefix_cache()
        assert eng.first_computed == {"a": 0, "b": 32, "c": 48, "again": 64}
        assert eng.outputs["again"] == eng.outputs["a"] == greedy(a, 4)
        assert eng.outputs["b"] == greedy(b, 4) and eng.outputs["c"] == greedy(c, 4)
        assert_drained(eng)


@pytest.mark.usefixtures("needs_draft_marks")
@pytest.mark.parametrize(("layout", "async_scheduling"), [
    ("hybrid+draft", False), ("draft", False), ("hybrid+draft", True), ("draft", True),
    ("merged-draft", True)])
def test_preemptions_with_draft_groups(root: Path, layout: str,
                                       async_scheduling: bool) -> None:
    """A pool small enough that vLLM preempts requests in both passes, speculative
    tokens allocated with every decode: the outputs stay the greedy tokens, every read
    and store holds what it must, and the second pass loads every group."""
    batch = kit.prompts(24, prefix_len=136, tail=(40, 160))
    with kit.engine(root, kit.Layout(layout), speculative=("eagle", 3), num_blocks=96,
                    max_num_seqs=8, max_num_batched_tokens=128,
                    async_scheduling=async_scheduling) as eng:
        kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)], max_tokens=24)
        assert eng.scheduler.reset_prefix_cache()
        kit.feed(eng, [(f"b{i}", p) for i, p in enumerate(batch)], max_tokens=24)
        assert eng.side.num_preempted > 0
        loaded = eng.side.planner.stats.blocks_loaded
        assert all(loaded.get(g, 0) > 0 for g in range(len(eng.groups)))
        assert 0 < eng.accepted < eng.drafted
        for i, prompt in enumerate(batch):
            assert eng.outputs[f"a{i}"] == eng.outputs[f"b{i}"] == greedy(prompt, 24)
        assert_drained(eng)


# -- negative controls -----------------------------------------------------------------


@pytest.mark.usefixtures("needs_draft_marks")
def test_without_the_lag_a_volatile_draft_block_is_stored_and_the_store_check_fails(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same prompts with the draft group keyed like the target's: blocks whose last
    positions are still provisional are stored (a prefill chunk or a decode step ending
    near a block's end), and the store check, which expects final draft values, fails.
    Stores are fenced when submitted (``runner="v2"``), so each copies the step's bytes."""
    without_lag(monkeypatch)
    batch = kit.prompts(16, prefix_len=168)
    with kit.engine(root, kit.Layout("draft"), speculative=("eagle", 3), runner="v2",
                    max_num_batched_tokens=64) as eng:
        assert not draft_groups(eng)
        with pytest.raises(AssertionError, match=r"group 1 .* does not hold what the "
                                                 r"forward pass wrote"):
            kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)], max_tokens=20)


@pytest.mark.usefixtures("needs_draft_marks")
def test_without_the_lag_a_diverging_prompt_loads_draft_kv_of_another_next_token(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the draft group keyed like the target's (and stores left unchecked), the
    prompt that shares 48 tokens but not the 49th is offered 48 and loads draft KV
    computed from the other prompt's 49th token: the read check fails."""
    without_lag(monkeypatch)
    a, b, _ = diverging_prompts()
    with kit.engine(root, kit.Layout("draft"), speculative=("eagle", 3)) as eng:
        eng.stores = None
        eng.add("a", a, max_tokens=4)
        eng.run()
        assert eng.scheduler.reset_prefix_cache()
        eng.add("b", b, max_tokens=4)
        with pytest.raises(AssertionError, match=r"draft layer draft\.layers\.0\.attn "
                                                 r"position 47 .* holds the final value for "
                                                 f"next token {a[48]}, expected the final "
                                                 f"value for next token {b[48]}"):
            eng.run()
        assert eng.first_computed["b"] == 48
