"""Feed a workload into a ``ReferenceEngine`` and run it until every request finished.

Arrivals. ``Arrival.TRACE`` uses each request's ``arrival_s`` (a Mooncake trace's
timestamps); ``Arrival.ASAP`` ignores them and keeps the engine's waiting queue full. Either
way a request whose ``parent_id`` names an earlier request of the workload (the previous
chat turn, the agent step it extends) arrives no earlier than that parent finished, as a
client that waits for the answer would. At most ``max_queued`` requests wait in the engine
and at most as many more are read ahead from the workload, so a trace of any length runs in
bounded memory; a request held back by that bound keeps its original arrival time, so the
wait shows in its clock TTFT.

At the end, in bytes mode, the host arena is audited (``ReferenceEngine.audit_host``).

When a step does nothing, the clock jumps to the next event: an arrival or a transfer's
modelled completion (or one decode step, while a lookup is deferred).

``replay`` runs one engine to the end. ``ReplayLoop`` is the same loop one iteration at a
time, so that a fleet (``kvoffload.sim.fleet``) can interleave several engines on one
modelled clock; its engines' feeders share one ``Lineage``, so the parent rule holds
across engines.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from enum import Enum

from kvoffload.errors import InvariantError
from kvoffload.refengine.engine import ReferenceEngine
from kvoffload.refengine.metrics import EngineMetrics
from kvoffload.refengine.requests import EngineRequest
from kvoffload.workloads.request import WorkloadRequest

Progress = Callable[[int], None]
"""Called with the number of finished requests whenever it grows."""

MAX_IDLE_TICKS = 100_000
"""Consecutive idle steps without any event before the replay declares the engine stuck."""

MAX_STEPS_WITHOUT_FINISH = 1_000_000
"""Steps in a row with requests live but none finishing before the replay declares a
livelock (requests preempting each other forever, say)."""


class Arrival(str, Enum):
    TRACE = "trace"
    """Requests arrive at their ``arrival_s``."""
    ASAP = "asap"
    """Requests arrive as soon as the waiting queue has room."""


class Lineage:
    """Which requests were read and which finished, for the parent rule (a request waits
    for its ``parent_id``). One engine keeps its own; a fleet shares one among its
    engines, whose requests' parents may run on another engine.

    Attributes:
        seen: ids of the requests read from the workload so far.
        finished: request id -> modelled finish time, for every finished request.
    """

    def __init__(self, finished: Mapping[str, float]) -> None:
        self.seen: set[str] = set()
        self.finished = finished


class Feeder:
    """Moves workload requests into the engine as the clock reaches them.

    ``lineage``: where parents are looked up (default: this feeder's requests and the
    engine's finished ones). ``finished`` releases the requests held for a parent.
    """

    def __init__(self, workload: Iterable[WorkloadRequest], arrival: Arrival,
                 max_queued: int, *, lineage: Lineage | None = None) -> None:
        self._source: Iterator[WorkloadRequest] = iter(workload)
        self._peek: WorkloadRequest | None = next(self._source, None)
        self._asap = arrival is Arrival.ASAP
        self._max_queued = max_queued
        self._ready: list[tuple[float, int, WorkloadRequest]] = []
        self._held: dict[str, list[WorkloadRequest]] = {}
        self._lineage = lineage
        self._seq = itertools.count()
        self._num_held = 0

    @property
    def exhausted(self) -> bool:
        return self._peek is None and not self._ready and not self._num_held

    @property
    def num_held(self) -> int:
        """Requests held until their parent finishes."""
        return self._num_held

    def _arrival(self, request: WorkloadRequest) -> float:
        return 0.0 if self._asap else request.arrival_s

    def pull(self, engine: ReferenceEngine) -> None:
        """Read arrived requests ahead and queue the ready ones in the engine."""
        if self._lineage is None:
            self._lineage = Lineage(engine.finished_ids)
        seen, finished = self._lineage.seen, self._lineage.finished
        now = engine.clock
        while (self._peek is not None and len(self._ready) < self._max_queued
               and self._arrival(self._peek) <= now):
            request, self._peek = self._peek, next(self._source, None)
            seen.add(request.request_id)
            parent = request.parent_id
            if parent is not None and parent in seen and parent not in finished:
                self._held.setdefault(parent, []).append(request)
                self._num_held += 1
                continue
            at = self._arrival(request)
            if parent is not None and parent in finished:
                at = max(at, finished[parent])
            heapq.heappush(self._ready, (at, next(self._seq), request))
        while (self._ready and self._ready[0][0] <= now
               and len(engine.waiting) < self._max_queued):
            at, _, request = heapq.heappop(self._ready)
            engine.add_request(EngineRequest(request, engine.hasher, arrival_s=at))

    def finished(self, request_id: str, at: float) -> None:
        """Release the requests that waited for ``request_id``."""
        for child in self._held.pop(request_id, ()):
            self._num_held -= 1
            heapq.heappush(self._ready, (max(self._arrival(child), at), next(self._seq), child))

    def next_arrival(self, engine: ReferenceEngine) -> float | None:
        if len(engine.waiting) >= self._max_queued:
            return None
        times = [self._ready[0][0]] if self._ready else []
        if self._peek is not None and len(self._ready) < self._max_queued:
            times.append(self._arrival(self._peek))
        return min(times, default=None)


class ReplayLoop:
    """One engine's replay, one iteration at a time: ``advance`` until it answers False,
    then ``finish``. ``replay`` runs one to the end; a fleet (``kvoffload.sim.fleet``)
    interleaves several on one modelled clock.

    ``on_finished(request_id, at)`` is called for every request the engine finishes
    (default: the feeder's ``finished``; a fleet tells every engine's feeder).
    ``wake()``: while the feeder holds requests for a parent, the earliest modelled time
    something else may release one (a fleet: the other engines' clock); None: nothing.
    """

    def __init__(self, engine: ReferenceEngine, feeder: Feeder, *,
                 progress: Progress | None = None,
                 after_step: Callable[[], None] | None = None,
                 on_finished: Callable[[str, float], None] | None = None,
                 wake: Callable[[], float | None] | None = None) -> None:
        self.engine = engine
        self.feeder = feeder
        self._progress = progress
        self._after_step = after_step
        self._on_finished = on_finished or feeder.finished
        self._wake = wake
        self._seen_records = 0
        self._idle = 0
        self._since_finish = 0
        self.done = False

    def advance(self) -> bool:
        """One step of the engine (or one jump of its clock to the next event); False
        once every request finished and every transfer was reported."""
        if self.done:
            return False
        engine, feeder = self.engine, self.feeder
        feeder.pull(engine)
        active = engine.step()
        if self._after_step is not None:
            self._after_step()
        self._since_finish += 1
        if self._since_finish > MAX_STEPS_WITHOUT_FINISH:
            raise InvariantError(
                f"no request finished in {MAX_STEPS_WITHOUT_FINISH} steps: "
                f"{len(engine.running)} running, {len(engine.waiting)} waiting, "
                f"{len(engine.loading)} loading")
        self._take_finished()
        if active:
            self._idle = 0
            return True
        if not engine.num_live and feeder.exhausted and not engine.has_pending_transfers():
            self.done = True
            return False
        self._jump()
        return True

    def _take_finished(self) -> None:
        """Report the requests the engine finished since the last call."""
        records = self.engine.metrics.records
        if len(records) > self._seen_records:
            self._since_finish = 0
            for record in records[self._seen_records:]:
                assert record.finish_s is not None
                self._on_finished(record.request_id, record.finish_s)
            self._seen_records = len(records)
            if self._progress is not None:
                self._progress(self._seen_records)

    def _jump(self) -> None:
        """After a step that did nothing: move the clock to the next event (an arrival,
        a transfer's completion, ``wake``), or one decode step when there is none."""
        engine, feeder = self.engine, self.feeder
        events = [t for t in (feeder.next_arrival(engine), engine.next_transfer_completion())
                  if t is not None and t > engine.clock]
        if feeder.num_held and self._wake is not None:
            wake = self._wake()
            if wake is not None and wake > engine.clock:
                events.append(wake)
        if events:
            engine.clock = min(events)
        else:
            engine.clock += engine.timing.decode_step_s
            self._idle += 1
            if self._idle > MAX_IDLE_TICKS:
                raise InvariantError(
                    f"the engine made no progress for {MAX_IDLE_TICKS} steps: "
                    f"{len(engine.waiting)} waiting, {len(engine.loading)} loading")
        engine.metrics.idle_advances += 1

    def finish(self) -> EngineMetrics:
        """The last sample and the host audit; the engine's metrics."""
        self.engine.take_sample()
        self.engine.audit_host()
        return self.engine.metrics


def replay(engine: ReferenceEngine, workload: Iterable[WorkloadRequest], *,
           arrival: Arrival = Arrival.TRACE, max_queued: int = 256,
           progress: Progress | None = None,
           after_step: Callable[[], None] | None = None) -> EngineMetrics:
    """Run ``workload`` through ``engine`` until every request finished and every transfer
    was reported; return the engine's metrics (see the module docstring).

    ``after_step`` is called after every step (checks and fault drivers of a soak run).

    Raises whatever the engine raises (``ConfigError`` for a workload the engine cannot
    hold, ``TraceError`` from a malformed trace as the reader reaches it).
    """
    if max_queued < 1:
        raise ValueError(f"max_queued must be >= 1, got {max_queued}")
    loop = ReplayLoop(engine, Feeder(workload, arrival, max_queued), progress=progress,
                      after_step=after_step)
    while loop.advance():
        pass
    return loop.finish()
