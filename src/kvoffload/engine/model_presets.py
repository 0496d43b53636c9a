"""Model presets: real KV-cache dimensions of a few hybrid and non-hybrid models.

A ``ModelPreset`` describes the layers that hold cache (attention layers grouped by kind,
Mamba2 layers) with the real figures of the published model, and derives from them:

* the KV-cache groups an engine would build (``layout`` / ``groups``), grouped the way vLLM's
  hybrid allocator does at heart: one group per distinct layer kind, full attention first,
  then sliding window, then Mamba;
* bytes per token of each attention group and bytes of one Mamba state snapshot;
* prefill FLOPs for a modelled time-to-first-token (``prefill_flops_per_token``,
  ``prefill_flops``).

Page sizes. ``page_bytes`` of a group is what ``GroupSpec`` defines: the bytes of one engine
block of one layer on one rank. Attention: ``block_size * kv_heads * head_dim * 2 (K and V) *
dtype_bytes``. Mamba: one whole state snapshot of one layer (conv state + SSM state).

Scaled layouts. Moving real pages (a Nemotron-H state is ~4 MiB per layer) makes tests and
simulations slow, so ``layout(..., scale_bytes=N)`` shrinks the pages that are *moved*: the
smallest group's page becomes ``N`` bytes and the others keep their ratio to it (rounded up
to 8 bytes). The returned ``ModelLayout`` keeps the real sizes beside the moved ones, so that
accounting (capacity, bytes saved, TTFT) can use the real numbers; ``describe()`` says which.

Tensor parallelism is not modelled here: every figure is for one rank holding all KV heads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from kvoffload.config import GroupKind, GroupSpec
from kvoffload.errors import ConfigError

_PAGE_ALIGN = 8
"""Moved (scaled) pages are rounded up to a multiple of this many bytes."""

MAMBA_SCAN_FLOPS_PER_ELEMENT = 6
"""Approximate FLOPs per SSM-state element per token of a Mamba2 scan (decay, B x outer
product, C readout). A modelling constant: for Nemotron-H-8B it is ~1 % of the total."""


@dataclass(frozen=True)
class AttentionLayers:
    """The attention layers of one kind (full or one sliding window size) of a model.

    Attributes:
        num_layers: layers of this kind.
        num_kv_heads: KV heads per layer (all of them, i.e. one rank without TP).
        head_dim: dimension of one head (K and V have the same size).
        num_q_heads: query heads per layer (drive the attention FLOPs).
        sliding_window: window in tokens for sliding-window layers, None for full attention.
        dtype_bytes: bytes of one KV element (2 for bf16).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int
    sliding_window: int | None = None
    dtype_bytes: int = 2

    @property
    def kind(self) -> GroupKind:
        if self.sliding_window is None:
            return GroupKind.FULL_ATTENTION
        return GroupKind.SLIDING_WINDOW

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer."""
        return self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers of this kind."""
        return self.num_layers * self.bytes_per_token_per_layer

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one engine block of one layer."""
        return block_size * self.bytes_per_token_per_layer

    def attention_flops(self, context_len: int) -> int:
        """FLOPs of QK^T and AV for one query token attending ``context_len`` tokens.

        The window caps the attended span of sliding-window layers.
        """
        span = context_len if self.sliding_window is None else min(context_len,
                                                                   self.sliding_window)
        return self.num_layers * 4 * self.num_q_heads * self.head_dim * span


@dataclass(frozen=True)
class MambaLayers:
    """The Mamba2 layers of a model and the shape of their recurrent state.

    One state snapshot of one layer is the conv state, ``(d_conv - 1) x (d_inner + 2 *
    n_groups * d_state)`` elements, plus the SSM state, ``n_heads x head_dim x d_state``
    elements, with ``d_inner = n_heads * head_dim``.

    Attributes:
        num_layers: Mamba2 layers.
        n_heads: SSM heads.
        head_dim: SSM head dimension.
        n_groups: B/C groups.
        d_state: SSM state dimension.
        d_conv: causal conv kernel width.
        conv_dtype_bytes: bytes of one conv-state element (model dtype).
        ssm_dtype_bytes: bytes of one SSM-state element.
    """

    num_layers: int
    n_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    conv_dtype_bytes: int = 2
    ssm_dtype_bytes: int = 4

    @property
    def d_inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_state_elements(self) -> int:
        return (self.d_conv - 1) * (self.d_inner + 2 * self.n_groups * self.d_state)

    @property
    def ssm_state_elements(self) -> int:
        return self.n_heads * self.head_dim * self.d_state

    @property
    def state_bytes_per_layer(self) -> int:
        """One snapshot of one layer: this is the group's ``page_bytes``."""
        return (self.conv_state_elements * self.conv_dtype_bytes
                + self.ssm_state_elements * self.ssm_dtype_bytes)

    @property
    def bytes_per_state(self) -> int:
        """One snapshot across all Mamba layers."""
        return self.num_layers * self.state_bytes_per_layer

    @property
    def scan_flops_per_token(self) -> int:
        """Approximate SSM scan FLOPs of one token across all Mamba layers."""
        return self.num_layers * MAMBA_SCAN_FLOPS_PER_ELEMENT * self.ssm_state_elements


