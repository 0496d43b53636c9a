"""Fixtures of the lower-tier tests: a real redis-server on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tiers.tier_kit import RedisServer, redis_server


@pytest.fixture
def redis_srv() -> Iterator[RedisServer]:
    """A fresh redis-server for one test (skipped where the binary is missing)."""
    with redis_server() as server:
        yield server
