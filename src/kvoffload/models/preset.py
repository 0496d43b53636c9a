"""A model's cache-holding layers and what derives from them: ``ModelPreset``.

Contract. A ``ModelPreset`` holds the layers of one model that keep a cache, with the real
figures of the published model (of one tensor-parallel rank): its attention layers grouped
by kind (``AttentionLayers``: full attention, or one sliding window each) and its recurrent
layers (``MambaLayers``: Mamba2, Mamba1 or gated delta-net). It is a frozen value, checked
when built, and derives from its layers, without reading anything:

* its layout for one engine block size (``layout`` / ``groups``): the KV-cache groups an
  engine would build, grouped the way vLLM's hybrid allocator does at heart: one group per
  distinct layer kind, full attention first, then sliding windows, widest first, then one
  recurrent group (``kvoffload.models.layout`` holds the result and scales moved pages);
* bytes per token of each attention group and bytes of one Mamba state snapshot;
* prefill FLOPs for a modelled time-to-first-token (``prefill_flops_per_token``,
  ``prefill_flops``).

Page sizes. ``page_bytes`` of a group is what ``GroupSpec`` defines: the bytes of one engine
block of one layer on one rank. Attention: ``block_size * kv_heads * head_dim * 2 (K and V) *
dtype_bytes``. Mamba: one whole state snapshot of one layer (conv state + SSM state).

Where the figures come from. ``kvoffload.models.hf_config`` derives a preset from a model's
config.json fields (a local model's, or a built-in one's in ``presets.json``: the registry
is ``kvoffload.models.presets``). Tensor parallelism is applied there (``--tp``): a preset
derived for N ranks holds one rank's share of the KV and Mamba heads, and every figure here
is then per rank. This module imports no other module of ``kvoffload.models`` but
``layout``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.config import GroupSpec
from kvoffload.errors import ConfigError
from kvoffload.group_kinds import GroupKind
from kvoffload.models.layout import ModelGroup, ModelLayout, scale_pages

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
                bytes (``kvoffload.models.layout``); real sizes are kept for accounting.
        """
        if block_size <= 0:
            raise ConfigError("block_size", f"must be positive, got {block_size}",
                              "Use the engine's block size in tokens, e.g. 16.")
        if scale_bytes is not None and scale_bytes <= 0:
            raise ConfigError("scale_bytes", f"must be positive, got {scale_bytes}",
                              "Give the page size in bytes the smallest group is shrunk to.")
        real: list[ModelGroup] = []
        for a in self._ordered_attention():
            name = (GroupKind.FULL_ATTENTION.value if a.sliding_window is None
                    else f"sliding_window_{a.sliding_window}")
            spec = GroupSpec(kind=a.kind, block_size=block_size,
                             sliding_window=a.sliding_window, num_layers=a.num_layers,
                             page_bytes=a.page_bytes(block_size), name=name)
            real.append(ModelGroup.unscaled(spec, bytes_per_token=a.bytes_per_token))
        if self.mamba is not None:
            m = self.mamba
            spec = GroupSpec(kind=GroupKind.MAMBA, block_size=mamba_block_size or block_size,
                             num_layers=m.num_layers, page_bytes=m.state_bytes_per_layer,
                             name=GroupKind.MAMBA.value)
            real.append(ModelGroup.unscaled(spec, bytes_per_state=m.bytes_per_state))
        return ModelLayout(preset=self, block_size=block_size,
                           groups=scale_pages(real, scale_bytes), scale_bytes=scale_bytes)

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


def _sum_capped(lo: int, hi: int, cap: int | None) -> int:
    """``sum(min(c, cap) for c in range(lo, hi + 1))``; no cap when ``cap`` is None."""
    if hi < lo:
        return 0
    top = hi if cap is None else min(hi, cap)
    total = (lo + top) * (top - lo + 1) // 2 if top >= lo else 0
    if cap is not None and hi > cap:
        total += cap * (hi - max(lo, cap + 1) + 1)
    return total
