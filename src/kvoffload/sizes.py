"""The one size grammar: every option and flag that takes bytes reads it here.

Pure Python. ``parse_size(value, field)`` returns a whole number of bytes or raises
``ConfigError`` naming ``field``, what is wrong, and the grammar as the fix. It never raises
anything else, whatever ``value`` is (the tests fuzz it).

Grammar (also in docs/configuration.md):

* a non-negative integer count of bytes: ``1000000000``, or a Python/JSON integer
  (``True``/``False`` are not sizes);
* or a decimal number -- digits with an optional fraction, no sign, no exponent -- then
  an optional single space, then a unit, case-insensitive:

  ======================  ===============================================
  ``B``                   1
  ``K``, ``KB``           10**3   (``M``/``MB`` 10**6, ``G``/``GB`` 10**9,
                          ``T``/``TB`` 10**12)
  ``Ki``, ``KiB``         2**10   (``Mi``/``MiB`` 2**20, ``Gi``/``GiB`` 2**30,
                          ``Ti``/``TiB`` 2**40)
  ======================  ===============================================

  e.g. ``16GiB``, ``512 MiB``, ``1.5GB``, ``64k``, ``0.5 Ti``;
* the number times the unit must be a whole number of bytes (``1.5KiB`` is 1536;
  ``0.3B`` is refused), and at most ``MAX_SIZE`` (2**60 bytes, 1 EiB).

Exponents (``1e9``), signs, ``nan``, ``inf``, floats and anything else are refused.
Leading and trailing blanks are ignored. Callers that need a positive size pass
``minimum=1``.

The other way: ``format_size(n)`` writes a size in the grammar (whole GiB, else MiB rounded
up: ``parse_size`` reads it back as at least ``n``); ``format_bytes(n)`` is for people only
(``"1.5 GiB"``, one decimal, rounded: not meant to be read back).
"""

from __future__ import annotations

import math
import re

from kvoffload.errors import ConfigError, shown

MAX_SIZE = 1 << 60
"""The largest size any option accepts (1 EiB): larger is a typo, not a machine."""

SIZE_FIX = "Use a byte count such as 16GiB, 512MiB or 1000000000."
"""The fix every size error shows."""

UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
    "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40,
}
"""Each unit (lower case) and its multiplier in bytes."""

_MAX_TEXT = 64
_SIZE = re.compile(r"([0-9]+)(?:\.([0-9]+))? ?([a-z]*)", re.ASCII | re.IGNORECASE)


def parse_size(value: object, field: str, *, minimum: int = 0,
               maximum: int = MAX_SIZE) -> int:
    """``value`` (an int or a string in the grammar above) as bytes in
    ``[minimum, maximum]``; ``ConfigError`` naming ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(field, f"{shown(value)} ({type(value).__name__}) is not a size",
                          SIZE_FIX)
    number = value if isinstance(value, int) else _parse_text(value, field)
    if number < minimum:
        problem = ("must be positive" if minimum == 1
                   else f"must be at least {minimum} bytes")
        raise ConfigError(field, f"{problem}, got {shown(value)}", SIZE_FIX)
    if number > maximum:
        raise ConfigError(field, f"{shown(value)} is more than the largest size accepted "
                          f"({maximum} bytes)", SIZE_FIX)
    return number


def _parse_text(text: str, field: str) -> int:
    stripped = text.strip()
    match = _SIZE.fullmatch(stripped) if len(stripped) <= _MAX_TEXT else None
    unit = match.group(3).lower() if match else ""
    if match is None or unit not in UNITS:
        raise ConfigError(field, f"{shown(text)} is not a size", SIZE_FIX)
    whole, fraction = match.group(1), match.group(2) or ""
    scaled = int(whole + fraction) * UNITS[unit]
    scale: int = 10 ** len(fraction)
    number, rest = divmod(scaled, scale)
    if rest:
        raise ConfigError(field, f"{shown(text)} is not a whole number of bytes", SIZE_FIX)
    return number


GiB = 1 << 30


def format_size(nbytes: int) -> str:
    """``nbytes`` in the size grammar: whole GiB, else MiB (rounded up)."""
    if nbytes % GiB == 0:
        return f"{nbytes // GiB}GiB"
    return f"{math.ceil(nbytes / (1 << 20))}MiB"


def format_bytes(n: float) -> str:
    """``n`` bytes for a reader: the largest binary unit it reaches, one decimal."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
