"""Bounded reading of files a user names: model files, templates, key files, traces.

A path given on the command line or in a configuration may name anything: a FIFO that
never gets a writer, ``/dev/zero``, a directory, a file of gigabytes. The readers here
open it non-blocking (a FIFO is refused at once instead of waiting for a writer), refuse
anything but a regular file from ``fstat`` before reading, and read at most a stated
number of bytes, so a hostile path costs bounded time and memory. A file that is too big,
not a regular file or unreadable raises ``UnreadableFileError``, a ``ValueError`` whose message
names the path and what it is; callers turn it into their own error (``ConfigError``
naming the option, ``TraceError`` naming the file) with the fix.

``json_too_deep`` is the matching bound for JSON text: a linear scan (no recursion) that
finds bracket nesting deeper than a limit before ``json.loads`` would recurse into it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import IO, Any

from kvoffload.errors import shown


class UnreadableFileError(ValueError):
    """A named file cannot be read as asked. ``reason`` says what it is (``"is a FIFO"``,
    ``"is over 1,048,576 bytes"``, ``"cannot be opened (No such file or directory)"``)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} {reason}")


class MalformedJsonError(UnreadableFileError):
    """A file was read but does not hold what was asked: JSON nested too deep, not JSON,
    or not a JSON object (``read_json_object``)."""


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, for a message: ``"a directory"``,
    ``"a FIFO"``, ``"a symbolic link"`` (from ``lstat``), ``"a device"``, ..."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular_file(path: str | Path) -> IO[bytes]:
    """``path`` opened for binary reading; ``UnreadableFileError`` unless it is a regular file.

    The descriptor is opened non-blocking, so a FIFO is refused from ``fstat`` without
    waiting for a writer; the returned file reads blocking. A path holding a NUL byte is
    refused like a missing file.
    """
    name = str(path)
    if "\0" in name:
        raise UnreadableFileError(repr(name), "cannot be opened (the path holds a NUL byte)")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(name, flags)
    except OSError as exc:
        raise UnreadableFileError(name, f"cannot be opened ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnreadableFileError(name, f"is {file_kind(mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path: str | Path, *, max_bytes: int) -> bytes:
    """The bytes of regular file ``path``, at most ``max_bytes`` of them.

    ``UnreadableFileError`` for anything but a regular file, for a file longer than ``max_bytes``
    (found after reading at most ``max_bytes + 1`` bytes, whatever its size claims) and
    for a read error.
    """
    with open_regular_file(path) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise UnreadableFileError(str(path),
                                      f"cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise UnreadableFileError(str(path), f"is over {max_bytes:,} bytes")
    return data


def read_regular_text(path: str | Path, *, max_bytes: int) -> str:
    """``read_regular_file`` decoded as UTF-8 (a leading byte order mark dropped);
    ``UnreadableFileError`` for bytes that are not UTF-8."""
    data = read_regular_file(path, max_bytes=max_bytes)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UnreadableFileError(str(path),
                                  f"is not valid UTF-8 (byte {exc.start + 1})") from None


def read_json_object(path: str | Path, *, max_bytes: int, max_depth: int) -> dict[str, Any]:
    """The JSON object in regular file ``path``, read with ``read_regular_text`` and
    checked with ``json_too_deep`` before it is parsed. ``UnreadableFileError`` for what
    ``read_regular_text`` refuses; its subclass ``MalformedJsonError`` for text that nests
    deeper than ``max_depth`` (``"nests deeper than 32 levels"``), is not JSON
    (``"cannot be read as JSON (...)"``) or is not an object (``"is not a JSON object"``)."""
    text = read_regular_text(path, max_bytes=max_bytes)
    if json_too_deep(text, max_depth):
        raise MalformedJsonError(str(path), f"nests deeper than {max_depth} levels")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MalformedJsonError(str(path),
                                 f"cannot be read as JSON ({shown(str(exc))})") from None
    if not isinstance(data, dict):
        raise MalformedJsonError(str(path), "is not a JSON object")
    return data


_JSON_SPECIAL = re.compile(r'[\[\]{}"\\]')


def json_too_deep(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than ``limit`` in JSON ``text``
    (linear, no recursion; malformed text is left for the parser to refuse)."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    in_string = False
    escaped_at = -1
    for match in _JSON_SPECIAL.finditer(text):
        pos = match.start()
        if pos == escaped_at:
            continue
        char = match.group()
        if in_string:
            if char == "\\":
                escaped_at = pos + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False
