"""Chat templates compiled and rendered with bounded time and memory, for ``trace convert``.

A chat template is code shipped with a model (or given with ``--chat-template``); a
careless or hostile one can loop for hours (two nested loops over ``range(100000)``), build
a gigabyte string in one expression (``"x" * 10**9``) or compute a huge number
(``10 ** 10 ** 8``). ``compile_template`` compiles it in the sandboxed environment
``transformers`` renders templates in (``ImmutableSandboxedEnvironment``, which caps
``range()`` at 100,000 items and refuses unsafe attributes), with these bounds added:

* every ``{% for %}`` loop's iterable is passed through a guard that checks the render's
  deadline every 256 items, and every call the template makes (a function, macro, method
  or ``range()``) checks it too, so nested loops stop at ``RENDER_SECONDS`` whatever their
  body;
* ``*`` on a string or list is refused when the result would exceed ``MAX_RENDER_CHARS``
  items, ``**`` on integers when the result would exceed ``MAX_POWER_BITS`` bits, before
  the work is done; so are the operations that build a big string or list from a small
  argument: a width or count over ``MAX_WIDTH`` (``center``, ``indent``, ``batch``,
  ``slice``, ``ljust``, ``rjust``, ``zfill``, ``expandtabs``, a ``tojson`` indent, a width
  in a ``%`` or ``format`` specification), a ``join`` or ``replace`` whose result would
  pass ``MAX_RENDER_CHARS``;
* ``render`` streams the output (``Template.generate``) and stops as soon as it passes
  ``MAX_RENDER_CHARS`` characters or the deadline, so memory stays within the cap.

A render beyond a bound raises ``TemplateBoundError`` (a ``ValueError``) whose message says
which bound; the template's own errors pass through as they are. An environment serves one
render at a time (it holds the running render's deadline).
"""

from __future__ import annotations

import functools
import io
import json
import math
import re
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    import jinja2

MAX_RENDER_CHARS = 16 << 20
"""Longest rendered prompt, in characters (16 Mi: eight times the text of a prompt at the
trace's 2,097,152-token bound)."""

RENDER_SECONDS = 5.0
"""Time one conversation's rendering may take (real chat templates take milliseconds)."""

MAX_POWER_BITS = 1 << 16
"""Largest integer ``**`` may compute in a template, in bits."""

MAX_WIDTH = 1 << 16
"""Largest width, tab size or count a template may give to an operation that builds a
string or list of that size (``center(w)``, ``indent(w)``, ``batch(n)``, ``"%*d"``...)."""

_WIDTH_FILTERS = {"center": 1, "indent": 1, "batch": 1, "slice": 1}  # name -> arg index
_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
_PERCENT_WIDTH = re.compile(r"%[-+ #0]*(?:\*|\d{6,})")
_FORMAT_WIDTH = re.compile(r"\{[^{}]*:[^{}]*?\d{6,}[^{}]*\}")
_GUARD = "kvoffload_loop_guard"
_CHECK_EVERY = 256


class TemplateBoundError(ValueError):
    """A chat template's rendering passed a bound (time, output size, one operation's
    size); the message says which."""


def compile_template(text: str, source: str | None, *,
                     render_seconds: float = RENDER_SECONDS) -> jinja2.Template:
    """``text`` compiled in the bounded sandbox (module docstring); ``ConfigError``
    (field ``chat_template``, naming ``source``) for a syntax error."""
    try:
        import jinja2
    except ImportError:  # pragma: no cover - the cli extra pulls it in
        raise ConfigError("chat_template", "the 'jinja2' package is not installed",
                          "Install kvoffload[cli] (or pip install jinja2).") from None
    env = _environment(render_seconds)
    try:
        return env.from_string(_without_generation_tags(text))
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError("chat_template", f"{source}: line {exc.lineno}: {exc.message}",
                          "Fix the template or give another with --chat-template.") from None


def render(template: jinja2.Template, **variables: Any) -> str:
    """``template`` rendered with ``variables`` within the bounds; ``TemplateBoundError``
    when it passes one, whatever the template raises otherwise."""
    env: Any = template.environment
    start = getattr(env, "start", None)
    if start is None:  # not compiled by compile_template: no bounds to keep
        return template.render(**variables)
    start()
    try:
        out = io.StringIO()  # the characters, not a pointer per piece
        total = 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            if total > MAX_RENDER_CHARS:
                raise TemplateBoundError(f"renders over {MAX_RENDER_CHARS:,} characters")
            env.check()
            out.write(chunk)
        return out.getvalue()
    finally:
        env.stop()


