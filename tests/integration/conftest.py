"""Fixtures of the vLLM integration tests.

The environment is set before anything imports vLLM: the engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and never reaches for the Hugging Face hub
(``HF_HUB_OFFLINE=1``). Tiny models are created once per session under a temporary
directory (``tiny_models.make_model``); nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(name)``: the directory of tiny model ``name``, created on first use."""
    from integration.tiny_models import make_model

    root = tmp_path_factory.mktemp("tiny-models")
    return lambda name: make_model(name, root)
