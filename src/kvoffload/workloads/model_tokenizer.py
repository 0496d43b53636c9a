"""A model's tokenizer and chat template, loaded offline, for ``convert_log``.

``ModelTokenizer(model_dir)`` loads ``tokenizer.json`` (the ``tokenizers`` library) and the
model's chat template (``chat_template.jinja``, ``chat_template.json`` or
``tokenizer_config.json``, in that order, or a template file given). ``render`` renders a
conversation the way ``transformers``' ``apply_chat_template`` does (a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the special tokens as variables,
``add_generation_prompt=True``, ``raise_exception``, ``strftime_now`` and a ``tojson`` that
keeps non-ASCII text); ``encode`` tokenizes without adding special tokens after a template,
with them for the plain ``role: content`` rendering of a model without one. A missing,
unreadable or malformed file is a ``ConfigError`` (field ``model`` or ``chat_template``).

Every file is read through ``kvoffload.files``' bounded readers: it must be a regular file
(a FIFO, device or directory is refused at once, without waiting on it) of at most
``MAX_TOKENIZER_BYTES`` (``tokenizer.json``), ``MAX_MODEL_JSON_BYTES`` (the JSON files,
whose brackets may nest at most ``MAX_MODEL_JSON_NESTING`` deep) or ``MAX_TEMPLATE_BYTES``
(a Jinja file), read no further than that. Templates are compiled and rendered with the
time and size bounds of ``kvoffload.workloads.chat_template``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoffload.errors import ConfigError
from kvoffload.files import UnreadableFileError, read_json_object, read_regular_text
from kvoffload.workloads.chat_template import RENDER_SECONDS, compile_template, render

if TYPE_CHECKING:
    import jinja2

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
"""The special tokens a chat template sees as variables (as ``transformers`` passes
them)."""

MAX_TOKENIZER_BYTES = 128 << 20
"""Largest accepted ``tokenizer.json`` (128 MiB; Gemma 3's, with 262,144 tokens, is 33 MB)."""

MAX_MODEL_JSON_BYTES = 16 << 20
"""Largest accepted ``tokenizer_config.json`` or ``chat_template.json`` (16 MiB; they are
kilobytes, a megabyte or two with many added tokens)."""

MAX_MODEL_JSON_NESTING = 64
"""Deepest accepted bracket nesting in those JSON files (they nest 3 or 4 deep)."""

MAX_TEMPLATE_BYTES = 1 << 20
"""Largest accepted Jinja template file (1 MiB; real chat templates are a few KB)."""

_FILE_FIX = "Give the file the model ships, or remove it."
_TEMPLATE_FIX = "Give a Jinja chat template (the file a Hugging Face model ships)."


class ModelTokenizer:
    """A model's tokenizer (``tokenizer.json``) and chat template, loaded offline.

    Args:
        model: a model directory holding ``tokenizer.json`` (and optionally
            ``tokenizer_config.json``, ``chat_template.jinja``, ``chat_template.json``),
            or the path of a ``tokenizer.json``.
        chat_template: a Jinja template file to use instead of the model's.
        render_seconds: time one conversation's rendering may take.

    Raises:
        ConfigError: field ``"model"`` or ``"chat_template"``, when a file is missing,
            unreadable or malformed.
    """

    def __init__(self, model: str | Path, chat_template: str | Path | None = None, *,
                 render_seconds: float = RENDER_SECONDS) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - the cli extra pulls it in
            raise ConfigError("model", "the 'tokenizers' package is not installed",
                              "Install kvoffload[cli] (or pip install tokenizers).") from None
        path = Path(model)
        directory = path if path.is_dir() else path.parent
        tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        fix = "Give a local model directory that holds tokenizer.json (nothing is downloaded)."
        if not path.exists():
            raise ConfigError("model", f"{path} does not exist", fix)
        if path.is_dir() and not tokenizer_file.exists():
            raise ConfigError("model", f"{path} holds no tokenizer.json", fix)
        text = _read(tokenizer_file, "model", MAX_TOKENIZER_BYTES, fix)
        try:
            self._tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise ConfigError("model", f"{tokenizer_file} cannot be loaded ({exc})",
                              "Give the tokenizer.json a Hugging Face model ships.") from None
        # A tokenizer.json may carry truncation or padding settings; a prompt is neither
        # truncated nor padded (transformers turns both off unless asked).
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.tokenizer_file = tokenizer_file
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values(), default=-1) + 1
        """One more than the largest token id (added tokens included)."""
        config = _json_file(directory / "tokenizer_config.json", "model")
        self.special_tokens: dict[str, Any] = {}
        for name in SPECIAL_TOKENS:
            value = _token_text(config.get(name))
            if value is not None:
                self.special_tokens[name] = value
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            self.special_tokens["additional_special_tokens"] = [
                t for t in (_token_text(item) for item in extra) if t is not None]
        self.templates, self.template_source = _find_templates(directory, config,
                                                               chat_template)
        self._compiled: dict[str, jinja2.Template] = {}
        for name, text in self.templates.items():
            self._compiled[name] = compile_template(text, self.template_source,
                                                    render_seconds=render_seconds)

    @property
    def has_template(self) -> bool:
        return bool(self._compiled)

    def render(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of ``messages``: ``TemplateBoundError`` when rendering passes a
        bound (``kvoffload.workloads.chat_template``), whatever the template raises
        otherwise."""
        if not self._compiled:
            return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + \
                "assistant:"
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        template = self._compiled.get(name) or next(iter(self._compiled.values()))
        return render(template, messages=messages, tools=tools, documents=None,
                      add_generation_prompt=True, **self.special_tokens)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text: without special tokens after a chat template (as
        ``apply_chat_template``), with them for the plain rendering."""
        encodings = self._tokenizer.encode_batch(list(texts),
                                                 add_special_tokens=not self._compiled)
        return [e.ids for e in encodings]


def _token_text(value: object) -> str | None:
    """A special token of ``tokenizer_config.json``: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read(path: Path, field: str, max_bytes: int, fix: str) -> str:
    """The text of ``path`` through the bounded reader; ``ConfigError`` naming it."""
    try:
        return read_regular_text(path, max_bytes=max_bytes)
    except UnreadableFileError as exc:
        raise ConfigError(field, str(exc), fix) from None


def _json_file(path: Path, field: str) -> dict[str, Any]:
    """A JSON object file; ``{}`` when it does not exist (a dangling link included)."""
    if not path.exists():
        return {}
    try:
        return read_json_object(path, max_bytes=MAX_MODEL_JSON_BYTES,
                                max_depth=MAX_MODEL_JSON_NESTING)
    except UnreadableFileError as exc:
        raise ConfigError(field, str(exc), _FILE_FIX) from None


def _find_templates(directory: Path, config: dict[str, Any],
                    override: str | Path | None) -> tuple[dict[str, str], str | None]:
    """The chat templates by name (``default``, ``tool_use``, ...) and where they came
    from; ``({}, None)`` for a model without one."""
    fix = _TEMPLATE_FIX
    if override is not None:
        return ({"default": _read(Path(override), "chat_template", MAX_TEMPLATE_BYTES, fix)},
                str(override))
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.exists():
        return ({"default": _read(jinja_file, "chat_template", MAX_TEMPLATE_BYTES, fix)},
                str(jinja_file))
    json_file = directory / "chat_template.json"
    if json_file.exists():
        source, value = str(json_file), _json_file(json_file, "chat_template").get(
            "chat_template")
    else:
        source, value = str(directory / "tokenizer_config.json"), config.get("chat_template")
    if value is None:
        return {}, None
    if isinstance(value, str):
        return {"default": value}, source
    if isinstance(value, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}, source
    raise ConfigError("chat_template", f"{source}: 'chat_template' is neither a string nor "
                      "a list of {name, template} objects", fix)
