"""Architecture families and per-layer kinds of the models kvoffload derives layouts for.

``FAMILIES`` maps each known ``model_type`` to a ``Family``: what its cache-holding layers
are (its mixer), how many MLP parameters each layer multiplies a token by, and its norms.
``layer_types(f)`` lists each decoder layer's kind (``LAYER_KINDS``) as vLLM builds the
model; a config read as data has its older layer-pattern fields (Gemma's
``sliding_window_pattern``, Nemotron-H's ``hybrid_override_pattern``, Jamba's
``attn_layer_period``, Qwen3-Next's ``full_attention_interval``) read by the rules of each
family's ``transformers`` config class (``_data_layer_types``). An unknown ``model_type`` or
layer kind is a one-line ``ConfigError``.

To add a family: a ``Family`` in ``FAMILIES`` (its mixer and MLP parameter rule) and, if its
config spells its layer pattern another way, the rule in ``_data_layer_types``
(docs/models.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.errors import SHOWN_CHARS, ConfigError, shown
from kvoffload.models.hf_fields import ModelFields

LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention", "hybrid", "mlp",
               "moe")
"""Per-layer kinds, as ``transformers`` names them in ``layer_types``: ``linear_attention``
is a recurrent layer (Mamba or gated delta-net), ``hybrid`` a layer holding attention and a
Mamba mixer side by side (Falcon-H1), ``mlp`` / ``moe`` a layer without a cache."""

_LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}
"""Older spellings of ``layer_types`` entries (Granite 4.0's, Jamba's)."""

_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
"""Nemotron-H's ``hybrid_override_pattern`` characters."""


@dataclass(frozen=True)
class Family:
    """How kvoffload reads one architecture family's config.

    Attributes:
        label: the family as ``kvoffload presets`` shows it.
        mixer: what its cache-holding layers are: ``attention``, ``mla`` (attention layers
            only), or the recurrent kind of its ``linear_attention`` / ``hybrid`` layers
            (``mamba2``, ``mamba1``, ``gated_delta_net``).
        mlp: active MLP parameters of layer ``i`` of kind ``kind``.
        norms_per_layer: RMSNorm weights (of ``hidden_size``) per decoder layer.
        gated_query: the query projection also produces an output gate (Qwen3-Next).
    """

    label: str
    mixer: str
    mlp: Callable[[ModelFields, int, str], int]
    norms_per_layer: int = 2
    gated_query: bool = False


def _dense_mlp(f: ModelFields, i: int, kind: str) -> int:
    del i, kind
    return 3 * f.num("hidden_size") * f.num("intermediate_size")


def _moe(f: ModelFields, *, experts: int, top_k: int, inter: int, shared: int = 0,
         gated: bool = True) -> int:
    """A MoE layer: the router, ``top_k`` routed experts and the shared experts."""
    h = f.num("hidden_size")
    per = 3 if gated else 2
    return h * experts + top_k * per * h * inter + per * h * shared


def _gpt_oss_mlp(f: ModelFields, i: int, kind: str) -> int:
    del i, kind
    return _moe(f, experts=f.num("num_local_experts"),
                top_k=f.num("num_experts_per_tok", "experts_per_token"),
                inter=f.num("intermediate_size"))


def _mixtral_mlp(f: ModelFields, i: int, kind: str) -> int:
    del i, kind
    return _moe(f, experts=f.num("num_local_experts"), top_k=f.num("num_experts_per_tok"),
                inter=f.num("intermediate_size"))


def _qwen_sparse(f: ModelFields, i: int) -> bool:
    """Qwen MoE rule: layer ``i`` is sparse unless listed in ``mlp_only_layers`` (none when
    absent), every ``decoder_sparse_step``-th layer (every layer when absent)."""
    only = f.get("mlp_only_layers", [])
    step = f.opt_num("decoder_sparse_step") or 1
    return f.num("num_experts") > 0 and i not in only and (i + 1) % step == 0


def _qwen3_moe_mlp(f: ModelFields, i: int, kind: str) -> int:
    if not _qwen_sparse(f, i):
        return _dense_mlp(f, i, kind)
    return _moe(f, experts=f.num("num_experts"), top_k=f.num("num_experts_per_tok"),
                inter=f.num("moe_intermediate_size"))


def _qwen3_next_mlp(f: ModelFields, i: int, kind: str) -> int:
    if not _qwen_sparse(f, i):
        return _dense_mlp(f, i, kind)
    shared = f.opt_num("shared_expert_intermediate_size", minimum=0) or 0
    gate = f.num("hidden_size") if shared else 0  # the shared expert's sigmoid gate
    return gate + _moe(f, experts=f.num("num_experts"), top_k=f.num("num_experts_per_tok"),
                       inter=f.num("moe_intermediate_size"), shared=shared)


