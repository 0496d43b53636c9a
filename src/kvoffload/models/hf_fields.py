"""Reading one model's config fields: ``ModelFields`` and dtype sizes.

``ModelFields`` gives uniform read access to a Hugging Face config, whether it came through
``transformers``' config class (which fills in defaults) or as config.json data (where every
field the derivation needs must be present). A missing or malformed field is a one-line
``ConfigError`` naming the config and the field. ``dtype_bytes`` turns a dtype name into
bytes per element. Used by ``kvoffload.models.hf_config`` (which loads configs and derives
presets), ``hf_families`` and ``hf_shapes``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.models.hf_bounds import DTYPE_BYTES, check_config_fields, check_int, int_bounds


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
        text model; its other fields, e.g. the dtype, fall back to the top level).
        ``ConfigError`` for a known field of the wrong type or outside the bounds of
        ``kvoffload.models.hf_bounds``."""
        check_config_fields(data, where)
        text = data.get("text_config")
        if not isinstance(text, Mapping):
            return cls(dict(data), top=dict(data), where=where, from_class=False)
        model_type = text_model_type(data)
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
        """``value`` when an integer from ``minimum`` to the field's bound
        (``hf_bounds.INT_BOUNDS``); ``ConfigError`` naming the field otherwise."""
        least, greatest = int_bounds(key, minimum)
        return check_int(self.where, key, value, least, greatest)


_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}
"""Multimodal wrappers whose ``text_config`` may leave out its ``model_type``."""


def text_model_type(data: Mapping[str, Any]) -> str | None:
    """The ``model_type`` of a config's text model (a wrapper's ``text_config``)."""
    top = data.get("model_type")
    text = data.get("text_config")
    if isinstance(text, Mapping):
        if isinstance(text.get("model_type"), str):
            return str(text["model_type"])
        if isinstance(top, str) and top in _TEXT_MODEL_TYPES:
            return _TEXT_MODEL_TYPES[top]
    return top if isinstance(top, str) else None


def dtype_bytes(name: Any, where: str, *, float32_runs_as: int | None = None) -> int:
    """Bytes of one element of dtype ``name`` (a string or a ``torch.dtype``).

    ``float32_runs_as``: what a float32 *model* dtype becomes (vLLM's ``--dtype auto``
    runs float32 checkpoints in 16 bits); None keeps float32.
    """
    text = str(name).removeprefix("torch.").lower()
    size = DTYPE_BYTES.get(text)
    if size is None:
        raise ConfigError(where, f"dtype {text!r} is not one kvoffload knows",
                          f"Use one of {', '.join(sorted(DTYPE_BYTES))}.")
    if size == 4 and float32_runs_as is not None:
        return float32_runs_as
    return size
