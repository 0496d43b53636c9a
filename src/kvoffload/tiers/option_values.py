"""Values every lower tier's configuration shares: the write mode, the I/O thread bound,
and the parsers that read string options (``TierConfig.from_options``).

Each parser takes the value and the option's name and returns the typed value, or raises a
``ConfigError`` naming the option and what to give instead.
"""

from __future__ import annotations

import math
from enum import Enum

from kvoffload.errors import ConfigError, shown


class WriteMode(str, Enum):
    """When a lower tier receives a block."""

    WRITE_BACK = "write_back"
    """When host memory evicts it (the tier holds what host memory could not keep)."""
    WRITE_THROUGH = "write_through"
    """As soon as it is readable in host memory (the tier holds everything stored)."""


MAX_IO_THREADS = 256
"""The most I/O threads (and, times 16, pool connections) a tier accepts."""


def parse_bool(value: object, option: str) -> bool:
    """A boolean: a bool, or 1/true/yes/on, 0/false/no/off (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(option, f"cannot read {shown(value)} as a boolean", "Use true or false.")


def parse_write_mode(value: object, option: str) -> WriteMode:
    """A ``WriteMode`` by its value (any case, ``-`` for ``_``)."""
    try:
        return WriteMode(str(value).strip().lower().replace("-", "_"))
    except ValueError:
        raise ConfigError(option, f"unknown write mode {shown(value)}",
                          "Use write_back or write_through.") from None


def parse_text(value: object, option: str) -> str:
    """A string, as given (anything else is refused, not converted)."""
    if not isinstance(value, str):
        raise ConfigError(option, f"{shown(value)} ({type(value).__name__}) is not a string",
                          "Give it as a string.")
    return value


def parse_int(value: object, option: str) -> int:
    """A whole number, or its text in ASCII digits (an optional sign, surrounding blanks
    and ``_`` separators as Python writes them); other digits (``'٣'``, ``'³'``), a bool
    and a float are refused, as the size grammar refuses them."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = value.strip() if isinstance(value, str) else ""
    if text.lstrip("+-").replace("_", "").isascii() and len(text) <= 40:
        try:
            return int(text)
        except ValueError:
            pass
    raise ConfigError(option, f"cannot read {shown(value)} as an integer",
                      "Give a whole number in ASCII digits, e.g. 4.")


def parse_seconds(value: object, option: str) -> float:
    """A finite number (of seconds), or its text in ASCII characters (a bool and
    other digits are refused)."""
    text = str(value)
    try:
        if isinstance(value, bool) or not text.isascii():
            raise ValueError(text)
        number = float(text)
    except ValueError:
        raise ConfigError(option, f"cannot read {shown(value)} as a number",
                          "Give a number of seconds.") from None
    if not math.isfinite(number):
        raise ConfigError(option, f"{shown(value)} is not a finite number",
                          "Give a number of seconds, e.g. 1.0.")
    return number
