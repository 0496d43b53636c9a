"""The reference engine's small parts: hashing, block contents, modelled time, summaries."""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload.errors import ConfigError
from kvoffload.jobs import Direction, JobId
from kvoffload.keys import BlockHasher, HashAlgorithm, HashContext, hash_block
from kvoffload.models.presets import PRESETS
from kvoffload.refengine.device import block_content, full_block_seed
from kvoffload.refengine.timing import TimingModel, TransferClock
from kvoffload.sim.simulation import auto_block_size
from kvoffload.sim.summary import Percentiles


@pytest.mark.parametrize("algo", list(HashAlgorithm))
@pytest.mark.parametrize("context", [HashContext(), HashContext(cache_salt="tenant-3"),
                                     HashContext(lora_name="adapter")])
def test_block_hasher_chains_hash_block(algo: HashAlgorithm, context: HashContext) -> None:
    """The packed fast path and the general path both equal ``hash_block`` chained."""
    tokens = list(range(7, 7 + 103))
    hasher = BlockHasher(16, "s", algo)
    parent, ref = hasher.root, []
    for start in range(0, 96, 16):
        parent = hash_block(parent, tokens[start:start + 16],
                            context.extra_keys(start, start + 16), algo)
        ref.append(parent)
    assert hasher.extend([], tokens, context) == ref
    grown = hasher.extend([], tokens[:40], context)  # incremental, as decode appends
    assert len(grown) == 2
    assert hasher.extend(grown, tokens, context) == ref


def test_block_content_is_deterministic_and_differs_almost_everywhere() -> None:
    a = block_content([11, 12], 0, [3, 3], 2, 64)
    assert a.shape == (2, 2, 64) and a.dtype == np.uint8
    assert np.array_equal(a, block_content([11, 12], 0, [3, 3], 2, 64))
    others = [block_content([11], 1, [3], 2, 64)[0], block_content([11], 0, [4], 2, 64)[0]]
    for other in others:  # another group, another position
        assert np.count_nonzero(a[0] != other) > 0.9 * a[0].size
    assert np.count_nonzero(a[0] != a[1]) > 0.9 * a[0].size  # another prefix
    assert np.count_nonzero(a[0, 0] != a[0, 1]) > 0.9 * 64  # layers differ too
    with pytest.raises(ValueError, match="multiple of 8"):
        block_content([1], 0, [0], 1, 12)
    assert full_block_seed(bytes(range(16))) == int.from_bytes(bytes(range(8)), "little")


def test_transfer_clock_serialises_each_link_and_keeps_directions_apart() -> None:
    clock = TransferClock(TimingModel(link_bytes_per_s=1e9))
    assert clock.submit(JobId(1), Direction.LOAD, 2_000_000, now=0.0) == pytest.approx(0.002)
    # The second load queues behind the first; a store runs beside them.
    assert clock.submit(JobId(2), Direction.LOAD, 1_000_000, now=0.001) == pytest.approx(0.003)
    assert clock.submit(JobId(3), Direction.STORE, 1_000_000, now=0.001) == pytest.approx(0.002)
    assert clock.next_completion() == pytest.approx(0.002)
    clock.forget(JobId(1))
    clock.forget(JobId(3))
    assert clock.next_completion() == pytest.approx(0.003)
    assert clock.done_at(JobId(99)) == 0.0
    assert clock.busy_seconds[Direction.LOAD] == pytest.approx(0.003)


def test_timing_model_step_and_validation() -> None:
    t = TimingModel(accelerator_flops=1e12, decode_step_s=0.01)
    assert t.step_seconds(5e10, 1) == pytest.approx(0.05)  # compute bound
    assert t.step_seconds(1e9, 3) == pytest.approx(0.03)  # decode floor
    with pytest.raises(ConfigError, match="link_bytes_per_s"):
        TimingModel(link_bytes_per_s=0)


def test_percentiles_and_auto_block_size() -> None:
    p = Percentiles.of([float(i) for i in range(1, 101)])
    assert (p.mean, p.p50, p.p90, p.p99) == (50.5, 50.0, 90.0, 99.0)
    assert Percentiles.of([]).mean == 0.0
    assert auto_block_size(PRESETS["llama3-8b"]) == 16
    # Nemotron-H: a 4096 B/token attention page must hold a 4,255,744 B Mamba state page.
    mamba = PRESETS["nemotron-h-8b"].mamba
    assert mamba is not None
    bs = auto_block_size(PRESETS["nemotron-h-8b"])
    assert bs % 16 == 0 and bs * 4096 >= mamba.state_bytes_per_layer > (bs - 16) * 4096
