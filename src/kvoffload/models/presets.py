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

Where the figures come from. The built-in presets are data: ``presets.json`` holds the
public config.json fields of each model, and ``kvoffload.models.hf_config`` derives the
preset from them exactly as it derives one from a local model's own config (``--model``).
Tensor parallelism is applied there too (``--tp``): a preset derived for N ranks holds one
rank's share of the KV and Mamba heads, and every figure below is then per rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from kvoffload.config import GroupKind, GroupSpec
from kvoffload.errors import ConfigError
from kvoffload.models import hf_config

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
        num_kv_heads: KV heads per layer (of one rank: all of them without TP).
        head_dim: dimension of one head (K and V have the same size unless ``v_head_dim``
            says otherwise).
        num_q_heads: query heads per layer (drive the attention FLOPs).
        sliding_window: window in tokens for sliding-window layers, None for full attention.
        dtype_bytes: bytes of one KV element (2 for bf16).
        kv_latent_dim: multi-head latent attention (DeepSeek MLA): each token keeps one
            latent vector of this many elements per layer (``kv_lora_rank +
            qk_rope_head_dim``) instead of K and V per KV head; None for ordinary attention.
        v_head_dim: dimension of one value head where it differs from ``head_dim`` (MLA
            prefill attends with ``head_dim``-wide queries and keys and ``v_head_dim``-wide
            values); only the FLOPs use it.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int
    sliding_window: int | None = None
    dtype_bytes: int = 2
    kv_latent_dim: int | None = None
    v_head_dim: int | None = None

    @property
    def kind(self) -> GroupKind:
        if self.sliding_window is None:
            return GroupKind.FULL_ATTENTION
        return GroupKind.SLIDING_WINDOW

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer (MLA: its one latent vector)."""
        if self.kv_latent_dim is not None:
            return self.kv_latent_dim * self.dtype_bytes
        return self.num_kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers of this kind."""
        return self.num_layers * self.bytes_per_token_per_layer

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one engine block of one layer."""
        return block_size * self.bytes_per_token_per_layer

    @property
    def flops_per_attended_token(self) -> int:
        """FLOPs of QK^T and AV, over every layer of this kind, for one query token and one
        attended token: ``2 * q_heads * (head_dim + v_head_dim)`` per layer."""
        v_dim = self.head_dim if self.v_head_dim is None else self.v_head_dim
        return self.num_layers * 2 * self.num_q_heads * (self.head_dim + v_dim)

    def attention_flops(self, context_len: int) -> int:
        """FLOPs of QK^T and AV for one query token attending ``context_len`` tokens.

        The window caps the attended span of sliding-window layers.
        """
        span = context_len if self.sliding_window is None else min(context_len,
                                                                   self.sliding_window)
        return self.flops_per_attended_token * span


MAMBA_VARIANTS = {"mamba2": "Mamba2", "mamba1": "Mamba1", "gated_delta_net": "gated delta-net"}
"""The recurrent layers a ``MambaLayers`` describes, by ``variant``, with their labels."""


@dataclass(frozen=True)
class MambaLayers:
    """The recurrent (state-holding) layers of a model and the shape of their state.

    One state snapshot of one layer is the conv state, ``(d_conv - 1) x (d_inner + 2 *
    n_groups * d_state)`` elements, plus the SSM state, ``n_heads x head_dim x d_state``
    elements, with ``d_inner = n_heads * head_dim``: Mamba2's shapes as vLLM allocates them.

    Two other recurrent layers have states of the same form, and vLLM keeps all three in
    one Mamba group (``variant`` only changes the labels):

    * Mamba1 (Jamba), ``MambaLayers.mamba1``: conv state ``(d_conv - 1) x d_inner`` and
      SSM state ``d_inner x d_state``: ``n_heads = d_inner``, ``head_dim = 1``,
      ``n_groups = 0``.
    * Gated delta-net linear attention (Qwen3-Next), ``MambaLayers.gated_delta_net``: conv
      state ``(kernel - 1) x (2 * k_heads * k_dim + v_heads * v_dim)`` and recurrent state
      ``v_heads x v_dim x k_dim``: ``n_heads = v_heads``, ``head_dim = v_dim``,
      ``n_groups = k_heads``, ``d_state = k_dim``.

    Attributes:
        num_layers: recurrent layers.
        n_heads: SSM heads (of one rank).
        head_dim: SSM head dimension.
        n_groups: B/C groups (of one rank).
        d_state: SSM state dimension.
        d_conv: causal conv kernel width.
        conv_dtype_bytes: bytes of one conv-state element (model dtype).
        ssm_dtype_bytes: bytes of one SSM-state element.
        variant: ``mamba2``, ``mamba1`` or ``gated_delta_net`` (``MAMBA_VARIANTS``).
    """

    num_layers: int
    n_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    conv_dtype_bytes: int = 2
    ssm_dtype_bytes: int = 4
    variant: str = "mamba2"

    def __post_init__(self) -> None:
        if self.variant not in MAMBA_VARIANTS:
            raise ConfigError("mamba.variant", f"unknown variant {self.variant!r}",
                              f"Use one of {', '.join(MAMBA_VARIANTS)}.")

    @classmethod
    def mamba1(cls, *, num_layers: int, d_inner: int, d_state: int, d_conv: int,
               conv_dtype_bytes: int = 2, ssm_dtype_bytes: int = 2) -> MambaLayers:
        """Mamba1 layers: conv state ``(d_conv - 1) x d_inner``, SSM ``d_inner x d_state``."""
        return cls(num_layers=num_layers, n_heads=d_inner, head_dim=1, n_groups=0,
                   d_state=d_state, d_conv=d_conv, conv_dtype_bytes=conv_dtype_bytes,
                   ssm_dtype_bytes=ssm_dtype_bytes, variant="mamba1")

    @classmethod
    def gated_delta_net(cls, *, num_layers: int, num_k_heads: int, num_v_heads: int,
                        k_head_dim: int, v_head_dim: int, conv_kernel: int,
                        conv_dtype_bytes: int = 2, ssm_dtype_bytes: int = 2) -> MambaLayers:
        """Gated delta-net layers: conv state ``(conv_kernel - 1) x (2 * k_heads * k_dim +
        v_heads * v_dim)``, recurrent state ``v_heads x v_dim x k_dim``."""
        return cls(num_layers=num_layers, n_heads=num_v_heads, head_dim=v_head_dim,
                   n_groups=num_k_heads, d_state=k_head_dim, d_conv=conv_kernel,
                   conv_dtype_bytes=conv_dtype_bytes, ssm_dtype_bytes=ssm_dtype_bytes,
                   variant="gated_delta_net")

    @property
    def label(self) -> str:
        return MAMBA_VARIANTS[self.variant]

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
        name: registry name, e.g. ``"llama3-8b"`` (``"...@tp2"`` for one of two ranks).
        source: where the figures come from.
        num_layers: all decoder layers, including layers without cache (e.g. MLP-only).
        attention: attention layers, one entry per distinct kind (at most one full
            attention entry; sliding-window entries with distinct windows).
        mamba: the recurrent (Mamba2, Mamba1 or gated delta-net) layers, or None.
        params_per_token: parameters a token's forward pass multiplies by (active
            parameters, input embedding table excluded; the LM head included), of one rank.
        assumptions: what was assumed where the source leaves room.
        family: the architecture family, e.g. ``"Nemotron-H (Mamba2 hybrid)"``.
        tensor_parallel: ranks the model is split over; every figure is of one rank.
    """

    name: str
    source: str
    num_layers: int
    attention: tuple[AttentionLayers, ...]
    mamba: MambaLayers | None
    params_per_token: int
    assumptions: str = ""
    family: str = ""
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        kinds = [(a.kind, a.sliding_window) for a in self.attention]
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"presets[{self.name}].attention", "repeats a layer kind",
                              "Merge layers of one kind (and one window) into one entry.")
        # A parallel hybrid (Falcon-H1) holds an attention and a Mamba layer in one decoder
        # layer, so each kind fits in num_layers on its own.
        attention_layers = sum(a.num_layers for a in self.attention)
        mamba_layers = self.mamba.num_layers if self.mamba is not None else 0
        if attention_layers + mamba_layers == 0 or max(attention_layers,
                                                       mamba_layers) > self.num_layers:
            raise ConfigError(f"presets[{self.name}].num_layers",
                              f"{attention_layers} attention and {mamba_layers} Mamba layers "
                              f"do not fit in {self.num_layers}",
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
            flops += a.flops_per_attended_token * span
        return flops

    def describe(self) -> str:
        """Figures, source and assumptions of the preset."""
        rank = (f", figures of one of {self.tensor_parallel} tensor-parallel ranks"
                if self.tensor_parallel > 1 else "")
        parts = [f"{self.name} ({self.source}): {self.num_layers} layers, "
                 f"{self.params_per_token / 1e9:.2f}e9 params/token{rank}"]
        for a in self._ordered_attention():
            kind = "full" if a.sliding_window is None else f"sliding {a.sliding_window}"
            heads = (f"one latent of {a.kv_latent_dim}" if a.kv_latent_dim is not None
                     else f"{a.num_kv_heads} kv heads x {a.head_dim}")
            parts.append(f"  {a.num_layers} x {kind} attention: {heads}, "
                         f"{a.dtype_bytes} B/elem, {a.bytes_per_token} B/token")
        if self.mamba is not None:
            m = self.mamba
            parts.append(f"  {m.num_layers} x {m.label}: conv state {m.conv_state_elements} x "
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


PRESETS: Mapping[str, ModelPreset] = MappingProxyType(hf_config.builtin_presets())
"""Every built-in preset by name: ``presets.json`` derived by ``hf_config`` (one code path
with ``--model``)."""

LLAMA3_8B = PRESETS["llama3-8b"]
GPT_OSS_20B = PRESETS["gpt-oss-20b"]
GEMMA3_27B = PRESETS["gemma3-27b"]
NEMOTRON_H_8B = PRESETS["nemotron-h-8b"]


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; ``ConfigError`` listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("model", f"unknown preset {name!r}",
                          f"Choose one of: {', '.join(sorted(PRESETS))}.") from None
