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
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    import jinja2

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
"""The special tokens a chat template sees as variables (as ``transformers`` passes
them)."""


class ModelTokenizer:
    """A model's tokenizer (``tokenizer.json``) and chat template, loaded offline.

    Args:
        model: a model directory holding ``tokenizer.json`` (and optionally
            ``tokenizer_config.json``, ``chat_template.jinja``, ``chat_template.json``),
            or the path of a ``tokenizer.json``.
        chat_template: a Jinja template file to use instead of the model's.

    Raises:
        ConfigError: field ``"model"`` or ``"chat_template"``, when a file is missing,
            unreadable or malformed.
    """

    def __init__(self, model: str | Path, chat_template: str | Path | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - the cli extra pulls it in
            raise ConfigError("model", "the 'tokenizers' package is not installed",
                              "Install kvoffload[cli] (or pip install tokenizers).") from None
        path = Path(model)
        directory = path if path.is_dir() else path.parent
        tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        if not tokenizer_file.is_file():
            problem = (f"{path} does not exist" if not path.exists() else
                       f"{path} holds no tokenizer.json" if path.is_dir() else
                       f"{path} is not a regular file")
            raise ConfigError("model", problem,
                              "Give a local model directory that holds tokenizer.json "
                              "(nothing is downloaded).")
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
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
            self._compiled[name] = _compile(text, self.template_source)

    @property
    def has_template(self) -> bool:
        return bool(self._compiled)

    def render(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of ``messages`` (raises whatever the template raises)."""
        if not self._compiled:
            return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + \
                "assistant:"
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        template = self._compiled.get(name) or next(iter(self._compiled.values()))
        return template.render(messages=messages, tools=tools, documents=None,
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


def _json_file(path: Path, field: str) -> dict[str, Any]:
    """A JSON object file; ``{}`` when it does not exist."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(field, f"{path} cannot be read ({exc})",
                          "Give the file the model ships, or remove it.") from None
    if not isinstance(data, dict):
        raise ConfigError(field, f"{path} is not a JSON object",
                          "Give the file the model ships, or remove it.")
    return data


def _find_templates(directory: Path, config: dict[str, Any],
                    override: str | Path | None) -> tuple[dict[str, str], str | None]:
    """The chat templates by name (``default``, ``tool_use``, ...) and where they came
    from; ``({}, None)`` for a model without one."""
    fix = "Give a Jinja chat template (the file a Hugging Face model ships)."
    if override is not None:
        try:
            return {"default": Path(override).read_text(encoding="utf-8")}, str(override)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("chat_template", f"{override} cannot be read ({exc})",
                              fix) from None
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return {"default": jinja_file.read_text(encoding="utf-8")}, str(jinja_file)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("chat_template", f"{jinja_file} cannot be read ({exc})",
                              fix) from None
    json_file = directory / "chat_template.json"
    if json_file.is_file():
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


def _compile(text: str, source: str | None) -> jinja2.Template:
    """Compile a chat template in the environment ``transformers`` renders it in."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - the cli extra pulls it in
        raise ConfigError("chat_template", "the 'jinja2' package is not installed",
                          "Install kvoffload[cli] (or pip install jinja2).") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(_without_generation_tags(text))
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError("chat_template", f"{source}: line {exc.lineno}: {exc.message}",
                          "Fix the template or give another with --chat-template.") from None


def _without_generation_tags(text: str) -> str:
    """``{% generation %}`` blocks (an extension of ``transformers`` that marks assistant
    text) render their body unchanged: drop the tags."""
    import re

    return re.sub(r"\{%-?\s*(?:end)?generation\s*-?%\}", "", text)
