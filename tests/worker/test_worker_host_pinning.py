"""Page-locking the host arena in place (``cudaHostRegister``) at its exact size, and the
fallback to torch's pinned allocator. The CUDA runtime is stood in for here; on a GPU,
tests/gpu checks that the arena really is pinned (``Tensor.is_pinned``)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

from kvoffload.worker import host_pool
from kvoffload.worker.host_pool import allocate_arena


class Runtime:
    """Records the registrations a CUDA runtime would be asked for."""

    def __init__(self, error: int = 0) -> None:
        self.error = error
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append((ptr, size, flags))
        return self.error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_the_arena_is_registered_at_its_exact_size_and_unregistered_when_collected(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Runtime()
    monkeypatch.setattr(host_pool, "_cudart", lambda: runtime)
    arena, pinned = allocate_arena((33, 4097), True)
    assert pinned and arena.shape == (33, 4097)
    ptr = arena.data_ptr()
    assert runtime.registered == [(ptr, 33 * 4097, 1)]  # exact (no power of two), portable
    del arena
    gc.collect()
    assert runtime.unregistered == [ptr]


@pytest.mark.parametrize("runtime", ["error", "missing"])
def test_without_registration_torch_pinned_allocation_is_used_and_said(
        runtime: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    failing = Runtime(error=1)

    def cudart() -> Any:
        if runtime == "missing":
            raise RuntimeError("no CUDA runtime")
        return failing

    fallback: list[tuple[int, int]] = []
    cleared: list[bool] = []

    def torch_pinned(shape: tuple[int, int]) -> torch.Tensor:
        fallback.append(shape)
        return torch.zeros(shape, dtype=torch.uint8)

    monkeypatch.setattr(host_pool, "_torch_pinned", torch_pinned)
    monkeypatch.setattr(host_pool, "_cudart", cudart)
    monkeypatch.setattr(host_pool, "_clear_cuda_error", lambda: cleared.append(True))
    with caplog.at_level(logging.WARNING):
        arena, pinned = allocate_arena((3, 5), True)
    assert pinned and fallback == [(3, 5)] and arena.shape == (3, 5)
    # A refused registration leaves an error behind in the runtime: it is cleared.
    assert cleared == ([True] if runtime == "error" else [])
    assert "may reserve up to twice" in caplog.text
    assert failing.unregistered == []


def test_an_unpinned_arena_asks_nothing_of_the_runtime(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Runtime()
    monkeypatch.setattr(host_pool, "_cudart", lambda: runtime)
    arena, pinned = allocate_arena((2, 8), False)
    assert not pinned and arena.shape == (2, 8) and runtime.registered == []

