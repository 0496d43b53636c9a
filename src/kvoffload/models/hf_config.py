"""Model layouts from a model's own config: ``--model PATH``, ``--tp N`` and the presets file.

``derive_preset`` turns the fields of a Hugging Face ``config.json`` into a ``ModelPreset``
(``kvoffload.models.preset``): which layers hold a KV cache and of what kind, the
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
  data: the public config.json fields of popular models, with where each came from), once,
  on its first call (``preset_entries()`` reads the file, on its first call too); the
  registry ``kvoffload.models.presets`` is the view callers use. They are read as data,
  without ``transformers`` (importing it takes seconds); a test checks that its config
  classes derive the same presets.
* ``resolve_model(ref, tensor_parallel)`` is what the simulator calls: a preset name or a
  path, for one rank of ``tensor_parallel``.

Layers are grouped the way vLLM's hybrid allocator does at heart (``ModelPreset.layout``):
one group per kind, full attention, each sliding window, then one group of recurrent
layers (Mamba2, Mamba1 and gated delta-net states are all vLLM ``MambaSpec`` groups).

The derivation is split by what it reads: ``hf_fields`` (``ModelFields``: a config's
fields, dtype sizes), ``hf_families`` (``FAMILIES``, ``layer_types``: which layers a model
has) and ``hf_shapes`` (bytes per token and per state, tensor-parallel splits, parameter
counts; its docstring states the formulas). This module loads configs, derives presets and
resolves ``--model`` references, and re-exports the names callers import from here. Of
``kvoffload.models`` it imports those three and ``preset`` (the types it builds); importing
it reads no file and derives nothing.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvoffload.errors import SHOWN_CHARS, ConfigError, shown
from kvoffload.models.hf_bounds import (
    check_config_fields,
    check_model_size,
    read_config_json,
)
from kvoffload.models.hf_families import (
    DENSE_MIXER,
    FAMILIES,
    LAYER_KINDS,
    Family,
    family_of,
    layer_types,
    model_window,
)
from kvoffload.models.hf_fields import ModelFields, dtype_bytes, text_model_type
from kvoffload.models.hf_shapes import (
    attention_shape,
    count_params,
    model_dtype,
    split_attention,
    split_state,
    ssm_dtype,
    state_shape,
)
from kvoffload.models.preset import AttentionLayers, MambaLayers, ModelPreset

__all__ = [
    "FAMILIES", "LAYER_KINDS", "PRESETS_FILE", "Family", "ModelFields", "PresetEntry",
    "builtin_presets", "count_params", "derive_preset", "dtype_bytes", "family_of",
    "is_model_path", "layer_types", "load_model_config", "model_name", "preset_entries",
    "preset_from_entry", "read_presets_file", "resolve_model",
]

PRESETS_FILE = "presets.json"
"""The presets file, package data of ``kvoffload.models``."""


def load_model_config(path: str | Path) -> ModelFields:
    """The config of a local Hugging Face model directory, or of a config.json file.

    Read with ``transformers``' config class when it is installed and knows the
    ``model_type`` (offline: nothing is downloaded); otherwise as data. Before either sees
    it, the file is read with bounded time and memory and its known fields are checked
    (``kvoffload.models.hf_bounds``: types and the bounds on model shapes). ``ConfigError``
    (one line, naming the path, the field and what to change) for anything that cannot be
    read or is out of bounds.
    """
    given = Path(path).expanduser()
    try:
        file = given / "config.json" if given.is_dir() else given
        exists = file.exists() or file.is_symlink()
    except (OSError, ValueError):  # a name too long, a NUL byte
        exists = False
    where = _path_name(file if exists else given)
    if not exists:
        raise ConfigError(where, "is neither a model directory holding a config.json "
                          "nor a config.json file",
                          "Give the local directory of a Hugging Face model or its "
                          "config.json.")
    data = read_config_json(file, where)
    model_type = text_model_type(data)
    if model_type is None:
        raise ConfigError(f"{where}: model_type", "is missing",
                          "Give the config.json of a Hugging Face model (it names its "
                          "model_type).")
    check_config_fields(data, where)
    family_of(model_type, data.get("architectures"), where)  # refuse unknown ones first
    cfg = _read_with_transformers(file, where)
    if cfg is None:
        return ModelFields.from_mapping(data, where)
    return ModelFields(cfg.get_text_config(), top=cfg, where=where, from_class=True)


def _path_name(path: Path) -> str:
    """``path`` for an error message: as given, or cut (``shown``) when very long."""
    text = str(path)
    return text if len(text) <= 2 * SHOWN_CHARS else shown(text)


def _read_with_transformers(file: Path, where: str) -> Any:
    """``AutoConfig.from_pretrained(file)`` offline; None without transformers or when it
    does not know the model_type (the JSON is then read as data).

    The fields kvoffload knows were checked before; anything else the config class
    refuses (its own validation errors) is a ``ConfigError`` with its first line.
    """
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    try:
        return AutoConfig.from_pretrained(str(file), local_files_only=True)
    except ValueError as exc:
        if "model type" in str(exc).lower() or "unrecognized" in str(exc).lower():
            return None
        raise _unreadable(where, exc) from None
    except Exception as exc:  # the library's own: strict-dataclass, Type, Key, Index...
        raise _unreadable(where, exc) from None


def _unreadable(where: str, exc: BaseException) -> ConfigError:
    said = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return ConfigError(where, "transformers cannot read it: "
                       f"{shown(said or type(exc).__name__, 3 * SHOWN_CHARS)}",
                       "Correct the config (see the model's published config.json).")


# ----------------------------------------------------------------- the preset


def derive_preset(f: ModelFields, *, name: str, source: str, tensor_parallel: int = 1,
                  dtype: str | None = None, notes: str = "") -> ModelPreset:
    """The ``ModelPreset`` of one model config, for one of ``tensor_parallel`` ranks.

    Args:
        f: the config (``load_model_config``, ``ModelFields.from_mapping``).
        name: the preset's name (``@tp<N>`` is appended for N > 1 ranks).
        source: where the config comes from (shown by ``describe``).
        tensor_parallel: ranks the model is split over (``hf_shapes``' docstring).
        dtype: the dtype the engine runs the model in (vLLM's ``--dtype``), when it is
            not the config's: the KV cache, the conv state and (except Nemotron-H's) the
            SSM state take it.
        notes: what the source adds (kept in ``assumptions``).
    """
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) \
            or tensor_parallel < 1:
        raise ConfigError("tensor_parallel", f"must be a positive integer, got "
                          f"{tensor_parallel!r}", "Give the number of ranks, e.g. --tp 2.")
    family = family_of(f.model_type, f.architectures, f.where)
    kinds = layer_types(f)
    _check_kinds(f, family, kinds)
    label = name if tensor_parallel == 1 else f"{name}@tp{tensor_parallel}"
    model_bytes, dtype_name = model_dtype(f, dtype)
    attention = _attention_layers(f, family, kinds, tp=tensor_parallel, name=label,
                                  dtype=model_bytes)
    mamba, ssm_note = _mamba_layers(f, family, kinds, tp=tensor_parallel, name=label,
                                    dtype=model_bytes)
    params = count_params(f, kinds)
    per_rank = -(-params // tensor_parallel)
    parts = [f"cache dtype {dtype_name}" + (f", SSM state {ssm_note}" if ssm_note else ""),
             f"params_per_token {per_rank:,} counted from the config"
             + (f" ({params:,} over {tensor_parallel} ranks)" if tensor_parallel > 1 else "")]
    if notes:
        parts.append(notes)
    preset = ModelPreset(name=label, source=source, num_layers=len(kinds),
                         attention=attention, mamba=mamba, params_per_token=per_rank,
                         assumptions="; ".join(parts) + ".", family=family.label,
                         tensor_parallel=tensor_parallel)
    check_model_size(f.where, bytes_per_token=preset.bytes_per_token,
                     bytes_per_state=preset.bytes_per_state, params_per_token=per_rank)
    return preset


def _check_kinds(f: ModelFields, family: Family, kinds: Sequence[str]) -> None:
    recurrent = any(k in ("linear_attention", "hybrid") for k in kinds)
    if recurrent and family.mixer in (DENSE_MIXER, "mla"):
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
    full = sum(k in ("full_attention", "hybrid") for k in kinds)
    sliding = kinds.count("sliding_attention")
    if not full and not sliding:
        return ()
    a = split_attention(attention_shape(f, family), tp, name)
    window = model_window(f) if sliding else None
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
    count = sum(k in ("linear_attention", "hybrid") for k in kinds)
    if not count:
        return None, ""
    s = split_state(state_shape(f, family), tp, name)
    ssm, note = ssm_dtype(f, dtype)
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
    text = resources.files("kvoffload.models").joinpath(PRESETS_FILE).read_text(
        encoding="utf-8")
    return read_presets_file(text)


def preset_from_entry(entry: PresetEntry, tensor_parallel: int = 1) -> ModelPreset:
    """The preset ``entry`` derives, for one of ``tensor_parallel`` ranks."""
    return derive_preset(entry.fields(), name=entry.name,
                         source=f"{entry.source} (via {PRESETS_FILE})",
                         tensor_parallel=tensor_parallel, notes=entry.notes)


@functools.cache
def builtin_presets() -> Mapping[str, ModelPreset]:
    """Every built-in preset by name (in ``presets.json``'s order), derived from
    ``presets.json`` on the first call; later calls return the same presets."""
    return MappingProxyType({name: preset_from_entry(e)
                             for name, e in preset_entries().items()})


def model_name(path: str | Path) -> str:
    """A model's name from its path: the directory's name (of a config.json, its parent's)."""
    p = Path(path).expanduser()
    if p.is_file() or p.suffix == ".json":
        return (p.parent.name or p.stem) if p.name == "config.json" else p.stem
    return p.name or str(p)


def is_model_path(ref: str) -> bool:
    """Whether ``ref`` names a model config on disk rather than a preset."""
    if ref in preset_entries():
        return False
    if "/" in ref or "\\" in ref or ref.endswith(".json"):
        return True
    try:
        return Path(ref).expanduser().exists()
    except (OSError, ValueError):  # a name no file can have (too long, a NUL byte):
        return False                # an unknown preset, named as such


@functools.lru_cache(maxsize=64)
def resolve_model(ref: str, tensor_parallel: int = 1) -> ModelPreset:
    """The preset called ``ref``, or the model whose directory or config.json ``ref`` is,
    for one of ``tensor_parallel`` ranks; ``ConfigError`` otherwise."""
    entries = preset_entries()
    if ref in entries:
        if tensor_parallel == 1:
            return builtin_presets()[ref]
        return preset_from_entry(entries[ref], tensor_parallel)
    if is_model_path(ref):
        return derive_preset(load_model_config(ref), name=model_name(ref), source=ref,
                             tensor_parallel=tensor_parallel)
    raise ConfigError("model", f"unknown preset {shown(ref)}",
                      f"Choose one of: {', '.join(sorted(entries))}; or give a model "
                      "directory or config.json (--model PATH).")
