"""Workloads for the reference engine: the request type, a Mooncake trace reader and
built-in synthetic generators (multi-turn chat, shared system prompt, agentic)."""

from kvoffload.workloads.generators import (
    BUILTIN_WORKLOADS,
    DEFAULT_WORKLOAD,
    AgenticWorkload,
    ChatWorkload,
    SharedPrefixWorkload,
    builtin_workload,
    default_size,
    size_unit,
)
from kvoffload.workloads.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    count_trace_lines,
    mooncake_block_tokens,
    open_trace_file,
    read_mooncake_trace,
)
from kvoffload.workloads.request import (
    TokenIds,
    WorkloadRequest,
    as_token_ids,
    derive_tokens,
)

__all__ = [
    "BUILTIN_WORKLOADS",
    "DEFAULT_WORKLOAD",
    "MOONCAKE_BLOCK_TOKENS",
    "AgenticWorkload",
    "ChatWorkload",
    "SharedPrefixWorkload",
    "TokenIds",
    "WorkloadRequest",
    "as_token_ids",
    "builtin_workload",
    "count_trace_lines",
    "default_size",
    "derive_tokens",
    "mooncake_block_tokens",
    "open_trace_file",
    "read_mooncake_trace",
    "size_unit",
]
