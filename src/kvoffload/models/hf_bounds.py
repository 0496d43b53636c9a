"""Reading a model's config.json safely: bounded reading and plausible bounds on its fields.

A ``--model`` directory may hold anything: a FIFO or ``/dev/zero`` named config.json, JSON
nested thousands of levels deep, a layer count of 1e9, a 10-million-character
``hybrid_override_pattern``, a ``head_dim`` of 2^40, a field of the wrong type. This module
answers all of them with one ``ConfigError`` naming the file and the field, within bounded
time and memory, *before* ``transformers`` (whose own exceptions are tracebacks) or the
layout derivation sees the data:

* ``read_config_json(file, where)``: the file's JSON object, read with
  ``kvoffload.files``' bounded, regular-file-only reader (at most ``MAX_CONFIG_BYTES``) and
  refused when nested deeper than ``MAX_CONFIG_DEPTH`` (checked by a linear scan before
  ``json.loads`` recurses).
* ``check_config_fields(data, where)``: every field kvoffload or the config class reads
  (``INT_BOUNDS``, the layer-pattern and dtype fields) has the right type and lies within
  generous bounds on model shapes (docs/models.md, "Bounds on a model's config"); a
  multimodal config's ``text_config`` is checked the same way. Unknown fields are left
  alone. ``null`` reads as absent, except for the fields every model must state
  (``NOT_NULL``).

``INT_BOUNDS`` is also what ``ModelFields.num`` checks values against (also those the
config class fills in), so no figure outside the bounds reaches a layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvoffload.errors import ConfigError, shown
from kvoffload.files import MalformedJsonError, UnreadableFileError, read_json_object

MAX_CONFIG_BYTES = 4 << 20
"""Largest config.json read (4 MiB; published ones are a few KiB)."""

MAX_CONFIG_DEPTH = 32
"""Deepest nesting of objects and lists in a config.json (published ones nest 3 or 4)."""

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
               "bf16": 2, "fp16": 2, "fp32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
"""Bytes of one element of each dtype name a config or ``dtype=`` may give."""

MAX_LAYERS = 4096
"""Most decoder layers a model may have (the largest published have about 160)."""

MAX_TOKEN_BYTES = 1 << 30
"""Most KV-cache bytes one token may take over a model's layers, on one rank (1 GiB; a
large published model takes about 1 MiB)."""

MAX_STATE_BYTES = 1 << 34
"""Most bytes one recurrent-state snapshot may take over a model's layers (16 GiB)."""

MAX_PARAMS_PER_TOKEN = 1 << 50
"""Most parameters one token may multiply by (about 10^15; published models: 10^11)."""

_HEADS = 16384
_HEAD_DIM = 16384
_WIDTH = 1 << 20
_EXPERTS = 65536
_CONV = 1024
_WINDOW = 1 << 26