@dataclass(frozen=True)
class GroupLayout:
    """One KV-cache group of a ``ModelLayout``.

    Attributes:
        spec: the group spec whose ``page_bytes`` is what is *moved* (scaled or real).
        real_page_bytes: bytes of one block of one layer in the real model.
        bytes_per_token: real bytes per token across the group's layers (0 for Mamba).
        bytes_per_state: real bytes of one state snapshot across the group's layers
            (0 for attention groups).
    """

    spec: GroupSpec
    real_page_bytes: int
    bytes_per_token: int
    bytes_per_state: int

    @property
    def is_scaled(self) -> bool:
        return self.spec.page_bytes != self.real_page_bytes

    @property
    def real_block_bytes(self) -> int:
        """Real bytes of one engine block across the group's layers."""
        return self.real_page_bytes * self.spec.num_layers

    @property
    def real_spec(self) -> GroupSpec:
        """The group spec with the real page size."""
        return replace(self.spec, page_bytes=self.real_page_bytes)


@dataclass(frozen=True)
class ModelLayout:
    """A preset laid out for one engine block size.

    ``specs`` are what the worker moves (possibly scaled); ``real_specs`` and the real byte
    figures of each ``GroupLayout`` are what accounting uses.
    """

    preset: ModelPreset
    block_size: int
    groups: tuple[GroupLayout, ...]
    scale_bytes: int | None

    @property
    def specs(self) -> tuple[GroupSpec, ...]:
        """Group specs with the moved page sizes (equal to the real ones when unscaled)."""
        return tuple(g.spec for g in self.groups)

    @property
    def real_specs(self) -> tuple[GroupSpec, ...]:
        """Group specs with the real page sizes."""
        return tuple(g.real_spec for g in self.groups)

    @property
    def is_scaled(self) -> bool:
        return any(g.is_scaled for g in self.groups)

    def describe(self) -> str:
        """A human-readable table of the layout, saying whether moved bytes are scaled."""
        head = (f"{self.preset.name}: block_size {self.block_size} tokens; "
                + ("moved pages SCALED (smallest page -> "
                   f"{self.scale_bytes} B); accounting uses real sizes"
                   if self.is_scaled else "moved pages are the real sizes"))
        lines = [head]
        for i, g in enumerate(self.groups):
            s = g.spec
            what = (f"{g.bytes_per_state} B/state" if s.kind is GroupKind.MAMBA
                    else f"{g.bytes_per_token} B/token")
            window = f" W={s.sliding_window}" if s.sliding_window is not None else ""
            lines.append(f"  group {i} {s.name}{window}: {s.num_layers} layers, "
                         f"block {s.block_size} tokens, page {g.real_page_bytes} B real / "
                         f"{s.page_bytes} B moved, {what}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ModelPreset:
    """Cache-relevant dimensions of one model (see the module docstring).

    Attributes:
        name: registry name, e.g. ``"llama3-8b"``.
        source: where the figures come from.
        num_layers: all decoder layers, including layers without cache (e.g. MLP-only).
        attention: attention layers, one entry per distinct kind (at most one full
            attention entry; sliding-window entries with distinct windows).
        mamba: the Mamba2 layers, or None.
        params_per_token: parameters a token's forward pass multiplies by (active
            parameters, input embedding table excluded; the LM head included).
        assumptions: what was assumed where the source leaves room.
    """

    name: str
    source: str
    num_layers: int
    attention: tuple[AttentionLayers, ...]
    mamba: MambaLayers | None
    params_per_token: int
    assumptions: str = ""

    def __post_init__(self) -> None:
        kinds = [(a.kind, a.sliding_window) for a in self.attention]
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"presets[{self.name}].attention", "repeats a layer kind",
                              "Merge layers of one kind (and one window) into one entry.")
        cache_layers = sum(a.num_layers for a in self.attention)
        cache_layers += self.mamba.num_layers if self.mamba is not None else 0
        if cache_layers == 0 or cache_layers > self.num_layers:
            raise ConfigError(f"presets[{self.name}].num_layers",
                              f"{cache_layers} cache layers do not fit in {self.num_layers}",
                              "Count every decoder layer in num_layers.")

    def _ordered_attention(self) -> list[AttentionLayers]:
        """Full attention first, then sliding windows largest first (vLLM's order)."""
        return sorted(self.attention,
                      key=lambda a: (a.sliding_window is not None, -(a.sliding_window or 0)))

    def layout(self, block_size: int, *, mamba_block_size: int | None = None,
               scale_bytes: int | None = None) -> ModelLayout:
        """Lay the model out for ``block_size``-token engine blocks.

        Args:
            block_size: tokens per engine block of the attention groups.
            mamba_block_size: tokens between Mamba state checkpoints (the Mamba group's
                block size); defaults to ``block_size``.
            scale_bytes: when set, moved pages are scaled so the smallest is this many
                bytes (see the module docstring); real sizes are kept for accounting.
        """
        if block_size <= 0:
            raise ConfigError("block_size", f"must be positive, got {block_size}",
                              "Use the engine's block size in tokens, e.g. 16.")
        if scale_bytes is not None and scale_bytes <= 0:
            raise ConfigError("scale_bytes", f"must be positive, got {scale_bytes}",
                              "Give the page size in bytes the smallest group is shrunk to.")
        raw: list[tuple[GroupSpec, int, int]] = []  # (spec with real page, B/token, B/state)
        for a in self._ordered_attention():
            name = (GroupKind.FULL_ATTENTION.value if a.sliding_window is None
                    else f"sliding_window_{a.sliding_window}")
            spec = GroupSpec(kind=a.kind, block_size=block_size,
                             sliding_window=a.sliding_window, num_layers=a.num_layers,
                             page_bytes=a.page_bytes(block_size), name=name)
            raw.append((spec, a.bytes_per_token, 0))
        if self.mamba is not None:
            m = self.mamba
            spec = GroupSpec(kind=GroupKind.MAMBA, block_size=mamba_block_size or block_size,
                             num_layers=m.num_layers, page_bytes=m.state_bytes_per_layer,
                             name=GroupKind.MAMBA.value)
            raw.append((spec, 0, m.bytes_per_state))
        smallest = min(spec.page_bytes for spec, _, _ in raw)
        groups = []
        for spec, per_token, per_state in raw:
            moved = spec.page_bytes
            if scale_bytes is not None:
                moved = _round_up(math.ceil(spec.page_bytes * scale_bytes / smallest),
                                  _PAGE_ALIGN)
            groups.append(GroupLayout(spec=replace(spec, page_bytes=moved),
                                      real_page_bytes=spec.page_bytes,
                                      bytes_per_token=per_token, bytes_per_state=per_state))
        return ModelLayout(preset=self, block_size=block_size, groups=tuple(groups),
                           scale_bytes=scale_bytes)

    def groups(self, block_size: int, *, mamba_block_size: int | None = None,
               scale_bytes: int | None = None) -> tuple[GroupSpec, ...]:
        """The group specs of ``layout(...)`` (moved page sizes)."""
        return self.layout(block_size, mamba_block_size=mamba_block_size,
                           scale_bytes=scale_bytes).specs

    @property
    def bytes_per_token(self) -> int:
        """K/V bytes of one token over every attention layer (full and windowed)."""
        return sum(a.bytes_per_token for a in self.attention)

    @property
    def bytes_per_state(self) -> int:
        """Bytes of one Mamba state snapshot over every Mamba layer (0 without Mamba)."""
        return self.mamba.bytes_per_state if self.mamba is not None else 0

    def prefill_flops_per_token(self, context_len: int) -> int:
        """FLOPs to prefill one token that attends ``context_len`` tokens (itself included).

        ``2 * params_per_token`` for the matmuls, plus each attention kind's QK^T and AV
        over its (window-capped) span, plus the Mamba scan estimate.
        """
        if context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {context_len}")
        flops = 2 * self.params_per_token
        flops += sum(a.attention_flops(context_len) for a in self.attention)
        if self.mamba is not None:
            flops += self.mamba.scan_flops_per_token
        return flops

    def prefill_flops(self, num_tokens: int, num_computed_tokens: int = 0) -> int:
        """FLOPs to prefill tokens ``[num_computed_tokens, num_tokens)`` of one sequence.

        Equal to the sum of ``prefill_flops_per_token(i + 1)`` over those positions
        (closed form, O(1)).
        """
        if not 0 <= num_computed_tokens <= num_tokens:
            raise ValueError(f"need 0 <= num_computed_tokens ({num_computed_tokens}) <= "
                             f"num_tokens ({num_tokens})")
        n = num_tokens - num_computed_tokens
        if n == 0:
            return 0
        per_token = 2 * self.params_per_token
        if self.mamba is not None:
            per_token += self.mamba.scan_flops_per_token
        flops = n * per_token
        for a in self.attention:
            span = _sum_capped(num_computed_tokens + 1, num_tokens, a.sliding_window)
            flops += a.num_layers * 4 * a.num_q_heads * a.head_dim * span
        return flops

    def describe(self) -> str:
        """Figures, source and assumptions of the preset."""
        parts = [f"{self.name} ({self.source}): {self.num_layers} layers, "
                 f"{self.params_per_token / 1e9:.2f}e9 params/token"]
        for a in self._ordered_attention():
            kind = "full" if a.sliding_window is None else f"sliding {a.sliding_window}"
            parts.append(f"  {a.num_layers} x {kind} attention: {a.num_kv_heads} kv heads x "
                         f"{a.head_dim}, {a.dtype_bytes} B/elem, {a.bytes_per_token} B/token")
        if self.mamba is not None:
            m = self.mamba
            parts.append(f"  {m.num_layers} x Mamba2: conv state {m.conv_state_elements} x "
                         f"{m.conv_dtype_bytes} B + ssm state {m.ssm_state_elements} x "
                         f"{m.ssm_dtype_bytes} B = {m.state_bytes_per_layer} B/layer, "
                         f"{m.bytes_per_state} B/state")
        if self.assumptions:
            parts.append(f"  assumptions: {self.assumptions}")
        return "\n".join(parts)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _sum_capped(lo: int, hi: int, cap: int | None) -> int:
    """``sum(min(c, cap) for c in range(lo, hi + 1))``; no cap when ``cap`` is None."""
    if hi < lo:
        return 0
    top = hi if cap is None else min(hi, cap)
    total = (lo + top) * (top - lo + 1) // 2 if top >= lo else 0
    if cap is not None and hi > cap:
        total += cap * (hi - max(lo, cap + 1) + 1)
    return total


