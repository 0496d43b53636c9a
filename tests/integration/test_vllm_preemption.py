"""End to end on a real vLLM engine whose own KV cache is far too small: preemption.

(The hybrid models' modules force preemption through vLLM's own preemption path
instead, see ``vllm_kit.generate_with_preemption``: vLLM's admission control avoids
preempting them with small caches.)

vLLM preempts running requests (frees all their blocks) when it runs out, and resumes
them later with a fresh block table, recomputing or, with kvoffload, loading what the
host tier holds. The connector must flush the stores that read the freed blocks before
vLLM reuses them. Outputs must equal those of the same prompts run one at a time (no
preemption), in a first round (stores under preemption) and a second one (loads too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.markers import VLLM

pytestmark = VLLM

CASES = {
    # model: (engine kwargs, prompt lengths, tokens to generate)
    "llama": ({"kv_cache_bytes": 24 * 16 << 10}, [150, 170, 190, 210, 230, 250], 32),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]) -> Iterator[Any]:
    from integration.vllm_kit import engine

    kwargs, lengths, max_tokens = CASES[request.param]
    with engine(tiny_model(request.param), **kwargs) as e:
        yield e, lengths, max_tokens


def test_preempted_requests_finish_with_identical_outputs(case: Any) -> None:
    from integration.vllm_kit import random_prompts

    eng, lengths, max_tokens = case
    prompts = random_prompts(lengths, seed=31)
    reference = [eng.generate([p], max_tokens)[0].tokens for p in prompts]
    eng.drain()
    assert eng.llm.reset_prefix_cache(reset_connector=True)
    preempted_before = eng.scheduler.num_preempted

    first = eng.generate(prompts, max_tokens)
    assert eng.scheduler.num_preempted > preempted_before, "the cache was large enough"
    assert [r.tokens for r in first] == reference
    eng.reset_prefix_cache()

    hits_before = eng.hit_tokens()
    second = eng.generate(prompts, max_tokens)
    assert [r.tokens for r in second] == reference
    assert eng.hit_tokens() > hits_before
    eng.assert_idle()