INT_BOUNDS: Mapping[str, tuple[int, int]] = {
    # layer counts, periods and offsets
    "num_hidden_layers": (1, MAX_LAYERS),
    "max_window_layers": (0, MAX_LAYERS),
    "first_k_dense_replace": (0, MAX_LAYERS),
    "decoder_sparse_step": (1, MAX_LAYERS),
    "moe_layer_freq": (1, MAX_LAYERS),
    "expert_layer_period": (1, MAX_LAYERS),
    "expert_layer_offset": (0, MAX_LAYERS),
    "attn_layer_period": (1, MAX_LAYERS),
    "attn_layer_offset": (0, MAX_LAYERS),
    "full_attention_interval": (1, MAX_LAYERS),
    "sliding_window_pattern": (1, MAX_LAYERS),
    # heads and groups
    "num_attention_heads": (1, _HEADS),
    "num_key_value_heads": (1, _HEADS),
    "mamba_num_heads": (1, _HEADS),
    "mamba_n_heads": (1, _HEADS),
    "linear_num_key_heads": (1, _HEADS),
    "linear_num_value_heads": (1, _HEADS),
    "n_groups": (1, _HEADS),
    "mamba_n_groups": (1, _HEADS),
    # per-head and state dimensions
    "head_dim": (1, _HEAD_DIM),
    "attention_head_dim": (1, _HEAD_DIM),
    "qk_rope_head_dim": (1, _HEAD_DIM),
    "qk_nope_head_dim": (1, _HEAD_DIM),
    "v_head_dim": (1, _HEAD_DIM),
    "kv_lora_rank": (1, _HEAD_DIM),
    "mamba_head_dim": (1, _HEAD_DIM),
    "linear_key_head_dim": (1, _HEAD_DIM),
    "linear_value_head_dim": (1, _HEAD_DIM),
    "ssm_state_size": (1, _HEAD_DIM),
    "mamba_d_state": (1, _HEAD_DIM),
    "mamba_d_head": (1, _HEAD_DIM),
    "q_lora_rank": (1, _WIDTH),
    "mamba_dt_rank": (1, _WIDTH),
    "mamba_expand": (1, 64),
    "conv_kernel": (1, _CONV),
    "mamba_d_conv": (1, _CONV),
    "linear_conv_kernel_dim": (1, _CONV),
    # widths
    "hidden_size": (1, _WIDTH),
    "intermediate_size": (1, _WIDTH),
    "moe_intermediate_size": (1, _WIDTH),
    "shared_intermediate_size": (1, _WIDTH),
    "shared_expert_intermediate_size": (0, _WIDTH),
    "moe_shared_expert_intermediate_size": (1, _WIDTH),
    "mamba_d_ssm": (1, _WIDTH),
    "vocab_size": (1, 1 << 24),
    # experts
    "num_experts": (0, _EXPERTS),
    "num_local_experts": (0, _EXPERTS),
    "n_routed_experts": (0, _EXPERTS),
    "n_shared_experts": (0, _EXPERTS),
    "num_experts_per_tok": (1, _EXPERTS),
    "experts_per_token": (1, _EXPERTS),
    # tokens
    "sliding_window": (1, _WINDOW),
}
"""Integer fields kvoffload reads: (least, greatest) value (docs/models.md)."""

NOT_NULL = frozenset({"num_hidden_layers", "hidden_size", "num_attention_heads",
                      "vocab_size"})
"""Fields that may be absent (a config class supplies a default) but not ``null``."""

AUTO_FIELDS = frozenset({"mamba_d_head", "mamba_dt_rank"})
"""Integer fields that may also be ``"auto"`` (the config class works them out)."""

_LAYER_LISTS = ("layer_types", "layers_block_type")
_DTYPES = ("torch_dtype", "dtype", "mamba_ssm_cache_dtype")
_NAME_CHARS = 64
_FIX = "Correct the config (see the model's published config.json; docs/models.md lists " \
       "the bounds kvoffload accepts)."


def read_config_json(file: Path, where: str) -> dict[str, Any]:
    """The JSON object in ``file``, read with bounded time and memory
    (``kvoffload.files.read_json_object``); ``ConfigError`` naming ``where`` for a file
    that is not a regular file, over ``MAX_CONFIG_BYTES``, not UTF-8, nested deeper than
    ``MAX_CONFIG_DEPTH``, not JSON or not an object."""
    try:
        return read_json_object(file, max_bytes=MAX_CONFIG_BYTES, max_depth=MAX_CONFIG_DEPTH)
    except MalformedJsonError as exc:
        raise ConfigError(where, exc.reason, "Give a model's config.json.") from None
    except UnreadableFileError as exc:
        raise ConfigError(where, f"cannot be read: {exc.reason}",
                          "Give a model's config.json (a regular file of at most "
                          f"{MAX_CONFIG_BYTES:,} bytes).") from None


def check_config_fields(data: Mapping[str, Any], where: str) -> None:
    """``ConfigError`` naming ``where`` and the field for the first known field of
    ``data`` (or of its ``text_config``) of the wrong type or outside its bounds."""
    _check_level(data, where)
    text = data.get("text_config")
    if text is not None:
        if not isinstance(text, Mapping):
            raise ConfigError(f"{where}: text_config", f"must be an object, got "
                              f"{shown(text)}", _FIX)
        _check_level(text, f"{where}: text_config")


