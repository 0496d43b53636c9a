"""Where a run's requests come from: a built-in workload or a trace, named by a value.

``WorkloadSpec`` is a frozen, hashable description (a built-in workload's name, seed and
size, or a Mooncake trace's path; an optional request limit; optional client hints). Its
``load()`` gives the requests, every time the same ones: a built-in workload as a list, a
trace as a ``TraceStream`` that reads the file afresh on each iteration (so a long trace is
never held in memory), or, with ``hint_accuracy``, a list of requests carrying client hints
(``kvoffload.workloads.hints``; a trace is then read whole, since the hints need its future).
``label`` names the workload in reports. Nothing here validates command-line values: the
caller gives a size of at least 1, a limit of at least 1 and an accuracy in [0, 1].

This module imports only ``kvoffload.workloads`` (never the simulator or the engine).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload.workloads.generators import builtin_workload, size_unit
from kvoffload.workloads.hints import with_hints
from kvoffload.workloads.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    count_trace_lines,
    open_trace_file,
    read_mooncake_trace,
)
from kvoffload.workloads.request import WorkloadRequest


@dataclass(frozen=True)
class WorkloadSpec:
    """Where requests come from; ``load`` returns a re-iterable sequence or stream."""

    name: str
    trace: Path | None
    limit: int | None
    seed: int
    sessions: int | None = None
    """The built-in workload's size (``builtin_workload``'s ``size``); None: its default."""
    hint_accuracy: float | None = None
    """Give each request client hints drawn from the workload's future with this accuracy
    (``kvoffload.workloads.hints``; seeded by ``seed``); None: no hints."""

    @property
    def label(self) -> str:
        return self.label_for((self.seed,))

    def label_for(self, seeds: Sequence[int]) -> str:
        """The label of figures taken over ``seeds`` (a mean when there are several)."""
        hints = ("" if self.hint_accuracy is None
                 else f", hints {self.hint_accuracy:.0%} accurate")
        if self.trace is not None:
            return (f"trace {self.trace.name}" + (f" (first {self.limit})" if self.limit
                                                  else "") + hints)
        size = (f", {self.sessions} {size_unit(self.name)}" if self.sessions is not None
                else "")
        seed = (f"seed {seeds[0]}" if len(seeds) == 1
                else f"mean of seeds {', '.join(map(str, seeds))}")
        return (f"{self.name}{size} ({seed})" + (f", first {self.limit}" if self.limit else "")
                + hints)

    def load(self) -> Sequence[WorkloadRequest] | TraceStream:
        """The requests; with ``hint_accuracy``, a list of them carrying hints (a trace is
        read whole: the hints need its future)."""
        if self.trace is not None:
            open_trace_file(self.trace).close()  # a TraceError says what the path is
            stream = TraceStream(self.trace, self.limit)
            if self.hint_accuracy is None:
                return stream
            # The trace's last, partial hash block is never shared: compare at its blocks.
            return with_hints(stream, self.hint_accuracy, self.seed, MOONCAKE_BLOCK_TOKENS)
        requests = builtin_workload(self.name, self.seed, self.sessions)
        requests = requests[:self.limit] if self.limit is not None else requests
        if self.hint_accuracy is None:
            return requests
        return with_hints(requests, self.hint_accuracy, self.seed)

    def count(self) -> int:
        if self.trace is None:
            return len(self.load())  # type: ignore[arg-type]
        n = count_trace_lines(self.trace)
        return n if self.limit is None else min(n, self.limit)


class TraceStream:
    """A trace read afresh on every iteration (each run streams it again)."""

    def __init__(self, path: Path, limit: int | None) -> None:
        self.path = path
        self.limit = limit

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return read_mooncake_trace(self.path, limit=self.limit)
