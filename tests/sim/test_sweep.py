"""The sweep's library part (``kvoffload.sim.sweep``): reading the memory a hit rate needs
off a curve. The grid itself runs through ``kvoffload sweep`` in ``tests/cli/test_cli.py``."""

from __future__ import annotations

import pytest

from kvoffload.sim.sweep import SweepPoint, memory_to_reach


def test_memory_to_reach_interpolates_in_log_capacity() -> None:
    def point(capacity: int, hit: float) -> SweepPoint:
        return SweepPoint("p", "lru", capacity, 0.0, hit, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                          0.0, 1, 0.0)

    curve = [point(1 << 30, 0.1), point(4 << 30, 0.3), point(16 << 30, 0.5)]
    assert memory_to_reach(curve, 0.05) == 1 << 30
    assert memory_to_reach(curve, 0.2) == pytest.approx(2 << 30)
    assert memory_to_reach(curve, 0.5) == pytest.approx(16 << 30)
    assert memory_to_reach(curve, 0.6) is None