LLAMA3_8B = ModelPreset(
    name="llama3-8b",
    source="meta-llama/Meta-Llama-3-8B config: 32 layers, hidden 4096, 32 q / 8 kv heads, "
           "head_dim 128, vocab 128256",
    num_layers=32,
    attention=(AttentionLayers(num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32),),
    mamba=None,
    params_per_token=7_504_924_672,
    assumptions="bf16 KV cache; params_per_token = 8,030,261,248 total minus the "
                "525,336,576 input embedding (the untied LM head is counted).",
)

GPT_OSS_20B = ModelPreset(
    name="gpt-oss-20b",
    source="openai/gpt-oss-20b config: 24 layers alternating sliding_attention (window 128) "
           "/ full_attention, hidden 2880, 64 q / 8 kv heads, head_dim 64, MoE 32 experts top-4",
    num_layers=24,
    attention=(
        AttentionLayers(num_layers=12, num_kv_heads=8, head_dim=64, num_q_heads=64),
        AttentionLayers(num_layers=12, num_kv_heads=8, head_dim=64, num_q_heads=64,
                        sliding_window=128),
    ),
    mamba=None,
    params_per_token=3_031_000_000,
    assumptions="bf16 KV cache (weights are MXFP4, the cache is not); attention sinks add no "
                "cache; params_per_token = 3.61e9 active (model card, embedding and "
                "unembedding included) minus the 0.579e9 input embedding (201088 x 2880).",
)

