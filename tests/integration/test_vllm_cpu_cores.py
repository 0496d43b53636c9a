"""The start-up advice about the cores vLLM's CPU backend reserves with a connector set."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from integration.markers import requires_vllm
from kvoffload.integrations.vllm.cpu_cores import (
    BIND_ENV,
    RESERVED_ENV,
    reservation_advice,
)


@pytest.mark.parametrize(("cores", "workers", "advised"), [
    (1, 1, True), (2, 1, True), (3, 1, False), (4, 2, True), (8, 2, False)])
def test_advice_where_vllm_reserves_no_core(cores: int, workers: int, advised: bool) -> None:
    advice = reservation_advice(on_cpu=True, cores=cores, local_workers=workers, env={})
    assert (advice is not None) is advised
    if advice is not None:
        assert f"{RESERVED_ENV}={workers}" in advice


@pytest.mark.parametrize("env", [{RESERVED_ENV: "1"}, {RESERVED_ENV: "0"}, {BIND_ENV: "0"},
                                 {BIND_ENV: "0|1"}])
def test_no_advice_once_the_operator_chose(env: dict[str, str]) -> None:
    assert reservation_advice(on_cpu=True, cores=2, local_workers=1, env=env) is None


def test_no_advice_off_the_cpu_backend() -> None:
    assert reservation_advice(on_cpu=False, cores=2, local_workers=1, env={}) is None
    assert reservation_advice(on_cpu=True, cores=2, local_workers=1,
                              env={BIND_ENV: "auto"}) is not None


def _engine(backend: str) -> SimpleNamespace:
    """A vLLM config as ``engine_advice`` reads it: one local worker, ``backend``'s
    executor."""
    return SimpleNamespace(parallel_config=SimpleNamespace(
        local_world_size=1, distributed_executor_backend=backend))


@pytest.fixture
def unchosen(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither a reservation nor a thread binding chosen by the operator."""
    monkeypatch.delenv(RESERVED_ENV, raising=False)
    monkeypatch.delenv(BIND_ENV, raising=False)
    return monkeypatch


@pytest.mark.vllm
@requires_vllm
def test_engine_advice_reads_this_process(unchosen: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    from kvoffload.integrations.vllm.cpu_cores import engine_advice

    expected = current_platform.is_cpu() and len(os.sched_getaffinity(0)) <= 2
    assert (engine_advice(_engine("mp")) is not None) is expected
    unchosen.setenv(RESERVED_ENV, "1")
    assert engine_advice(_engine("mp")) is None


@pytest.mark.vllm
@requires_vllm
def test_no_advice_for_an_engine_in_one_process(unchosen: pytest.MonkeyPatch) -> None:
    """vLLM's one-process executor binds no OpenMP threads, so reserves no core."""
    from kvoffload.integrations.vllm.cpu_cores import engine_advice

    assert engine_advice(_engine("uni")) is None