def check_int(where: str, key: str, value: Any, least: int, greatest: int) -> int:
    """``value`` when it is an integer (not a bool) in ``[least, greatest]``;
    ``ConfigError`` naming ``where`` and ``key`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) \
            or not least <= value <= greatest:
        raise ConfigError(f"{where}: {key}", f"must be an integer from {least:,} to "
                          f"{greatest:,}, got {shown(value)}", _FIX)
    return value


def check_model_size(where: str, *, bytes_per_token: int, bytes_per_state: int,
                     params_per_token: int) -> None:
    """``ConfigError`` naming ``where`` when a derived model's figures (one rank's) pass
    ``MAX_TOKEN_BYTES``, ``MAX_STATE_BYTES`` or ``MAX_PARAMS_PER_TOKEN``: fields each
    within their bounds may still multiply to a model no engine could hold."""
    for what, value, bound in (("bytes of KV cache per token", bytes_per_token,
                                MAX_TOKEN_BYTES),
                               ("bytes per recurrent-state snapshot", bytes_per_state,
                                MAX_STATE_BYTES),
                               ("parameters per token", params_per_token,
                                MAX_PARAMS_PER_TOKEN)):
        if value > bound:
            raise ConfigError(where, f"describes a model of {value:,} {what}, over the "
                              f"bound of {bound:,}", _FIX)


def int_bounds(key: str, least: int) -> tuple[int, int]:
    """The bounds of integer field ``key`` (``least`` is the caller's own floor)."""
    low, high = INT_BOUNDS.get(key, (least, _WIDTH))
    return max(low, least), high


def _check_level(d: Mapping[str, Any], where: str) -> None:
    for key, (least, greatest) in INT_BOUNDS.items():
        value = d.get(key)
        if value is None:
            if key in d and key in NOT_NULL:
                raise ConfigError(f"{where}: {key}", "is null", _FIX)
            continue
        if key in AUTO_FIELDS and value == "auto":
            continue
        check_int(where, key, value, least, greatest)
    value = d.get("model_type")
    if value is not None and (not isinstance(value, str) or len(value) > _NAME_CHARS):
        raise ConfigError(f"{where}: model_type", f"must be a name of at most {_NAME_CHARS} "
                          f"characters, got {shown(value)}", _FIX)
    for key in _DTYPES:
        value = d.get(key)
        if value is not None and (not isinstance(value, str) or value.removeprefix(
                "torch.").lower() not in DTYPE_BYTES):
            raise ConfigError(f"{where}: {key}", f"must name a dtype kvoffload knows "
                              f"({', '.join(sorted(DTYPE_BYTES))}), got {shown(value)}",
                              _FIX)
    _check_lists(d, where)
    pattern = d.get("hybrid_override_pattern")
    if pattern is not None and (not isinstance(pattern, str)
                                or not 1 <= len(pattern) <= MAX_LAYERS):
        raise ConfigError(f"{where}: hybrid_override_pattern", "must be a string of 1 to "
                          f"{MAX_LAYERS:,} characters (one a layer), got {shown(pattern)}",
                          _FIX)
    for key in ("use_sliding_window", "tie_word_embeddings"):
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise ConfigError(f"{where}: {key}", f"must be true or false, got "
                              f"{shown(d[key])}", _FIX)
    arch = d.get("architectures")
    if arch is not None and (not isinstance(arch, list) or len(arch) > 64
                             or not all(isinstance(a, str) and len(a) <= 256 for a in arch)):
        raise ConfigError(f"{where}: architectures", "must be a list of class names, got "
                          f"{shown(arch)}", _FIX)


def _check_lists(d: Mapping[str, Any], where: str) -> None:
    for key in _LAYER_LISTS:
        kinds = d.get(key)
        if kinds is None:
            continue
        if not isinstance(kinds, list) or not 1 <= len(kinds) <= MAX_LAYERS \
                or not all(isinstance(k, str) and len(k) <= _NAME_CHARS for k in kinds):
            raise ConfigError(f"{where}: {key}", f"must be a list of 1 to {MAX_LAYERS:,} "
                              f"layer kinds (one a layer), got {shown(kinds)}", _FIX)
        layers = d.get("num_hidden_layers")
        if key == "layer_types" and isinstance(layers, int) and layers != len(kinds):
            raise ConfigError(f"{where}: layer_types", f"lists {len(kinds):,} layers, but "
                              f"num_hidden_layers is {layers:,}", _FIX)
    only = d.get("mlp_only_layers")
    if only is not None and (
            not isinstance(only, list) or len(only) > MAX_LAYERS
            or not all(not isinstance(i, bool) and isinstance(i, int)
                       and 0 <= i < MAX_LAYERS for i in only)):
        raise ConfigError(f"{where}: mlp_only_layers", "must be a list of layer indices "
                          f"(integers from 0 to {MAX_LAYERS - 1:,}), got {shown(only)}", _FIX)
