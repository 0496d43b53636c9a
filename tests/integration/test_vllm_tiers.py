"""End to end on real vLLM engines: the disk and remote tiers behind host memory.

Each test runs two engines one after the other, as a restart or as a second member of a
fleet would: the first computes prompts and stores their blocks (host memory writes them
through to the lower tier); the second starts with empty host memory and vLLM prefix
cache, so every hit it gets was promoted from the lower tier. Greedy outputs must not
change, every loaded page must equal its host slot byte for byte, and a damaged block in
the tier must read as a miss, never as data.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.markers import VLLM
from kvoffload.blockfile.framing import HEADER_BYTES

pytestmark = VLLM

ALIGN = 32


def tier_extra(disk: Path | None = None, remote: str | None = None) -> dict[str, Any]:
    """Connector options: host memory plus the given tiers, written through."""
    extra: dict[str, Any] = {"tiers": ["host"], "max_deferred_steps": 256}
    if disk is not None:
        extra["tiers"].append("disk")
        extra |= {"disk_path": str(disk), "disk_capacity": "256MiB",
                  "disk_write_mode": "write_through", "disk_fsync": "false"}
    if remote is not None:
        extra["tiers"].append("remote")
        # A fresh engine's first lookups wait for the remote's answers (and, on a Cluster,
        # for the client's slot discovery); on a fast, idle machine the default deferral
        # bound (64 steps and 0.5 s) can run out first, and the request then recomputes
        # -- correct, but not what these tests are about. Wait as long as a remote call may.
        extra |= {"remote_url": remote, "remote_timeout_s": 5.0, "min_deferral_s": 5.0}
    return extra


def second_engine_hits(model: Path, extra: dict[str, Any], tier: str,
                       prompts: list[list[int]], *, align: int = ALIGN,
                       windowed: bool = False, **engine_kwargs: Any) -> None:
    """Run ``prompts`` on a first engine, then on a fresh one whose hits must all be
    promoted from ``tier``, with identical outputs and verified bytes."""
    from integration.vllm_kit import engine, expected_hit, verify_loads

    with engine(model, extra=extra, **engine_kwargs) as first_engine:
        first = first_engine.generate(prompts)
        first_engine.assert_idle()  # every write-through demote has reported
        assert first_engine.scheduler.tier.stats.demoted.get(tier, 0) > 0
    with engine(model, extra=extra, **engine_kwargs) as eng:
        checked = [0]
        eng.worker.after_load = verify_loads(lambda: eng.worker.worker.host_pool, checked)
        second = eng.generate(prompts)
        eng.worker.after_load = None
        expected = [expected_hit(len(p), align, windowed) for p in prompts]
        assert [r.num_cached_tokens for r in second] == expected
        assert [r.tokens for r in second] == [r.tokens for r in first]
        for a, b in zip(first, second, strict=True):
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
        assert checked[0] > 0
        shares = eng.scheduler.tier.stats.hit_shares()
        assert shares.get(tier, 0.0) == 1.0, shares
        eng.assert_idle()


def test_a_restarted_engine_hits_what_the_last_one_stored_on_disk(
        tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    from integration.vllm_kit import random_prompts

    prompts = random_prompts([70, 129, 200], seed=31)
    second_engine_hits(tiny_model("llama"), tier_extra(disk=tmp_path / "disk"), "disk",
                       prompts)


def test_mamba_states_come_back_from_disk_exactly(
        tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    """A Mamba + attention hybrid: the state at the hit point and the attention blocks
    before it are promoted from disk; a state from any other position would change the
    output."""
    from integration.vllm_kit import random_prompts

    mamba_block = 64
    prompts = random_prompts([65, 129, 200], seed=34)
    second_engine_hits(tiny_model("granite_hybrid"), tier_extra(disk=tmp_path / "disk"),
                       "disk", prompts, align=mamba_block, windowed=True,
                       max_num_batched_tokens=mamba_block)


def test_two_engines_share_a_prefix_through_redis(
        tiny_model: Callable[[str], Path]) -> None:
    from integration.vllm_kit import random_prompts
    from tiers.tier_kit import redis_server

    prompts = random_prompts([100, 161, 230], seed=32)
    with redis_server() as server:
        second_engine_hits(tiny_model("llama"), tier_extra(remote=server.url), "remote",
                           prompts)


def test_two_engines_share_a_prefix_through_a_redis_cluster(
        tiny_model: Callable[[str], Path]) -> None:
    from integration.vllm_kit import random_prompts
    from tiers.cluster_kit import redis_cluster

    prompts = random_prompts([100, 161, 230], seed=33)
    with redis_cluster() as cluster:
        extra = tier_extra(remote=cluster.url) | {"remote_cluster": True}
        second_engine_hits(tiny_model("llama"), extra, "remote", prompts)
        assert all(cluster.dbsize(m) > 0 for m in cluster.masters())


def test_damaged_block_files_are_misses_and_outputs_are_recomputed(
        tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    from integration.vllm_kit import engine, random_prompts

    extra = tier_extra(disk=tmp_path / "disk")
    prompts = random_prompts([150, 220], seed=33)
    with engine(tiny_model("llama"), extra=extra) as eng:
        first = eng.generate(prompts)
        eng.assert_idle()
    files = [os.path.join(d, f) for d, _, names in os.walk(tmp_path / "disk")
             for f in names if f.endswith(".kvb")]
    assert files
    for path in files:  # flip one payload byte near the end of every block (before its header)
        with open(path, "r+b") as f:
            f.seek(-HEADER_BYTES - 7, os.SEEK_END)
            byte = f.read(1)
            f.seek(-HEADER_BYTES - 7, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    with engine(tiny_model("llama"), extra=extra) as eng:
        second = eng.generate(prompts)
        assert [r.tokens for r in second] == [r.tokens for r in first]
        assert all(r.num_cached_tokens == 0 for r in second)
        assert eng.scheduler.tier.stats.loaded_blocks.get("disk", 0) == 0
        tier_io = eng.worker.worker.tier_io
        assert tier_io is not None
        assert tier_io.stores["disk"].stats.rejected > 0
        assert eng.scheduler.tier.stats.promote_failed.get("disk", 0) > 0
        eng.assert_idle()


@pytest.fixture(autouse=True)
def _no_leftover_engine() -> Iterator[None]:
    yield
    import gc

    gc.collect()