GEMMA3_27B = ModelPreset(
    name="gemma3-27b",
    source="google/gemma-3-27b config: 62 layers, sliding_window_pattern 6 (5 local of 1024 "
           "per global; layers 5, 11, ..., 59 global), hidden 5376, 32 q / 16 kv heads, "
           "head_dim 128",
    num_layers=62,
    attention=(
        AttentionLayers(num_layers=10, num_kv_heads=16, head_dim=128, num_q_heads=32),
        AttentionLayers(num_layers=52, num_kv_heads=16, head_dim=128, num_q_heads=32,
                        sliding_window=1024),
    ),
    mamba=None,
    params_per_token=27_010_000_000,
    assumptions="bf16 KV cache; text model only (the 0.4B vision encoder is not counted); "
                "params_per_token = 25.6e9 non-embedding (tech report) + 1.41e9 tied LM head.",
)

NEMOTRON_H_8B = ModelPreset(
    name="nemotron-h-8b",
    source="nvidia/Nemotron-H-8B-Base-8K config: 52 layers, pattern "
           "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M- (24 Mamba2, 4 attention, "
           "24 MLP), hidden 4096, 32 q / 8 kv heads, head_dim 128, Mamba2 128 heads x 64, "
           "8 groups, d_state 128, d_conv 4",
    num_layers=52,
    attention=(AttentionLayers(num_layers=4, num_kv_heads=8, head_dim=128, num_q_heads=32),),
    mamba=MambaLayers(num_layers=24, n_heads=128, head_dim=64, n_groups=8, d_state=128,
                      d_conv=4, conv_dtype_bytes=2, ssm_dtype_bytes=4),
    params_per_token=7_563_981_824,
    assumptions="the 24 MLP layers hold no cache; conv state in bf16 (model dtype); SSM "
                "state in fp32 (vLLM's NemotronH default mamba_ssm_cache_dtype); "
                "params_per_token = 8,100,852,736 total minus the 536,870,912 input "
                "embedding (the untied LM head is counted).",
)

PRESETS: Mapping[str, ModelPreset] = MappingProxyType(
    {p.name: p for p in (LLAMA3_8B, GPT_OSS_20B, GEMMA3_27B, NEMOTRON_H_8B)})
"""Every built-in preset by name."""


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; ``ConfigError`` listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("model", f"unknown preset {name!r}",
                          f"Choose one of: {', '.join(sorted(PRESETS))}.") from None
