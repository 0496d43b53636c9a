"""Model layouts from a model's own config: ``--model PATH``, ``--tp N`` and the presets file.

``derive_preset`` turns the fields of a Hugging Face ``config.json`` into a ``ModelPreset``
(``kvoffload.engine.model_presets``): which layers hold a KV cache and of what kind, the
bytes of one token and of one recurrent-state snapshot, and the parameters the prefill
FLOPs model needs. It is the one code path for every model the simulator knows:

* ``load_model_config(path)`` reads a local model directory (or its ``config.json``) with
  ``transformers``' own config class (``AutoConfig.from_pretrained``, offline), so the
  class fills in its defaults and turns legacy spellings (Gemma's
  ``sliding_window_pattern``, Nemotron-H's ``hybrid_override_pattern``, Jamba's
  ``attn_layer_period``, Qwen3-Next's ``full_attention_interval``) into ``layer_types``.
  Without ``transformers`` (or for a ``model_type`` the installed one does not know) the
  JSON is read as data by the same rules, and every field must then be present.
* ``builtin_presets()`` derives the built-in presets from ``presets.json`` (this package's
  data: the public config.json fields of popular models, with where each came from). They
  are read as data, without ``transformers`` (importing it takes seconds); a test checks
  that its config classes derive the same presets.
* ``resolve_model(ref, tensor_parallel)`` is what the simulator calls: a preset name or a
  path, for one rank of ``tensor_parallel``.

Layers are grouped the way vLLM's hybrid allocator does at heart (``ModelPreset.layout``):
one group per kind, full attention, each sliding window, then one group of recurrent
layers (Mamba2, Mamba1 and gated delta-net states are all vLLM ``MambaSpec`` groups).

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

import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from kvoffload.engine.model_presets import AttentionLayers, MambaLayers, ModelPreset

PRESETS_FILE = "presets.json"
"""The presets file, package data of ``kvoffload.engine``."""

LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention", "hybrid", "mlp",
               "moe")
"""Per-layer kinds, as ``transformers`` names them in ``layer_types``: ``linear_attention``
is a recurrent layer (Mamba or gated delta-net), ``hybrid`` a layer holding attention and a
Mamba mixer side by side (Falcon-H1), ``mlp`` / ``moe`` a layer without a cache."""

_LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}
"""Older spellings of ``layer_types`` entries (Granite 4.0's, Jamba's)."""

_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
"""Nemotron-H's ``hybrid_override_pattern`` characters."""

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                "bf16": 2, "fp16": 2, "fp32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
"""Bytes of one element of each dtype name a config or ``dtype=`` may give."""


# ----------------------------------------------------------------- reading a config


