"""The one size grammar (``kvoffload.sizes``): what it reads, what it refuses, and that it
never raises anything but ``ConfigError``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.sizes import MAX_SIZE, SIZE_FIX, UNITS, format_bytes, format_size, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), (4096, 4096), (0, 0), ("0", 0),
    ("16G", 16 * 10**9), ("16GB", 16 * 10**9), ("16gb", 16 * 10**9),
    ("16Gi", 16 << 30), ("16GiB", 16 << 30), ("16 gib", 16 << 30),
    ("512MiB", 512 << 20), ("512 MiB", 512 << 20), ("1.5GB", 1_500_000_000),
    ("1.5KiB", 1536), ("64k", 64_000), ("2T", 2 * 10**12), ("1TiB", 1 << 40),
    ("0.5 Ti", 1 << 39), ("100B", 100), ("  8GiB ", 8 << 30), ("2.0", 2),
    (MAX_SIZE, MAX_SIZE), ("1048576TiB", MAX_SIZE),
])
def test_reads_the_grammar(text: str | int, expected: int) -> None:
    assert parse_size(text, "x") == expected


@pytest.mark.parametrize(("value", "problem"), [
    ("1e9", "not a size"), ("-5", "not a size"), ("nan", "not a size"), ("inf", "not a size"),
    ("16GiBs", "not a size"), ("16  GiB", "not a size"), ("", "not a size"),
    (".5G", "not a size"), ("1,000", "not a size"), ("١٢", "not a size"),
    ("0.3B", "not a whole number"), ("1.0001K", "not a whole number"),
    (True, "(bool) is not a size"), (1.5, "(float) is not a size"),
    (1e9, "(float) is not a size"), (None, "(NoneType) is not a size"),
    ([1], "(list) is not a size"), (-1, "must be at least 0"),
    (MAX_SIZE + 1, "largest size"), ("1048577TiB", "largest size"), ("9" * 80, "not a size"),
])
def test_refuses_everything_else_naming_the_field(value: object, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, "some.field")
    assert info.value.field == "some.field"
    assert problem in info.value.problem
    assert info.value.fix == SIZE_FIX


def test_minimum_and_maximum() -> None:
    with pytest.raises(ConfigError, match="must be positive"):
        parse_size("0GiB", "x", minimum=1)
    with pytest.raises(ConfigError, match="largest size"):
        parse_size("2KiB", "x", maximum=1024)
    assert parse_size("1KiB", "x", minimum=1, maximum=1024) == 1024


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=40), st.integers(), st.floats(), st.booleans(), st.none(),
                 st.from_regex(r"\A[0-9]{1,6}(\.[0-9]{1,4})? ?[kmgtKMGT]?[iI]?[bB]?\Z")))
def test_any_value_is_an_int_or_a_config_error(value: object) -> None:
    try:
        result = parse_size(value, "f")
    except ConfigError as exc:
        assert exc.field == "f"
    else:
        assert isinstance(result, int) and not isinstance(result, bool)
        assert 0 <= result <= MAX_SIZE


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(sorted(UNITS)), st.booleans(),
       st.sampled_from(["", " "]))
def test_valid_strings_round_trip(number: int, unit: str, upper: bool, space: str) -> None:
    written = unit.upper() if upper else unit
    text = f"{number}{space if unit else ''}{written}"
    assert parse_size(text, "f") == number * UNITS[unit]
    half = f"{number}.5{space}{written}"
    if UNITS[unit] % 2 == 0:
        assert parse_size(half, "f") == number * UNITS[unit] + UNITS[unit] // 2
    else:
        with pytest.raises(ConfigError, match="whole number"):
            parse_size(half, "f")


@given(st.integers(1, 1 << 50))
def test_format_size_writes_the_grammar_and_never_less(nbytes: int) -> None:
    written = format_size(nbytes)
    back = parse_size(written, "x")
    assert back >= nbytes and back - nbytes < 1 << 20
    assert written.endswith("GiB") == (nbytes % (1 << 30) == 0)


@pytest.mark.parametrize(("nbytes", "shown"), [
    (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (64 << 30, "64.0 GiB"),
    (3 << 40, "3.0 TiB"),
])
def test_format_bytes_is_for_people(nbytes: int, shown: str) -> None:
    assert format_bytes(nbytes) == shown
