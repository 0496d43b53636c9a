"""Exceptions raised by kvoffload.

Outcomes (a miss, "no room") are return values, not exceptions. Exceptions are for misuse
(a bad configuration, a malformed trace, an engine layout the library cannot handle) and
for broken invariants that indicate a bug (``InvariantError``).
"""

from __future__ import annotations

SHOWN_CHARS = 80
"""Longest rendering of an offending value in an error message (``shown``)."""


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with a note of
    the full length, so a 10 MB field or a 100 KiB flag is named without being echoed."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


class KVOffloadError(Exception):
    """Base class of every error kvoffload raises on purpose."""


class ConfigError(KVOffloadError, ValueError):
    """A configuration value is invalid. The message names the field and the fix."""

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. {fix}")


class LayoutError(KVOffloadError, ValueError):
    """An engine's KV-cache tensors cannot be handled. The message names the layer and shape."""


class TraceError(KVOffloadError, ValueError):
    """A request trace is malformed. The message names the file, line and field."""

    def __init__(self, path: str, line: int, field: str, problem: str) -> None:
        self.path = path
        self.line = line
        self.field = field
        super().__init__(f"{path}:{line}: field {field!r}: {problem}")


class InvariantError(KVOffloadError, AssertionError):
    """Internal bookkeeping broke a rule it must keep (a bug, never a user error).

    Raised instead of silently tolerating, for example, a completion report for a job
    that never existed, or a ref count that would go negative.
    """
