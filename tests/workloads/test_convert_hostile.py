"""``kvoffload trace convert`` on hostile and careless input: the output path, the model's
files, its chat template and the log's timestamps. Every problem is one error naming the
option, file or line and what to change (exit status 2 and one ``error:`` line on the
command line), found in bounded time and memory, with nothing outside the tool's own output
replaced.

Cases that could hang or eat memory on a broken build (a FIFO, ``/dev/zero``, a template
looping for minutes) run the command line in a child process with an address-space limit
and a timeout, so a regression fails the test instead of the machine. ``/dev/null`` is
only ever examined (``check_output_path``), never given to a command that could write."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import ConfigError, TraceError
from kvoffload.workloads.chat_template import MAX_RENDER_CHARS
from kvoffload.workloads.convert import ModelTokenizer, check_output_path, convert_log
from kvoffload.workloads.model_tokenizer import (
    MAX_MODEL_JSON_BYTES,
    MAX_MODEL_JSON_NESTING,
    MAX_TEMPLATE_BYTES,
)
from support.tiny_model import TEMPLATE, make_model

pytest.importorskip("tokenizers")

_SRC = Path(__file__).resolve().parents[2] / "src"
_CHILD_MEMORY = 3 << 30  # address space of a child run: reading /dev/zero would pass it
_CHILD_SECONDS = 60
TURN = {"role": "user", "content": "hello what is the weather today in paris"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model"))


def _limit_child() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_CHILD_MEMORY, _CHILD_MEMORY))


def run_cli(*argv: str | Path, cwd: Path) -> tuple[int, str, str]:
    """``kvoffload`` in a child process with bounded memory and time: (status, stdout,
    stderr); a child killed for its time is status -9 with a note in stderr."""
    env = {**os.environ, "PYTHONPATH": f"{_SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import sys; from kvoffload.cli import main; "
             "sys.exit(main())", *map(str, argv)],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=_CHILD_SECONDS,
            preexec_fn=_limit_child, check=False)
    except subprocess.TimeoutExpired:
        return -9, "", f"timed out after {_CHILD_SECONDS} s"
    return done.returncode, done.stdout, done.stderr


def one_error_line(status: int, err: str, *needles: str) -> None:
    assert status == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def write_log(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


# ---------------------------------------------------------------------- -o PATH --force


def _fifo(tmp: Path) -> tuple[Path, Path | None]:
    os.mkfifo(tmp / "out.fifo")
    return tmp / "out.fifo", None


def _link_to_outside(tmp: Path) -> tuple[Path, Path | None]:
    outside = tmp / "elsewhere" / "precious.txt"
    outside.parent.mkdir()
    outside.write_text("keep me\n")
    (tmp / "out.jsonl").symlink_to(outside)
    return tmp / "out.jsonl", outside


def _dangling_link(tmp: Path) -> tuple[Path, Path | None]:
    (tmp / "out.jsonl").symlink_to(tmp / "nowhere" / "x")
    return tmp / "out.jsonl", None


def _link_to_directory(tmp: Path) -> tuple[Path, Path | None]:
    (tmp / "dir").mkdir()
    (tmp / "out.jsonl").symlink_to(tmp / "dir")
    return tmp / "out.jsonl", None


def _directory(tmp: Path) -> tuple[Path, Path | None]:
    (tmp / "out.jsonl").mkdir()
    return tmp / "out.jsonl", None


# name -> (make the output path, words of the error)
OUTPUTS = {
    "a FIFO": (_fifo, "is a FIFO"),
    "a symbolic link to a file outside": (_link_to_outside, "is a symbolic link"),
    "a dangling symbolic link": (_dangling_link, "is a symbolic link"),
    "a symbolic link to a directory": (_link_to_directory, "is a symbolic link"),
    "a directory": (_directory, "is a directory"),
}


def _snapshot(tmp: Path) -> dict[str, tuple[int, str]]:
    """Every entry under ``tmp`` (links not followed): its type bits and, for a regular
    file, its text."""
    seen = {}
    for root, dirs, files in os.walk(tmp):
        for name in dirs + files:
            path = Path(root, name)
            mode = os.lstat(path).st_mode
            seen[str(path)] = (mode & 0o170000,
                               path.read_text() if path.is_file() and not path.is_symlink()
                               else "")
    return seen


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_force_never_replaces_anything_but_a_regular_file(case: str, tmp_path: Path) -> None:
    make, words = OUTPUTS[case]
    log = write_log(tmp_path / "log.jsonl", [{"tokens": [1, 2, 3], "timestamp": 1}])
    out, outside = make(tmp_path)
    before = _snapshot(tmp_path)
    status, _, err = run_cli("trace", "convert", log, "-o", out, "--force", "-q",
                             cwd=tmp_path)
    one_error_line(status, err, "--output", str(out), words)
    assert _snapshot(tmp_path) == before  # nothing replaced, no temporary file left
    if outside is not None:
        assert outside.read_text() == "keep me\n"
    with pytest.raises(ConfigError) as info:  # the library refuses it the same way
        convert_log(log, out, overwrite=True)
    assert info.value.field == "output" and words in str(info.value)
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("path", ["/dev/null", "/dev/zero", "/proc/self"])
def test_a_device_or_a_system_path_is_refused_by_looking_only(path: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_output_path(path)  # examines the path; nothing here ever writes
    assert info.value.field == "output" and path in str(info.value)


def test_a_regular_file_is_still_replaced_with_force(tmp_path: Path) -> None:
    log = write_log(tmp_path / "log.jsonl", [{"tokens": [1, 2, 3], "timestamp": 1}])
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    convert_log(log, out, overwrite=True)
    assert json.loads(out.read_text())["input_length"] == 3


# ---------------------------------------------------------------------- the model's files


def _tiny(tmp: Path, model: Path) -> Path:
    directory = tmp / "model"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((model / name).read_bytes())
    return directory


def _replace_by_fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _replace_by_zero(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")


def _replace_by_huge(path: Path, size: int) -> None:
    with path.open("wb") as f:
        f.truncate(size + 1)  # sparse: size + 1 zero bytes, no disk written


def _deep(path: Path) -> None:
    depth = MAX_MODEL_JSON_NESTING + 1
    path.write_text('{"x": ' + "[" * depth + "]" * depth + "}")


def _recursion(path: Path) -> None:
    path.write_text('{"x": ' + "[" * 200_000 + "]" * 200_000 + "}")


_DAMAGE: dict[str, Callable[[Path, int], None]] = {
    "a FIFO": lambda path, bound: _replace_by_fifo(path),
    "linked to /dev/zero": lambda path, bound: _replace_by_zero(path),
    "over the bound": _replace_by_huge,
    "nested too deep": lambda path, bound: _deep(path),
    "nested 200,000 deep": lambda path, bound: _recursion(path),
}
# (the file, the ways it is damaged, its bound); "tmpl.jinja" is given with --chat-template
_SPOILED_FILES = [
    ("tokenizer_config.json", ["a FIFO", "linked to /dev/zero", "over the bound",
                               "nested too deep", "nested 200,000 deep"],
     MAX_MODEL_JSON_BYTES),
    ("tokenizer.json", ["a FIFO", "linked to /dev/zero"], 0),
    ("chat_template.jinja", ["a FIFO", "linked to /dev/zero"], 0),
    ("chat_template.json", ["a FIFO"], 0),
    ("tmpl.jinja", ["a FIFO", "linked to /dev/zero", "over the bound"], MAX_TEMPLATE_BYTES),
]
# name -> (the file, how it is damaged, its bound)
MODEL_FILES = {
    f"{'--chat-template' if name == 'tmpl.jinja' else name} {damage}": (name, damage, bound)
    for name, damages, bound in _SPOILED_FILES for damage in damages
}


@pytest.mark.parametrize("case", list(MODEL_FILES))
def test_a_hostile_model_file_is_one_error_at_once(case: str, tmp_path: Path,
                                                   model: Path) -> None:
    name, damage, bound = MODEL_FILES[case]
    directory = _tiny(tmp_path, model)
    template = tmp_path / "tmpl.jinja"
    template.write_text(TEMPLATE)
    given_template = name == "tmpl.jinja"
    _DAMAGE[damage](template if given_template else directory / name, bound)
    option = "--chat-template" if given_template else "--model"
    log = write_log(tmp_path / "chat.jsonl", [{"messages": [TURN], "timestamp": 1}])
    extra = ["--chat-template", template] if given_template else []
    started = time.monotonic()
    status, _, err = run_cli("trace", "convert", log, "--model", directory, *extra,
                             "-o", tmp_path / "out.jsonl", "-q", cwd=tmp_path)
    one_error_line(status, err, option, name)
    assert time.monotonic() - started < 30
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------------- the chat template

# name -> a template that must be stopped by a bound (the message's words)
TEMPLATES = {
    "nested loops, empty body": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "to render"),
    "nested loops, output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "to render"),
    "nested loops over the messages": (
        "{% for a in messages %}{% for b in messages %}{% for c in messages %}"
        "{% for d in messages %}{% for e in messages %}"
        "{% endfor %}{% endfor %}{% endfor %}{% endfor %}{% endfor %}", "to render"),
    "exponential macro": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
        "{% endmacro %}{{ f(60) }}", "to render"),
    "a gigabyte string in one expression": ("{{ 'x' * 1000000000 }}", "repeats"),
    "a list repeated": ("{{ ([1] * 1000000000)|length }}", "repeats"),
    "a huge power": ("{{ 7 ** 100000000 }}", "power"),
    "join with a megabyte separator": (
        "{{ range(100000)|join(messages[0].content * 25000) }}", "join"),
    "str.join with a megabyte separator": (
        "{{ (messages[0].content * 25000).join(range(100000)|map('string')) }}", "join"),
    "replace every gap": ("{{ (messages[0].content * 5000).replace('', 'x' * 100000) }}",
                          "replace"),
    "replace filter": ("{{ (messages[0].content * 5000)|replace('', 'x' * 100000) }}",
                       "replace"),
    "center a gigabyte": ("{{ 'x'|center(1000000000) }}", "center"),
    "str.ljust a gigabyte": ("{{ 'x'.ljust(1000000000) }}", "str.ljust"),
    "indent a gigabyte": ("{{ 'a\nb'|indent(1000000000) }}", "indent"),
    "batch filled to a billion": ("{{ range(3)|batch(1000000000, 0)|list|length }}",
                                  "batch"),
    "a percent width": ("{{ '%1000000000d' % 1 }}", "'%'"),
    "a format width": ("{{ '{:>1000000000}'.format(1) }}", "str.format"),
    "a tojson indent": ("{{ messages|tojson(indent=100000000) }}", "tojson"),
    "output over the cap": (
        "{% for i in range(100000) %}{{ messages[0].content * 200 }}{% endfor %}",
        f"over {MAX_RENDER_CHARS:,} characters"),
}


@pytest.mark.parametrize("case", list(TEMPLATES))
def test_a_costly_template_is_stopped_by_a_bound(case: str, tmp_path: Path,
                                                 model: Path) -> None:
    text, words = TEMPLATES[case]
    template = tmp_path / "tmpl.jinja"
    template.write_text(text)
    # The time budget is short only where it is the bound under test: under a busy
    # machine's load it must not fire first for the cases another bound stops.
    budget = 0.5 if words == "to render" else 8.0
    tokenizer = ModelTokenizer(model, template, render_seconds=budget)
    log = write_log(tmp_path / "chat.jsonl", [{"messages": [TURN] * 50, "timestamp": 1}])
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(TraceError) as info:
            convert_log(log, tmp_path / "out.jsonl", tokenizer=tokenizer)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 20
    assert peak < 4 * MAX_RENDER_CHARS + (32 << 20)  # the output cap, not gigabytes
    error = info.value
    assert (error.line, error.field) == (1, "messages")
    assert str(template) in str(error) and words in str(error), str(error)


def test_the_cli_stops_a_looping_template_within_its_budget(tmp_path: Path,
                                                            model: Path) -> None:
    template = tmp_path / "tmpl.jinja"
    template.write_text(TEMPLATES["nested loops, output"][0])
    log = write_log(tmp_path / "chat.jsonl", [{"messages": [TURN], "timestamp": 1}])
    started = time.monotonic()
    status, _, err = run_cli("trace", "convert", log, "--model", model, "--chat-template",
                             template, "-o", tmp_path / "out.jsonl", "-q", cwd=tmp_path)
    one_error_line(status, err, "chat.jsonl:1", "tmpl.jinja")
    # Whichever budget it reaches first stops it: the render time, or on a fast machine
    # the size of what it wrote.
    assert "to render" in err or "renders over" in err, err
    assert time.monotonic() - started < 40


def test_loop_variables_still_work_through_the_guard(tmp_path: Path, model: Path) -> None:
    template = tmp_path / "tmpl.jinja"
    template.write_text("{% for m in messages %}{{ loop.index }}/{{ loop.length }}"
                        "{% if loop.last %} {{ m.content }}{% endif %}\n"
                        "{% else %}none{% endfor %}")
    tokenizer = ModelTokenizer(model, template)
    assert tokenizer.render([TURN, TURN]) == f"1/22/2 {TURN['content']}"  # trim_blocks
    assert tokenizer.render([]) == "none"
