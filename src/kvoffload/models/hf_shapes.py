"""Bytes, shapes and parameter counts of one model's layers, for one tensor-parallel rank.

``attention_shape`` / ``state_shape`` read a family's attention and recurrent-state
dimensions from its config, ``split_attention`` / ``split_state`` give one rank's share
(``ConfigError`` when the rank count does not fit the model), ``model_dtype`` /
``ssm_dtype`` the element sizes, and ``count_params`` the weights one token multiplies by.
``kvoffload.models.hf_config.derive_preset`` puts them together into a ``ModelPreset``.

What each kind of layer holds, per layer and rank (``dtype`` bytes per element):

=====================  =================================================================
full / sliding window  ``2 * kv_heads * head_dim`` per token (K and V)
MLA (DeepSeek)         ``kv_lora_rank + qk_rope_head_dim`` per token (one latent, no
                       per-head K/V; replicated on every rank)
Mamba2                 conv ``(d_conv - 1) x (d_inner + 2 * n_groups * d_state)`` + SSM
                       ``heads x head_dim x d_state`` per state
Mamba1 (Jamba)         conv ``(d_conv - 1) x d_inner`` + SSM ``d_inner x d_state``
gated delta-net        conv ``(kernel - 1) x (2 * k_heads * k_dim + v_heads * v_dim)`` +
(Qwen3-Next)           recurrent ``v_heads x v_dim x k_dim``
=====================  =================================================================

Dtypes follow vLLM's defaults (``--dtype auto``, ``--kv-cache-dtype auto``): the cache and
the conv state take the model's dtype (``dtype`` / ``torch_dtype``, bf16 when absent; a
float32 checkpoint runs in bf16); the SSM state too, except Nemotron-H's, which is float32
(the config's ``mamba_ssm_cache_dtype``, else vLLM's NemotronH default).

Tensor parallelism (``tensor_parallel``, vLLM's rules): KV heads are split across ranks
and replicated when there are fewer than ranks (at least one per rank; the rank count must
then be a multiple of the head count); query heads, Mamba heads (and d_inner), gated
delta-net key and value heads must divide by the rank count; Mamba2 B/C groups are split,
or replicated when there is one; an MLA latent is kept whole on every rank. Every figure of
the result is one rank's, its prefill FLOPs included (each rank runs 1/N of every matmul;
communication is not modelled).

Prefill FLOPs. ``params_per_token`` counts the weights one token multiplies by: every
projection of each layer's attention (GQA, gated-query, MLA) or recurrent mixer (in/out
projections, conv, and Mamba2's small per-head vectors), its MLP (gated ``3 x hidden x
intermediate``; Nemotron-H's ReLU^2 ``2 x``; a MoE layer's router, its
``num_experts_per_tok`` routed experts and its shared experts), one RMSNorm weight per
sub-block (two per layer, one in Nemotron-H's single-mixer layers), the final norm and the
LM head (tied or not: its matmul runs); the input embedding is a lookup and is left out.
Approximations: biases, QK-norms, Gemma's extra post-norms, gpt-oss's attention sinks and
multi-token-prediction layers are not counted (well under 1 % of a model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.errors import ConfigError
from kvoffload.models.hf_families import DENSE_MIXER, Family, family_of
from kvoffload.models.hf_fields import ModelFields, dtype_bytes


def model_dtype(f: ModelFields, override: str | None) -> tuple[int, str]:
    """(bytes, name) of the dtype the engine runs the model in."""
    if override is not None:
        return dtype_bytes(override, "dtype"), str(override)
    value = f.top("dtype") or f.top("torch_dtype")
    if value is None:
        return 2, "bfloat16 (the config names no dtype)"
    name = str(value).removeprefix("torch.")
    size = dtype_bytes(value, f"{f.where}: dtype", float32_runs_as=2)
    if name in ("float32", "float"):
        return size, "bfloat16 (float32 checkpoint, run in 16 bits as vLLM's --dtype auto does)"
    return size, name


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's heads (all ranks, or one rank's after ``split_attention``)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    latent: int | None = None  # MLA: kv_lora_rank + qk_rope_head_dim
    v_head_dim: int | None = None


def attention_shape(f: ModelFields, family: Family) -> AttentionShape:
    """The attention heads of ``f`` (an MLA family: one latent per token, no KV heads);
    ``ConfigError`` naming a missing field."""
    q = f.num("num_attention_heads")
    if family.mixer == "mla":
        rope, nope = f.num("qk_rope_head_dim"), f.num("qk_nope_head_dim")
        return AttentionShape(q_heads=q, kv_heads=1, head_dim=rope + nope,
                          latent=f.num("kv_lora_rank") + rope, v_head_dim=f.num("v_head_dim"))
    kv = f.opt_num("num_key_value_heads") or q
    head_dim = f.opt_num("head_dim", "attention_head_dim")
    if head_dim is None:
        hidden = f.num("hidden_size")
        if hidden % q:
            raise f.missing("head_dim")
        head_dim = hidden // q
    return AttentionShape(q_heads=q, kv_heads=kv, head_dim=head_dim)


@dataclass(frozen=True)
class StateShape:
    """One recurrent layer's state dimensions (all ranks, or one rank's after
    ``split_state``); ``variant`` is ``mamba2``, ``mamba1`` or ``gated_delta_net``."""

    variant: str
    heads: int       # Mamba2 heads; Mamba1 d_inner; gated delta-net value heads
    head_dim: int    # Mamba2 head dim; 1; value head dim
    groups: int      # B/C groups; 0; key heads
    d_state: int     # SSM state; SSM state; key head dim
    d_conv: int


def state_shape(f: ModelFields, family: Family) -> StateShape:
    """The recurrent state of ``f``'s ``linear_attention`` / ``hybrid`` layers (its family
    has a recurrent mixer); ``ConfigError`` for a missing or inconsistent field."""
    mt, hidden = f.model_type, f.num("hidden_size")
    if family.mixer == "mamba1":
        return StateShape("mamba1", f.num("mamba_expand") * hidden, 1, 0, f.num("mamba_d_state"),
                      f.num("mamba_d_conv"))
    if family.mixer == "gated_delta_net":
        return StateShape("gated_delta_net", f.num("linear_num_value_heads"),
                      f.num("linear_value_head_dim"), f.num("linear_num_key_heads"),
                      f.num("linear_key_head_dim"), f.num("linear_conv_kernel_dim"))
    if mt == "nemotron_h":
        return StateShape("mamba2", f.num("mamba_num_heads"), f.num("mamba_head_dim"),
                      f.num("n_groups", "mamba_n_groups"), f.num("ssm_state_size"),
                      f.num("conv_kernel", "mamba_d_conv"))
    heads = f.num("mamba_n_heads")
    d_inner = (f.opt_num("mamba_d_ssm") if mt == "falcon_h1" else None) \
        or f.num("mamba_expand") * hidden
    head_dim = f.get("mamba_d_head", "auto")
    head_dim = d_inner // heads if head_dim == "auto" else f.num("mamba_d_head")
    if heads * head_dim != d_inner:
        raise ConfigError(f"{f.where}: mamba_d_head",
                          f"{heads} heads x {head_dim} is not the Mamba width {d_inner}",
                          "Correct the config (see the model's published config.json).")
    return StateShape("mamba2", heads, head_dim, f.num("mamba_n_groups"), f.num("mamba_d_state"),
                  f.num("mamba_d_conv"))


def ssm_dtype(f: ModelFields, model_bytes: int) -> tuple[int, str]:
    """The SSM state's dtype: the model's, except Nemotron-H's (vLLM reads its config's
    ``mamba_ssm_cache_dtype``, float32 by default, whatever ``--dtype`` says)."""
    if f.model_type == "nemotron_h":
        name = f.get("mamba_ssm_cache_dtype", "float32")
        return (dtype_bytes(name, f"{f.where}: mamba_ssm_cache_dtype"),
                f"{name} (Nemotron-H's mamba_ssm_cache_dtype)")
    return model_bytes, "in the model dtype"


def _divide(total: int, tp: int, what: str, name: str) -> int:
    if total % tp:
        raise ConfigError("tensor_parallel",
                          f"{name}: {tp} ranks do not divide its {total} {what}",
                          f"Use a rank count that divides {total} "
                          f"(e.g. {', '.join(str(d) for d in _divisors(total))}).")
    return total // tp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0][:6]


def _kv_heads_per_rank(kv: int, tp: int, name: str) -> int:
    """vLLM: KV heads split across ranks; fewer heads than ranks are replicated."""
    if kv >= tp:
        return _divide(kv, tp, "KV heads", name)
    if tp % kv:
        raise ConfigError("tensor_parallel",
                          f"{name}: {tp} ranks cannot share its {kv} KV heads (vLLM "
                          "replicates them only when the rank count is a multiple)",
                          f"Use a rank count that divides {kv} or is a multiple of it.")
    return 1


def split_attention(a: AttentionShape, tp: int, name: str) -> AttentionShape:
    """One of ``tp`` ranks' share of ``a`` (module docstring); ``ConfigError`` naming
    model ``name`` when the ranks do not divide its heads."""
    if tp == 1:
        return a
    q = _divide(a.q_heads, tp, "attention heads", name)
    kv = a.kv_heads if a.latent is not None else _kv_heads_per_rank(a.kv_heads, tp, name)
    return AttentionShape(q, kv, a.head_dim, a.latent, a.v_head_dim)


def split_state(s: StateShape, tp: int, name: str) -> StateShape:
    """One of ``tp`` ranks' share of ``s`` (module docstring); ``ConfigError`` naming
    model ``name`` when the ranks do not divide its heads or groups."""
    if tp == 1:
        return s
    if s.variant == "mamba1":
        return StateShape(s.variant, _divide(s.heads, tp, "Mamba channels (d_inner)", name), 1, 0,
                      s.d_state, s.d_conv)
    if s.variant == "gated_delta_net":
        return StateShape(s.variant, _divide(s.heads, tp, "linear-attention value heads", name),
                      s.head_dim, _divide(s.groups, tp, "linear-attention key heads", name),
                      s.d_state, s.d_conv)
    heads = _divide(s.heads, tp, "Mamba heads", name)
    if s.groups % tp == 0:
        groups = s.groups // tp
    elif s.groups == 1:
        groups = 1  # vLLM replicates a single group on every rank
    else:
        raise ConfigError("tensor_parallel",
                          f"{name}: {tp} ranks do not divide its {s.groups} Mamba groups",
                          f"Use a rank count that divides {s.groups}.")
    return StateShape(s.variant, heads, s.head_dim, groups, s.d_state, s.d_conv)


def _attention_params(h: int, a: AttentionShape, f: ModelFields, gated_query: bool) -> int:
    if a.latent is not None:  # MLA
        rope = f.num("qk_rope_head_dim")
        kv_lora = a.latent - rope
        v = a.v_head_dim or a.head_dim
        q_lora = f.opt_num("q_lora_rank")
        q = (h * a.q_heads * a.head_dim if q_lora is None
             else h * q_lora + q_lora * a.q_heads * a.head_dim)
        return (q + h * a.latent + kv_lora * a.q_heads * (a.head_dim - rope + v)
                + a.q_heads * v * h)
    q_out = a.q_heads * a.head_dim
    return h * q_out * (2 if gated_query else 1) + 2 * h * a.kv_heads * a.head_dim + q_out * h


def _state_params(h: int, s: StateShape, f: ModelFields) -> int:
    if s.variant == "mamba1":
        d_inner = s.heads
        rank = f.get("mamba_dt_rank", "auto")
        rank = math.ceil(h / 16) if rank == "auto" else f.num("mamba_dt_rank")
        return (h * 2 * d_inner + d_inner * (s.d_conv + 1) + d_inner * (rank + 2 * s.d_state)
                + rank * d_inner + d_inner + d_inner * s.d_state + d_inner + d_inner * h)
    if s.variant == "gated_delta_net":
        key, value = s.groups * s.d_state, s.heads * s.head_dim
        return (h * (2 * key + 2 * value) + h * 2 * s.heads + (2 * key + value) * s.d_conv
                + 2 * s.heads + s.head_dim + value * h)
    d_inner = s.heads * s.head_dim
    conv = d_inner + 2 * s.groups * s.d_state
    # in_proj (gate, x/B/C, dt), conv weight and bias, A/D/dt_bias, gated norm, out_proj
    return h * (d_inner + conv + s.heads) + conv * (s.d_conv + 1) + 3 * s.heads + d_inner \
        + d_inner * h


def count_params(f: ModelFields, kinds: Sequence[str]) -> int:
    """Parameters one token multiplies by, the whole model (module docstring)."""
    family = family_of(f.model_type, f.architectures, f.where)
    h = f.num("hidden_size")
    attention = attention_shape(f, family)
    state = state_shape(f, family) if family.mixer not in (DENSE_MIXER, "mla") else None
    attn = _attention_params(h, attention, f, family.gated_query)
    mixer = _state_params(h, state, f) if state is not None else 0
    total = 0
    for i, kind in enumerate(kinds):
        if kind in ("full_attention", "sliding_attention", "hybrid"):
            total += attn
        if kind in ("linear_attention", "hybrid"):
            total += mixer
        total += family.mlp(f, i, kind) + family.norms_per_layer * h
    return total + h + f.num("vocab_size") * h