def _deepseek_mlp(f: ModelFields, i: int, kind: str) -> int:
    experts = f.opt_num("n_routed_experts", minimum=0) or 0
    dense = f.opt_num("first_k_dense_replace", minimum=0) or 0
    freq = f.opt_num("moe_layer_freq") or 1
    if experts == 0 or i < dense or i % freq:
        return _dense_mlp(f, i, kind)
    inter = f.num("moe_intermediate_size")
    shared = (f.opt_num("n_shared_experts", minimum=0) or 0) * inter
    return _moe(f, experts=experts, top_k=f.num("num_experts_per_tok"), inter=inter,
                shared=shared)


def _granite_hybrid_mlp(f: ModelFields, i: int, kind: str) -> int:
    """Every Granite 4.0 hybrid layer has a dense shared MLP (``shared_intermediate_size``)
    and, with ``num_local_experts > 0``, a MoE beside it."""
    del i, kind
    h = f.num("hidden_size")
    shared = 3 * h * f.num("shared_intermediate_size")
    experts = f.opt_num("num_local_experts", minimum=0) or 0
    if experts == 0:
        return shared
    return shared + _moe(f, experts=experts, top_k=f.num("num_experts_per_tok"),
                         inter=f.num("intermediate_size"))


def _nemotron_mlp(f: ModelFields, i: int, kind: str) -> int:
    """Nemotron-H: an ``mlp`` layer is a ReLU^2 MLP (up and down, no gate); a ``moe``
    layer routes to ReLU^2 experts beside its shared experts; mixer layers have no MLP."""
    del i
    h = f.num("hidden_size")
    if kind == "mlp":
        return 2 * h * f.num("intermediate_size")
    if kind == "moe":
        shared = ((f.opt_num("n_shared_experts", minimum=0) or 0)
                  * f.num("moe_shared_expert_intermediate_size"))
        return _moe(f, experts=f.num("n_routed_experts"), top_k=f.num("num_experts_per_tok"),
                    inter=f.num("moe_intermediate_size"), shared=shared, gated=False)
    return 0


def _jamba_mlp(f: ModelFields, i: int, kind: str) -> int:
    experts = f.opt_num("num_experts") or 1
    period = f.num("expert_layer_period")
    offset = f.num("expert_layer_offset", minimum=0)
    if experts > 1 and i % period == offset:
        return _moe(f, experts=experts, top_k=f.num("num_experts_per_tok"),
                    inter=f.num("intermediate_size"))
    return _dense_mlp(f, i, kind)


DENSE_MIXER = "attention"
"""``Family.mixer`` of a family whose cache-holding layers are all plain attention."""

FAMILIES: Mapping[str, Family] = {
    "llama": Family("Llama", DENSE_MIXER, _dense_mlp),
    "mistral": Family("Mistral", DENSE_MIXER, _dense_mlp),
    "ministral": Family("Ministral", DENSE_MIXER, _dense_mlp),
    "mixtral": Family("Mixtral (MoE)", DENSE_MIXER, _mixtral_mlp),
    "qwen2": Family("Qwen2", DENSE_MIXER, _dense_mlp),
    "qwen3": Family("Qwen3", DENSE_MIXER, _dense_mlp),
    "qwen3_moe": Family("Qwen3 MoE", DENSE_MIXER, _qwen3_moe_mlp),
    "gemma2": Family("Gemma 2", DENSE_MIXER, _dense_mlp),
    "gemma3_text": Family("Gemma 3", DENSE_MIXER, _dense_mlp),
    "gpt_oss": Family("gpt-oss (MoE)", DENSE_MIXER, _gpt_oss_mlp),
    "deepseek_v2": Family("DeepSeek-V2 (MLA, MoE)", "mla", _deepseek_mlp),
    "deepseek_v3": Family("DeepSeek-V3 (MLA, MoE)", "mla", _deepseek_mlp),
    "qwen3_next": Family("Qwen3-Next (gated delta-net hybrid, MoE)", "gated_delta_net",
                         _qwen3_next_mlp, gated_query=True),
    "granitemoehybrid": Family("Granite 4.0 hybrid (Mamba2)", "mamba2", _granite_hybrid_mlp),
    "nemotron_h": Family("Nemotron-H (Mamba2 hybrid)", "mamba2", _nemotron_mlp,
                         norms_per_layer=1),
    "falcon_h1": Family("Falcon-H1 (parallel Mamba2 hybrid)", "mamba2", _dense_mlp),
    "jamba": Family("Jamba (Mamba1 hybrid, MoE)", "mamba1", _jamba_mlp),
}
"""Every ``model_type`` kvoffload derives a layout for (a multimodal wrapper's text
model counts: Gemma 3's ``gemma3`` is read as its ``gemma3_text``)."""