class ModelFields:
    """Read access to one model's (text) config: a ``transformers`` config object, or a
    mapping of config.json fields read as data.

    Attributes:
        where: what the config is, for error messages (a path, ``presets.json[name]``).
        model_type: the text model's ``model_type``.
        architectures: the config's ``architectures`` (may be empty).
        from_class: read through ``transformers``' config class (which fills defaults).
    """

    def __init__(self, text: Any, *, top: Any, where: str, from_class: bool) -> None:
        self._text = text
        self._top = top
        self.where = where
        self.from_class = from_class
        model_type = self.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise ConfigError(f"{where}: model_type", "is missing",
                              "Give the config.json of a Hugging Face model (it names its "
                              "model_type).")
        self.model_type = model_type
        arch = self._lookup(top, "architectures")
        self.architectures = [str(a) for a in arch] if isinstance(arch, list | tuple) else []

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str) -> ModelFields:
        """config.json fields read as data (a multimodal config's ``text_config`` is the
        text model; its other fields, e.g. the dtype, fall back to the top level)."""
        text = data.get("text_config")
        if not isinstance(text, Mapping):
            return cls(dict(data), top=dict(data), where=where, from_class=False)
        model_type = _text_model_type(data)
        text = {**({"model_type": model_type} if model_type else {}), **text}
        return cls(text, top=dict(data), where=where, from_class=False)

    @staticmethod
    def _lookup(obj: Any, name: str) -> Any:
        if isinstance(obj, Mapping):
            return obj.get(name)
        return getattr(obj, name, None)

    def get(self, name: str, default: Any = None) -> Any:
        """The field ``name`` (None and absent read as ``default``)."""
        value = self._lookup(self._text, name)
        return default if value is None else value

    def top(self, name: str) -> Any:
        """A field of the text config, else of the top-level (multimodal) config."""
        value = self._lookup(self._text, name)
        return self._lookup(self._top, name) if value is None else value

    @property
    def raw(self) -> Mapping[str, Any] | None:
        """The text config's fields when read as data; None through a config class."""
        return None if self.from_class else self._text

    def missing(self, name: str) -> ConfigError:
        """The error for a required field the config lacks."""
        fix = ("Add it to the config (see the model's published config.json)" if self.from_class
               else "Add it to the config, or install transformers, whose config class for "
                    "this model_type supplies the defaults a published config.json leaves out")
        return ConfigError(f"{self.where}: {name}",
                           f"is missing (model_type {self.model_type!r} needs it)", fix + ".")

    def num(self, name: str, *aliases: str, minimum: int = 1) -> int:
        """A required integer field (the first of ``name``, ``aliases`` that is set)."""
        for key in (name, *aliases):
            value = self.get(key)
            if value is not None:
                return self._check_int(key, value, minimum)
        raise self.missing(name)

    def opt_num(self, name: str, *aliases: str, minimum: int = 1) -> int | None:
        """An optional integer field; None when absent."""
        for key in (name, *aliases):
            value = self.get(key)
            if value is not None:
                return self._check_int(key, value, minimum)
        return None

    def _check_int(self, key: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.where}: {key}",
                              f"must be an integer >= {minimum}, got {value!r}",
                              "Correct the config (see the model's published config.json).")
        return value


_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}
"""Multimodal wrappers whose ``text_config`` may leave out its ``model_type``."""


def _text_model_type(data: Mapping[str, Any]) -> str | None:
    """The ``model_type`` of a config's text model (a wrapper's ``text_config``)."""
    top = data.get("model_type")
    text = data.get("text_config")
    if isinstance(text, Mapping):
        if isinstance(text.get("model_type"), str):
            return str(text["model_type"])
        if isinstance(top, str) and top in _TEXT_MODEL_TYPES:
            return _TEXT_MODEL_TYPES[top]
    return top if isinstance(top, str) else None


def load_model_config(path: str | Path) -> ModelFields:
    """The config of a local Hugging Face model directory, or of a config.json file.

    Read with ``transformers``' config class when it is installed and knows the
    ``model_type`` (offline: nothing is downloaded); otherwise as data. ``ConfigError``
    (one line, naming the path and what to change) for anything that cannot be read.
    """
    given = Path(path).expanduser()
    file = given / "config.json" if given.is_dir() else given
    where = str(file)
    if not file.is_file():
        raise ConfigError(f"{given}", "is neither a model directory holding a config.json "
                          "nor a config.json file",
                          "Give the local directory of a Hugging Face model or its "
                          "config.json.")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(where, f"cannot be read as JSON ({exc})",
                          "Give a model's config.json.") from None
    if not isinstance(data, dict):
        raise ConfigError(where, "is not a JSON object", "Give a model's config.json.")
    model_type = _text_model_type(data)
    if model_type is None:
        raise ConfigError(f"{where}: model_type", "is missing",
                          "Give the config.json of a Hugging Face model (it names its "
                          "model_type).")
    family_of(model_type, data.get("architectures"), where)  # refuse unknown ones first
    cfg = _read_with_transformers(file, where)
    if cfg is None:
        return ModelFields.from_mapping(data, where)
    return ModelFields(cfg.get_text_config(), top=cfg, where=where, from_class=True)


