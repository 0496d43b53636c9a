"""kvoffload as a vLLM KV connector (vLLM 0.32.x to 0.34.x; see ``docs/vllm.md``).

Use it with one flag::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"host_memory_bytes": "8GiB"}}'

Importing this package does not import vLLM; ``KVOffloadConnector`` (which needs it) is
loaded on first access, so ``options`` and ``version`` stay usable without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffload.integrations.vllm.version import SUPPORTED_VLLM

if TYPE_CHECKING:
    from kvoffload.integrations.vllm.connector import KVOffloadConnector

__all__ = ["SUPPORTED_VLLM", "KVOffloadConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVOffloadConnector":
        from kvoffload.integrations.vllm.connector import KVOffloadConnector

        return KVOffloadConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
