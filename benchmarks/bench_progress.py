"""A progress bar for the long benchmark scripts (``rich``, on stderr when it is a terminal;
plain lines otherwise)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


class Progress:
    """A rich progress bar on stderr when it is a terminal; plain lines otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None

    @contextlib.contextmanager
    def running(self) -> Iterator[Progress]:
        if self.enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )
                from rich.progress import (
                    Progress as RichProgress,
                )
            except ImportError:
                yield self
                return
            with RichProgress(TextColumn("{task.description}"), BarColumn(),
                              MofNCompleteColumn(), TimeElapsedColumn(),
                              TimeRemainingColumn(), console=Console(stderr=True)) as bar:
                self._bar = bar
                self._task = bar.add_task("starting", total=self.total)
                yield self
                self._bar = None
            return
        yield self

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text)
        elif self.enabled:
            print(text, file=sys.stderr, flush=True)