def _read_with_transformers(file: Path, where: str) -> Any:
    """``AutoConfig.from_pretrained(file)`` offline; None without transformers or when it
    does not know the model_type (the JSON is then read as data)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    try:
        return AutoConfig.from_pretrained(str(file), local_files_only=True)
    except ValueError as exc:
        if "model type" in str(exc).lower() or "unrecognized" in str(exc).lower():
            return None
        raise ConfigError(where, f"transformers cannot read it: {_first_line(exc)}",
                          "Correct the config (see the model's published config.json).")\
            from None
    except (OSError, TypeError, KeyError) as exc:
        raise ConfigError(where, f"transformers cannot read it: {_first_line(exc)}",
                          "Correct the config (see the model's published config.json).")\
            from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ----------------------------------------------------------------- families


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


_DENSE = "attention"
FAMILIES: Mapping[str, Family] = {
    "llama": Family("Llama", _DENSE, _dense_mlp),
    "mistral": Family("Mistral", _DENSE, _dense_mlp),
    "ministral": Family("Ministral", _DENSE, _dense_mlp),
    "mixtral": Family("Mixtral (MoE)", _DENSE, _mixtral_mlp),
    "qwen2": Family("Qwen2", _DENSE, _dense_mlp),
    "qwen3": Family("Qwen3", _DENSE, _dense_mlp),
    "qwen3_moe": Family("Qwen3 MoE", _DENSE, _qwen3_moe_mlp),
    "gemma2": Family("Gemma 2", _DENSE, _dense_mlp),
    "gemma3_text": Family("Gemma 3", _DENSE, _dense_mlp),
    "gpt_oss": Family("gpt-oss (MoE)", _DENSE, _gpt_oss_mlp),
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
        arch = (f" ({', '.join(map(str, architectures))})"
                if isinstance(architectures, list) and architectures else "")
        raise ConfigError(f"{where}: model_type",
                          f"architecture {model_type!r}{arch} is not one kvoffload derives a "
                          "layout for",
                          f"Known: {', '.join(sorted(FAMILIES))}; describe the model with a "
                          "known family's fields in presets.json, or add a Family to "
                          "kvoffload.engine.hf_config (docs/models.md)")
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
                              "to kvoffload.engine.hf_config (docs/models.md)")
    if listed is None and _window(f) is not None:
        kinds = ["sliding_attention"] * num_layers
    return kinds


def _window(f: ModelFields) -> int | None:
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
    elif mt in ("qwen2", "qwen3") and _window(f) is not None:
        first = f.num("max_window_layers", minimum=0)
        rules[mt] = lambda i: "sliding_attention" if i >= first else "full_attention"
    elif mt == "ministral":
        kind = "sliding_attention" if _window(f) is not None else "full_attention"
        rules[mt] = lambda i: kind
    elif mt == "granitemoehybrid":
        raise f.missing("layer_types")
    rule = rules.get(mt)
    return None if rule is None else [rule(i) for i in range(n)]


# ----------------------------------------------------------------- dtypes


def dtype_bytes(name: Any, where: str, *, float32_runs_as: int | None = None) -> int:
    """Bytes of one element of dtype ``name`` (a string or a ``torch.dtype``).

    ``float32_runs_as``: what a float32 *model* dtype becomes (vLLM's ``--dtype auto``
    runs float32 checkpoints in 16 bits); None keeps float32.
    """
    text = str(name).removeprefix("torch.").lower()
    size = _DTYPE_BYTES.get(text)
    if size is None:
        raise ConfigError(where, f"dtype {text!r} is not one kvoffload knows",
                          f"Use one of {', '.join(sorted(_DTYPE_BYTES))}.")
    if size == 4 and float32_runs_as is not None:
        return float32_runs_as
    return size


def _model_dtype(f: ModelFields, override: str | None) -> tuple[int, str]:
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


# ----------------------------------------------------------------- shapes


@dataclass(frozen=True)
class _Attention:
    q_heads: int
    kv_heads: int
    head_dim: int
    latent: int | None = None  # MLA: kv_lora_rank + qk_rope_head_dim
    v_head_dim: int | None = None


def _attention_shape(f: ModelFields, family: Family) -> _Attention:
    q = f.num("num_attention_heads")
    if family.mixer == "mla":
        rope, nope = f.num("qk_rope_head_dim"), f.num("qk_nope_head_dim")
        return _Attention(q_heads=q, kv_heads=1, head_dim=rope + nope,
                          latent=f.num("kv_lora_rank") + rope, v_head_dim=f.num("v_head_dim"))
    kv = f.opt_num("num_key_value_heads") or q
    head_dim = f.opt_num("head_dim", "attention_head_dim")
    if head_dim is None:
        hidden = f.num("hidden_size")
        if hidden % q:
            raise f.missing("head_dim")
        head_dim = hidden // q
    return _Attention(q_heads=q, kv_heads=kv, head_dim=head_dim)


@dataclass(frozen=True)
class _State:
    variant: str
    heads: int       # Mamba2 heads; Mamba1 d_inner; gated delta-net value heads
    head_dim: int    # Mamba2 head dim; 1; value head dim
    groups: int      # B/C groups; 0; key heads
    d_state: int     # SSM state; SSM state; key head dim
    d_conv: int


def _state_shape(f: ModelFields, family: Family) -> _State:
    mt, hidden = f.model_type, f.num("hidden_size")
    if family.mixer == "mamba1":
        return _State("mamba1", f.num("mamba_expand") * hidden, 1, 0, f.num("mamba_d_state"),
                      f.num("mamba_d_conv"))
    if family.mixer == "gated_delta_net":
        return _State("gated_delta_net", f.num("linear_num_value_heads"),
                      f.num("linear_value_head_dim"), f.num("linear_num_key_heads"),
                      f.num("linear_key_head_dim"), f.num("linear_conv_kernel_dim"))
    if mt == "nemotron_h":
        return _State("mamba2", f.num("mamba_num_heads"), f.num("mamba_head_dim"),
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
    return _State("mamba2", heads, head_dim, f.num("mamba_n_groups"), f.num("mamba_d_state"),
                  f.num("mamba_d_conv"))


def _ssm_dtype(f: ModelFields, model_bytes: int) -> tuple[int, str]:
    """The SSM state's dtype: the model's, except Nemotron-H's (vLLM reads its config's
    ``mamba_ssm_cache_dtype``, float32 by default, whatever ``--dtype`` says)."""
    if f.model_type == "nemotron_h":
        name = f.get("mamba_ssm_cache_dtype", "float32")
        return (dtype_bytes(name, f"{f.where}: mamba_ssm_cache_dtype"),
                f"{name} (Nemotron-H's mamba_ssm_cache_dtype)")
    return model_bytes, "in the model dtype"


# ----------------------------------------------------------------- tensor parallelism


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


def _split_attention(a: _Attention, tp: int, name: str) -> _Attention:
    if tp == 1:
        return a
    q = _divide(a.q_heads, tp, "attention heads", name)
    kv = a.kv_heads if a.latent is not None else _kv_heads_per_rank(a.kv_heads, tp, name)
    return _Attention(q, kv, a.head_dim, a.latent, a.v_head_dim)


def _split_state(s: _State, tp: int, name: str) -> _State:
    if tp == 1:
        return s
    if s.variant == "mamba1":
        return _State(s.variant, _divide(s.heads, tp, "Mamba channels (d_inner)", name), 1, 0,
                      s.d_state, s.d_conv)
    if s.variant == "gated_delta_net":
        return _State(s.variant, _divide(s.heads, tp, "linear-attention value heads", name),
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
    return _State(s.variant, heads, s.head_dim, groups, s.d_state, s.d_conv)


# ----------------------------------------------------------------- parameters


def _attention_params(h: int, a: _Attention, f: ModelFields, gated_query: bool) -> int:
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


def _state_params(h: int, s: _State, f: ModelFields) -> int:
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
    attention = _attention_shape(f, family)
    state = _state_shape(f, family) if family.mixer not in (_DENSE, "mla") else None
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


# ----------------------------------------------------------------- the preset


def derive_preset(f: ModelFields, *, name: str, source: str, tensor_parallel: int = 1,
                  dtype: str | None = None, notes: str = "") -> ModelPreset:
    """The ``ModelPreset`` of one model config, for one of ``tensor_parallel`` ranks.

    Args:
        f: the config (``load_model_config``, ``ModelFields.from_mapping``).
        name: the preset's name (``@tp<N>`` is appended for N > 1 ranks).
        source: where the config comes from (shown by ``describe``).
        tensor_parallel: ranks the model is split over (module docstring).
        dtype: the dtype the engine runs the model in (vLLM's ``--dtype``), when it is
            not the config's: the KV cache, the conv state and (except Nemotron-H's) the
            SSM state take it.
        notes: what the source adds (kept in ``assumptions``).
    """
    from kvoffload.engine.model_presets import ModelPreset

    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) \
            or tensor_parallel < 1:
        raise ConfigError("tensor_parallel", f"must be a positive integer, got "
                          f"{tensor_parallel!r}", "Give the number of ranks, e.g. --tp 2.")
    family = family_of(f.model_type, f.architectures, f.where)
    kinds = layer_types(f)
    _check_kinds(f, family, kinds)
    label = name if tensor_parallel == 1 else f"{name}@tp{tensor_parallel}"
    model_bytes, model_dtype = _model_dtype(f, dtype)
    attention = _attention_layers(f, family, kinds, tp=tensor_parallel, name=label,
                                  dtype=model_bytes)
    mamba, ssm_note = _mamba_layers(f, family, kinds, tp=tensor_parallel, name=label,
                                    dtype=model_bytes)
    params = count_params(f, kinds)
    per_rank = -(-params // tensor_parallel)
    parts = [f"cache dtype {model_dtype}" + (f", SSM state {ssm_note}" if ssm_note else ""),
             f"params_per_token {per_rank:,} counted from the config"
             + (f" ({params:,} over {tensor_parallel} ranks)" if tensor_parallel > 1 else "")]
    if notes:
        parts.append(notes)
    return ModelPreset(name=label, source=source, num_layers=len(kinds),
                       attention=attention, mamba=mamba, params_per_token=per_rank,
                       assumptions="; ".join(parts) + ".", family=family.label,
                       tensor_parallel=tensor_parallel)


def _check_kinds(f: ModelFields, family: Family, kinds: Sequence[str]) -> None:
    recurrent = any(k in ("linear_attention", "hybrid") for k in kinds)
    if recurrent and family.mixer in (_DENSE, "mla"):
        raise ConfigError(f"{f.where}: layer_types",
                          f"lists recurrent layers, which {family.label} models do not have",
                          "Correct layer_types (see the model's published config.json).")
    if family.mixer == "mla" and "sliding_attention" in kinds:
        raise ConfigError(f"{f.where}: layer_types", "MLA with a sliding window is not "
                          "cached by vLLM as a prefix", "Describe full-attention layers only.")
    if all(k in ("mlp", "moe") for k in kinds):
        raise ConfigError(f"{f.where}: layer_types", "no layer holds a cache",
                          "Correct layer_types (see the model's published config.json).")


def _attention_layers(f: ModelFields, family: Family, kinds: Sequence[str], *, tp: int,
                      name: str, dtype: int) -> tuple[AttentionLayers, ...]:
    from kvoffload.engine.model_presets import AttentionLayers

    full = sum(k in ("full_attention", "hybrid") for k in kinds)
    sliding = kinds.count("sliding_attention")
    if not full and not sliding:
        return ()
    a = _split_attention(_attention_shape(f, family), tp, name)
    window = _window(f) if sliding else None
    if sliding and window is None:
        raise f.missing("sliding_window")
    out = []
    for count, win in ((full, None), (sliding, window)):
        if count:
            out.append(AttentionLayers(num_layers=count, num_kv_heads=a.kv_heads,
                                       head_dim=a.head_dim, num_q_heads=a.q_heads,
                                       sliding_window=win, dtype_bytes=dtype,
                                       kv_latent_dim=a.latent, v_head_dim=a.v_head_dim))
    return tuple(out)


def _mamba_layers(f: ModelFields, family: Family, kinds: Sequence[str], *, tp: int, name: str,
                  dtype: int) -> tuple[MambaLayers | None, str]:
    from kvoffload.engine.model_presets import MambaLayers

    count = sum(k in ("linear_attention", "hybrid") for k in kinds)
    if not count:
        return None, ""
    s = _split_state(_state_shape(f, family), tp, name)
    ssm, note = _ssm_dtype(f, dtype)
    return MambaLayers(num_layers=count, n_heads=s.heads, head_dim=s.head_dim,
                       n_groups=s.groups, d_state=s.d_state, d_conv=s.d_conv,
                       conv_dtype_bytes=dtype, ssm_dtype_bytes=ssm, variant=s.variant), note


# ----------------------------------------------------------------- presets and lookups


@dataclass(frozen=True)
class PresetEntry:
    """One model of ``presets.json``.

    Attributes:
        name: the preset's name.
        source: where its fields come from (the model's Hugging Face repo id and file).
        notes: fields that come from elsewhere, and what was assumed.
        config: the config.json fields.
    """

    name: str
    source: str
    notes: str
    config: Mapping[str, Any]

    def fields(self) -> ModelFields:
        return ModelFields.from_mapping(self.config, f"{PRESETS_FILE}[{self.name}]")


def read_presets_file(text: str, where: str = PRESETS_FILE) -> dict[str, PresetEntry]:
    """The entries of a presets file (``{"presets": [{"name", "source", "notes",
    "config"}, ...]}``); ``ConfigError`` naming the entry otherwise."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(where, f"is not JSON ({exc})", "Correct the file.") from None
    items = data.get("presets") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ConfigError(where, "holds no 'presets' list", "Correct the file.")
    entries: dict[str, PresetEntry] = {}
    for i, item in enumerate(items):
        ok = (isinstance(item, dict) and isinstance(item.get("name"), str)
              and isinstance(item.get("source"), str) and isinstance(item.get("config"), dict))
        if not ok:
            raise ConfigError(f"{where}: presets[{i}]", "needs a name, a source and a config",
                              "Correct the entry (docs/models.md).")
        if item["name"] in entries:
            raise ConfigError(f"{where}: presets[{i}]", f"repeats the name {item['name']!r}",
                              "Give every preset its own name.")
        entries[item["name"]] = PresetEntry(item["name"], item["source"],
                                            str(item.get("notes", "")), item["config"])
    return entries


@functools.cache
def preset_entries() -> Mapping[str, PresetEntry]:
    """The entries of the built-in presets file, by name."""
    text = resources.files("kvoffload.engine").joinpath(PRESETS_FILE).read_text(
        encoding="utf-8")
    return read_presets_file(text)


def preset_from_entry(entry: PresetEntry, tensor_parallel: int = 1) -> ModelPreset:
    return derive_preset(entry.fields(), name=entry.name,
                         source=f"{entry.source} (via {PRESETS_FILE})",
                         tensor_parallel=tensor_parallel, notes=entry.notes)


def builtin_presets() -> dict[str, ModelPreset]:
    """Every built-in preset, derived from ``presets.json``."""
    return {name: preset_from_entry(e) for name, e in preset_entries().items()}


def model_name(path: str | Path) -> str:
    """A model's name from its path: the directory's name (of a config.json, its parent's)."""
    p = Path(path).expanduser()
    if p.is_file() or p.suffix == ".json":
        return (p.parent.name or p.stem) if p.name == "config.json" else p.stem
    return p.name or str(p)


def is_model_path(ref: str) -> bool:
    """Whether ``ref`` names a model config on disk rather than a preset."""
    return ref not in preset_entries() and (
        "/" in ref or "\\" in ref or ref.endswith(".json") or Path(ref).expanduser().exists())


@functools.lru_cache(maxsize=64)
def resolve_model(ref: str, tensor_parallel: int = 1) -> ModelPreset:
    """The preset called ``ref``, or the model whose directory or config.json ``ref`` is,
    for one of ``tensor_parallel`` ranks; ``ConfigError`` otherwise."""
    from kvoffload.engine.model_presets import PRESETS

    entries = preset_entries()
    if ref in entries:
        if tensor_parallel == 1:
            return PRESETS[ref]
        return preset_from_entry(entries[ref], tensor_parallel)
    if is_model_path(ref):
        return derive_preset(load_model_config(ref), name=model_name(ref), source=ref,
                             tensor_parallel=tensor_parallel)
    raise ConfigError("model", f"unknown preset {ref!r}",
                      f"Choose one of: {', '.join(sorted(entries))}; or give a model "
                      "directory or config.json (--model PATH).")