def _environment(render_seconds: float) -> jinja2.Environment:
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox with a deadline, loop guards and size checks on ``*``/``**``."""

        intercepted_binops = frozenset({"*", "**", "%"})

        def __init__(self) -> None:
            super().__init__(trim_blocks=True, lstrip_blocks=True,
                             extensions=[jinja2.ext.loopcontrols])
            self.deadline = math.inf
            self.filters[_GUARD] = self.guard

        def start(self) -> None:
            self.deadline = time.monotonic() + render_seconds

        def stop(self) -> None:
            self.deadline = math.inf

        def check(self) -> None:
            if time.monotonic() > self.deadline:
                raise TemplateBoundError(f"takes over {render_seconds:g} s to render")

        def guard(self, iterable: Iterable[Any]) -> Iterator[Any]:
            check = self.check
            for i, item in enumerate(iterable):
                if not i % _CHECK_EVERY:
                    check()
                yield item

        def call(__self, __context: Any, __obj: Any, *args: Any,  # noqa: N805
                 **kwargs: Any) -> Any:
            __self.check()
            method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped
            owner = getattr(method, "__self__", None)
            if isinstance(owner, str):
                args = _check_str_method(owner, method.__name__, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):
                loop.iter = nodes.Filter(loop.iter, _GUARD, [], [], None, None,
                                         lineno=loop.iter.lineno)
            return tree

    env = BoundedEnvironment()
    for name, index in _WIDTH_FILTERS.items():
        env.filters[name] = _bounded_filter(env.filters[name], name, index)
    env.filters["join"] = _bounded_join(env.filters["join"])
    env.filters["replace"] = _bounded_replace(env.filters["replace"])
    env.filters["format"] = _bounded_format(env.filters["format"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    _check_width("tojson", indent)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _check_width(what: str, value: object) -> None:
    """Refuse a width or count over ``MAX_WIDTH`` given to ``what``."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_WIDTH:
        raise TemplateBoundError(f"gives {what} a width or count over {MAX_WIDTH:,}")


def _check_result(what: str, size: int) -> None:
    if size > MAX_RENDER_CHARS:
        raise TemplateBoundError(f"builds a {what} result over {MAX_RENDER_CHARS:,} "
                                 "characters")


def _check_format_string(what: str, text: object, pattern: re.Pattern[str]) -> None:
    if isinstance(text, str) and pattern.search(text):
        raise TemplateBoundError(f"gives {what} a width of a million or more (or '*')")


def _replaced_size(text: str, old: str, new: str, count: int = -1) -> int:
    """Length of ``text.replace(old, new, count)``, computed without building it."""
    hits = text.count(old) if old else len(text) + 1
    if count >= 0:
        hits = min(hits, count)
    return len(text) + hits * (len(new) - len(old))


def _check_str_method(owner: str, name: str, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Refuse a call of string method ``owner.name`` that would build a string over the
    bounds; the arguments to call it with (an iterable given to ``join`` as a list)."""
    if name in _WIDTH_METHODS:
        for value in (*args, *kwargs.values()):
            _check_width(f"str.{name}", value)
    elif name == "join" and args:
        items = list(args[0])
        _check_result("join", len(owner) * max(len(items) - 1, 0)
                      + sum(len(i) for i in items if isinstance(i, str)))
        return (items, *args[1:])
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        count = args[2] if len(args) > 2 and isinstance(args[2], int) else -1
        _check_result("replace", _replaced_size(owner, args[0], args[1], count))
    elif name in ("format", "format_map"):
        _check_format_string("str.format", owner, _FORMAT_WIDTH)
    return args


def _bounded_filter(inner: Any, name: str, index: int) -> Any:
    """Filter ``inner`` with its argument ``index`` (after the value) bounded by
    ``MAX_WIDTH``."""
    @functools.wraps(inner)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        value_at = 1 if hasattr(inner, "jinja_pass_arg") else 0
        for value in (*args[value_at + index:value_at + index + 1], *kwargs.values()):
            _check_width(name, value)
        return inner(*args, **kwargs)
    return bounded


def _bounded_join(inner: Any) -> Any:
    @functools.wraps(inner)
    def join(eval_ctx: Any, value: Iterable[Any], d: str = "",
             attribute: Any = None) -> Any:
        items = list(value)
        _check_result("join", len(str(d)) * max(len(items) - 1, 0)
                      + sum(len(i) for i in items if isinstance(i, str)))
        return inner(eval_ctx, items, d, attribute)
    return join


def _bounded_replace(inner: Any) -> Any:
    @functools.wraps(inner)
    def replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> Any:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            _check_result("replace", _replaced_size(
                s, old, new, count if isinstance(count, int) else -1))
        return inner(eval_ctx, s, old, new, count)
    return replace


def _bounded_format(inner: Any) -> Any:
    @functools.wraps(inner)
    def format(value: Any, *args: Any, **kwargs: Any) -> Any:
        _check_format_string("format", value, _PERCENT_WIDTH)
        return inner(value, *args, **kwargs)
    return format


def _check_binop(operator: str, left: object, right: object) -> None:
    """Refuse ``*``, ``**`` and ``%`` whose result would pass the size bounds."""
    if operator == "%":
        _check_format_string("'%'", left, _PERCENT_WIDTH)
    elif operator == "*":
        for seq, count in ((left, right), (right, left)):
            if (isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                    and len(seq) * max(count, 0) > MAX_RENDER_CHARS):
                raise TemplateBoundError(f"repeats a sequence of {len(seq):,} items "
                                         f"into over {MAX_RENDER_CHARS:,}")
    elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
            and right > 0 and abs(left) > 1
            and (abs(left).bit_length() - 1) * right > MAX_POWER_BITS):
        raise TemplateBoundError(f"computes a power of over {MAX_POWER_BITS:,} bits")


def _without_generation_tags(text: str) -> str:
    """``{% generation %}`` blocks (an extension of ``transformers`` that marks assistant
    text) render their body unchanged: drop the tags."""
    return re.sub(r"\{%-?\s*(?:end)?generation\s*-?%\}", "", text)