def family_of(model_type: str, architectures: Any = None, where: str = "config") -> Family:
    """The family of ``model_type``; a one-line ``ConfigError`` naming it otherwise."""
    family = FAMILIES.get(model_type)
    if family is None:
        names = ", ".join(map(str, architectures)) if isinstance(architectures, list) else ""
        arch = f" ({names if len(names) <= SHOWN_CHARS else shown(names)})" if names else ""
        raise ConfigError(f"{where}: model_type",
                          f"architecture {shown(model_type)}{arch} is not one kvoffload "
                          "derives a "
                          "layout for",
                          f"Known: {', '.join(sorted(FAMILIES))}; describe the model with a "
                          "known family's fields in presets.json, or add a Family to "
                          "kvoffload.models.hf_families (docs/models.md)")
    return family


# ----------------------------------------------------------------- layer kinds


def layer_types(f: ModelFields) -> list[str]:
    """Each decoder layer's kind (``LAYER_KINDS``), as vLLM builds the model.

    A config without ``layer_types`` has one kind of attention layer; vLLM applies a
    model-level ``sliding_window`` to every layer then (Mistral 7B v0.1) and also when
    every listed layer is a sliding one.
    """
    listed = f.get("layer_types") if f.from_class else _data_layer_types(f)
    num_layers = f.num("num_hidden_layers") if listed is None else len(listed)
    kinds = (["full_attention"] * num_layers if listed is None
             else [_LEGACY_KINDS.get(str(k), str(k)) for k in listed])
    for i, kind in enumerate(kinds):
        if kind not in LAYER_KINDS:
            raise ConfigError(f"{f.where}: layer_types[{i}]",
                              f"layer kind {kind!r} is not one kvoffload knows "
                              f"({', '.join(LAYER_KINDS)})",
                              "Describe the model with the kinds vLLM caches, or add the kind "
                              "to kvoffload.models.hf_families (docs/models.md)")
    if listed is None and model_window(f) is not None:
        kinds = ["sliding_attention"] * num_layers
    return kinds


def model_window(f: ModelFields) -> int | None:
    """The model-level ``sliding_window`` (Qwen's only with ``use_sliding_window``)."""
    if f.model_type in ("qwen2", "qwen3", "qwen3_moe") and not f.get("use_sliding_window",
                                                                      False):
        return None
    return f.opt_num("sliding_window")


def _data_layer_types(f: ModelFields) -> list[str] | None:
    """``layer_types`` of a config read as data, by the rules of ``transformers``' config
    class of each family (which reads the older fields into ``layer_types``)."""
    d = f.raw
    assert d is not None
    for key in ("layer_types", "layers_block_type"):
        if isinstance(d.get(key), list):
            return [str(k) for k in d[key]]
    mt = f.model_type
    if mt == "nemotron_h":
        pattern = f.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise f.missing("hybrid_override_pattern")
        bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if bad:
            raise ConfigError(f"{f.where}: hybrid_override_pattern",
                              f"has characters {''.join(bad)!r} kvoffload does not know",
                              "Use M (Mamba2), * (attention), - (MLP) and E (MoE).")
        return [_NEMOTRON_PATTERN[c] for c in pattern]
    n = f.num("num_hidden_layers")
    rules: dict[str, Callable[[int], str]] = {
        "gemma2": lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention",
        "gpt_oss": lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention",
        "falcon_h1": lambda i: "hybrid",
    }
    if mt == "gemma3_text":
        pattern = f.num("sliding_window_pattern")
        rules[mt] = lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention"
    elif mt == "qwen3_next":
        interval = f.num("full_attention_interval")
        rules[mt] = lambda i: "linear_attention" if (i + 1) % interval else "full_attention"
    elif mt == "jamba":
        period, offset = f.num("attn_layer_period"), f.num("attn_layer_offset", minimum=0)
        rules[mt] = lambda i: "full_attention" if i % period == offset else "linear_attention"
    elif mt in ("qwen2", "qwen3") and model_window(f) is not None:
        first = f.num("max_window_layers", minimum=0)
        rules[mt] = lambda i: "sliding_attention" if i >= first else "full_attention"
    elif mt == "ministral":
        kind = "sliding_attention" if model_window(f) is not None else "full_attention"
        rules[mt] = lambda i: kind
    elif mt == "granitemoehybrid":
        raise f.missing("layer_types")
    rule = rules.get(mt)
    return None if rule is None else [rule(i) for i in range(n)]
