"""Built-in workload generators: determinism and the prefix structure each promises."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from kvoffload.errors import ConfigError
from kvoffload.keys import BlockHasher
from kvoffload.workloads import (
    BUILTIN_WORKLOADS,
    AgenticWorkload,
    ChatWorkload,
    SharedPrefixWorkload,
    WorkloadRequest,
    as_token_ids,
    builtin_workload,
    default_size,
    derive_tokens,
    mooncake_block_tokens,
)


def _fingerprint(reqs: list[WorkloadRequest]) -> list[tuple[object, ...]]:
    return [(r.request_id, r.arrival_s, r.prompt.tobytes(), r.output_length,
             r.output_tokens.tobytes() if r.output_tokens is not None else None,
             r.session_id, r.turn, r.cache_salt, r.parent_id) for r in reqs]


@pytest.mark.parametrize("name", sorted(BUILTIN_WORKLOADS))
def test_same_seed_same_requests_other_seed_other_requests(name: str) -> None:
    a = builtin_workload(name, seed=7)
    assert _fingerprint(a) == _fingerprint(builtin_workload(name, seed=7))
    assert _fingerprint(a) != _fingerprint(builtin_workload(name, seed=8))
    assert len({r.request_id for r in a}) == len(a)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)


@pytest.mark.parametrize("name", sorted(BUILTIN_WORKLOADS))
def test_size_sets_sessions_or_users(name: str) -> None:
    sessions = {r.session_id.split(".")[0] for r in builtin_workload(name, seed=3, size=5)}
    assert len(sessions) == 5
    assert default_size(name) > 0
    default = builtin_workload(name, seed=3)
    assert len({r.session_id.split(".")[0] for r in default}) == default_size(name)
    with pytest.raises(ConfigError, match="must be positive"):
        builtin_workload(name, size=0)


def test_default_workload_is_chat() -> None:
    assert _fingerprint(builtin_workload()) == _fingerprint(ChatWorkload().generate())
    with pytest.raises(ConfigError, match="unknown workload"):
        builtin_workload("nope")


def test_derive_tokens_is_pinned() -> None:
    """The derivation is part of the reproducibility contract: pin a few values."""
    tokens = derive_tokens("kvoffload", 4)
    # SHAKE-128("kvoffload") read as little-endian 16-bit words.
    assert list(tokens) == [49630, 61733, 31429, 7855]
    assert list(derive_tokens("kvoffload", 8)[:4]) == list(tokens)
    assert list(mooncake_block_tokens(0)[:4]) == [13593, 43902, 11071, 49485]
    assert tokens.itemsize == 4 and all(0 <= t < 1 << 16 for t in derive_tokens("x", 1000))
    assert derive_tokens("a", 64) != derive_tokens("b", 64)


def test_chat_turn_extends_previous_prompt_and_answer() -> None:
    reqs = ChatWorkload(num_sessions=5, turns=(3, 4), seed=3).generate()
    by_id = {r.request_id: r for r in reqs}
    system = reqs[0].prompt[:256]
    turns = 0
    for r in reqs:
        assert r.prompt[:256] == system  # one service-wide system prompt
        assert r.output_tokens is not None and len(r.output_tokens) == r.output_length
        if r.turn == 0:
            assert r.parent_id is None
            continue
        assert r.parent_id is not None
        prev = by_id[r.parent_id]
        assert prev.output_tokens is not None
        assert (prev.session_id, prev.turn) == (r.session_id, (r.turn or 0) - 1)
        head = prev.prompt + prev.output_tokens
        assert r.prompt[:len(head)] == head and len(r.prompt) > len(head)
        assert r.arrival_s > prev.arrival_s
        turns += 1
    assert turns >= 10


def test_shared_prefix_users_and_tenants() -> None:
    reqs = SharedPrefixWorkload(num_requests=30, system_tokens=1024, num_tenants=3,
                                seed=1).generate()
    system = reqs[0].prompt[:1024]
    assert all(r.prompt[:1024] == system for r in reqs)
    assert [r.cache_salt for r in reqs[:4]] == ["tenant-0", "tenant-1", "tenant-2", "tenant-0"]
    hasher = BlockHasher(16)
    h = [r.prompt_hashes(hasher)[0] for r in reqs[:4]]
    assert h[0] == h[3] and len({h[0], h[1], h[2]}) == 3  # salts separate tenants
    single = SharedPrefixWorkload(num_requests=3, seed=1).generate()
    assert {r.cache_salt for r in single} == {None}


def test_agentic_context_grows_and_branches() -> None:
    cfg = AgenticWorkload(num_sessions=3, branch_probability=0.5, seed=2)
    reqs = cfg.generate()
    by_id = {r.request_id: r for r in reqs}
    sessions: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in reqs:
        assert r.session_id is not None
        sessions[r.session_id].append(r)
    subagents = [s for s in sessions if "." in s]
    assert subagents, "expected at least one branch with this seed"
    for sid, steps in sessions.items():
        steps.sort(key=lambda r: r.turn or 0)
        for prev, cur in itertools.pairwise(steps):
            assert prev.output_tokens is not None
            head = prev.prompt + prev.output_tokens
            assert cur.prompt[:len(head)] == head  # context only grows
            assert len(cur.prompt) > len(head)  # by a tool output or sub-agent answers
        if "." in sid:
            first = steps[0]
            assert first.parent_id is not None
            parent = by_id[first.parent_id]
            assert parent.output_tokens is not None
            branch = parent.prompt + parent.output_tokens
            assert first.prompt[:len(branch)] == branch  # starts from the parent's context
            assert first.arrival_s > parent.arrival_s
    # A parent's step after a branch contains every sub-agent's final answer.
    sid = subagents[0]
    parent_step = by_id[sessions[sid][0].parent_id or ""]
    nxt = next(r for r in sessions[parent_step.session_id or ""]
               if r.turn == (parent_step.turn or 0) + 1)
    answer = sessions[sid][-1].output_tokens
    assert answer is not None
    assert nxt.prompt.tobytes().find(answer.tobytes()) > 0


def test_invalid_configs_raise() -> None:
    with pytest.raises(ConfigError, match=r"chat\.turns"):
        ChatWorkload(turns=(5, 2))
    with pytest.raises(ConfigError, match="branch_probability"):
        AgenticWorkload(branch_probability=1.5)
    with pytest.raises(ConfigError, match="rate_per_s"):
        SharedPrefixWorkload(rate_per_s=0)
    with pytest.raises(ValueError, match="output tokens"):
        WorkloadRequest("r", 0.0, as_token_ids([1, 2]), 3, output_tokens=as_token_ids([1]))
    with pytest.raises(ValueError, match="empty prompt"):
        WorkloadRequest("r", 0.0, as_token_ids([]), 3)
