"""``kvoffload.files``: named files are read within bounds, and anything but a regular file
is refused without waiting on it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.files import (
    MalformedJsonError,
    UnreadableFileError,
    json_too_deep,
    read_json_object,
    read_regular_file,
    read_regular_text,
)


def test_a_regular_file_within_the_bound_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "f.json"
    path.write_bytes(b"\xef\xbb\xbf{\"a\": 1}")
    assert read_regular_file(path, max_bytes=11) == b"\xef\xbb\xbf{\"a\": 1}"
    assert read_regular_text(path, max_bytes=11) == '{"a": 1}'


def test_a_file_over_the_bound_is_refused_after_reading_one_byte_more(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"x" * 101)
    with pytest.raises(UnreadableFileError, match=r"big is over 100 bytes"):
        read_regular_file(path, max_bytes=100)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_link_to_dev_zero_is_refused_as_a_device(tmp_path: Path) -> None:
    link = tmp_path / "tokenizer_config.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(UnreadableFileError, match="is a device, not a regular file"):
        read_regular_file(link, max_bytes=1 << 20)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "template.jinja"
    os.mkfifo(fifo)
    with pytest.raises(UnreadableFileError, match="is a FIFO, not a regular file"):
        read_regular_text(fifo, max_bytes=1 << 20)


@pytest.mark.parametrize("name, reason", [
    ("missing", "cannot be opened"),
    ("dir", "is a directory"),
    ("bad\0name", "NUL byte"),
])
def test_unreadable_paths_name_what_they_are(tmp_path: Path, name: str, reason: str) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(UnreadableFileError, match=reason):
        read_regular_file(str(tmp_path) + "/" + name, max_bytes=10)


def test_bytes_that_are_not_utf8_are_refused_with_their_offset(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_bytes(b"ok\xff")
    with pytest.raises(UnreadableFileError, match=r"not valid UTF-8 \(byte 3\)"):
        read_regular_text(path, max_bytes=10)


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet="[]{}\"\\ab"),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(alphabet="[]{}\"\\ab", max_size=4), inner,
                                       max_size=3),
                     max_leaves=20)


@given(_json, st.integers(min_value=0, max_value=8))
def test_json_too_deep_agrees_with_the_parsed_depth(value: object, limit: int) -> None:
    """Brackets inside strings (escaped quotes included) do not count."""
    assert json_too_deep(json.dumps(value), limit) == (_depth(value) > limit)


def test_json_too_deep_scans_deep_text_without_recursion() -> None:
    assert json_too_deep("[" * 1_000_000, 64)
    assert not json_too_deep("[" * 64 + "]" * 64, 64)


def test_an_offending_value_is_shown_cut_to_a_readable_length() -> None:
    from kvoffload.errors import shown
    assert shown("abc") == "'abc'"
    long = shown("x" * 10_000_000)
    assert long.startswith("'xxx") and long.endswith("... (10,000,002 characters)")
    assert len(long) < 120


@pytest.mark.parametrize("text, reason", [
    ("[" * 40 + "]" * 40, "nests deeper than 32 levels"),
    ("{", "cannot be read as JSON"),
    ("[1, 2]", "is not a JSON object"),
])
def test_a_file_that_is_not_a_json_object_is_malformed(tmp_path: Path, text: str,
                                                       reason: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(MalformedJsonError, match=reason):
        read_json_object(path, max_bytes=1 << 20, max_depth=32)
    path.write_text('{"a": [1]}')
    assert read_json_object(path, max_bytes=1 << 20, max_depth=32) == {"a": [1]}


def test_a_file_that_cannot_be_read_is_not_called_malformed(tmp_path: Path) -> None:
    with pytest.raises(UnreadableFileError) as info:
        read_json_object(tmp_path, max_bytes=10, max_depth=4)
    assert not isinstance(info.value, MalformedJsonError)
