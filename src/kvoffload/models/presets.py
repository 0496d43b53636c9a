"""The built-in model presets, by name: ``PRESETS`` and ``get_preset``.

Contract. ``PRESETS`` is a read-only mapping of every built-in preset by name, in
``presets.json``'s order (this package's data: the public config.json fields of each model,
with where they came from); ``get_preset(name)`` is one of them, or a ``ConfigError`` listing
the names. Each preset is derived by ``kvoffload.models.hf_config`` (one code path with
``--model``), the same object on every lookup, for one rank (``hf_config.resolve_model``
gives a preset for several).

The presets are built on first use: importing this module reads no file and derives
nothing. The first lookup, iteration, ``len`` or ``in`` reads ``presets.json`` and derives
every preset once (``hf_config.builtin_presets``, cached); the named presets below
(``LLAMA3_8B`` ...) are looked up when first imported or read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from kvoffload.errors import ConfigError
from kvoffload.models import hf_config
from kvoffload.models.preset import ModelPreset

__all__ = ["PRESETS", "BuiltinPresets", "get_preset"]


class BuiltinPresets(Mapping[str, ModelPreset]):
    """A read-only view of the built-in presets, derived on its first use."""

    def __getitem__(self, name: str) -> ModelPreset:
        return hf_config.builtin_presets()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(hf_config.builtin_presets())

    def __len__(self) -> int:
        return len(hf_config.builtin_presets())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self)})"


PRESETS: Mapping[str, ModelPreset] = BuiltinPresets()
"""Every built-in preset by name: ``presets.json`` derived by ``hf_config`` on first use."""

_NAMED = {"LLAMA3_8B": "llama3-8b", "GPT_OSS_20B": "gpt-oss-20b",
          "GEMMA3_27B": "gemma3-27b", "NEMOTRON_H_8B": "nemotron-h-8b"}
"""Module attributes naming one preset each, looked up on first access (``__getattr__``)."""


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; ``ConfigError`` listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError("model", f"unknown preset {name!r}",
                          f"Choose one of: {', '.join(sorted(PRESETS))}.") from None


def __getattr__(attr: str) -> ModelPreset:
    """``LLAMA3_8B``, ``GPT_OSS_20B``, ``GEMMA3_27B``, ``NEMOTRON_H_8B``: those presets."""
    if attr in _NAMED:
        return PRESETS[_NAMED[attr]]
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
