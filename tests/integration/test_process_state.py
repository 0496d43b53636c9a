"""``save_thread_state`` undoes what vLLM's CPU worker does to the process: a core
affinity narrowed to one core, torch's thread count changed and its setter replaced."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from kvoffload.integrations.vllm.process_state import save_thread_state  # noqa: E402


def test_restore_puts_back_affinity_threads_and_setter() -> None:
    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    setter = torch.set_num_threads
    restore = save_thread_state()
    try:
        os.sched_setaffinity(0, {min(affinity)})
        torch.set_num_threads(threads + 1)
        torch.set_num_threads = lambda n: None  # what vLLM's worker does to the setter
        assert torch.get_num_threads() == threads + 1
    finally:
        restore()
    assert os.sched_getaffinity(0) == affinity
    assert torch.get_num_threads() == threads
    assert torch.set_num_threads is setter


def test_restore_can_run_twice() -> None:
    threads = torch.get_num_threads()
    restore = save_thread_state()
    torch.set_num_threads(threads + 1)
    restore()
    torch.set_num_threads(threads + 2)
    restore()
    assert torch.get_num_threads() == threads
