"""Modelled time: how long a step's forward pass and a transfer take.

The reference engine keeps a simulated clock. Nothing in it depends on how fast the host
running the simulation is, so a run is deterministic and its times describe the modelled
accelerator, not the laptop:

* a step lasts ``max(prefill and decode FLOPs / accelerator_flops, decode iterations *
  decode_step_s)``: compute-bound prefill, and a floor for memory-bound decode;
* a transfer of ``n`` bytes occupies its link for ``n / link_bytes_per_s`` seconds; stores
  (device to host) and loads (host to device) use two independent links (PCIe is full
  duplex), and jobs on one link run one after the other in submission order.

``TransferClock`` assigns each job its modelled completion time; the engine hands a
worker's report to the planner only once the clock has passed that time, so the planner
sees the same completions whether bytes really move (``bytes`` mode) or not. The planner
and a tier cascade read the same modelled time (``ModelledClock``) for their waits
measured in seconds, so those are deterministic too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.errors import ConfigError
from kvoffload.jobs import Direction


class ModelledClock:
    """The engine's modelled time in seconds, as a clock the planner and a tier cascade
    call (``kvoffload.offload.build_offload``'s ``clock``); the engine sets ``now``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class TimingModel:
    """The modelled accelerator and host link.

    Attributes:
        accelerator_flops: sustained FLOP/s of the forward pass. The default, 400e12, is
            about 40 % of an H100 SXM's dense BF16 peak (989e12).
        link_bytes_per_s: host <-> device bandwidth per direction. The default, 25e9, is
            a PCIe 4.0 x16 link at about 80 % of its 32 GB/s.
        decode_step_s: the shortest step (one decode iteration is bound by reading the
            weights and the cache, not by FLOPs).
        lower_bytes_per_s: bandwidth between host memory and a lower tier (disk, remote),
            per direction; the default, 5e9, is a PCIe 4.0 NVMe drive.
    """

    accelerator_flops: float = 400e12
    link_bytes_per_s: float = 25e9
    decode_step_s: float = 0.015
    lower_bytes_per_s: float = 5e9

    def __post_init__(self) -> None:
        for name in ("accelerator_flops", "link_bytes_per_s", "decode_step_s",
                     "lower_bytes_per_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(name, f"must be positive, got {value}",
                                  "Give a positive rate or duration.")

    def compute_seconds(self, flops: float) -> float:
        return flops / self.accelerator_flops

    def transfer_seconds(self, nbytes: int) -> float:
        return nbytes / self.link_bytes_per_s

    def step_seconds(self, flops: float, decode_iterations: int) -> float:
        """Duration of a step doing ``flops`` of work and ``decode_iterations`` iterations."""
        return max(self.compute_seconds(flops), decode_iterations * self.decode_step_s)


class TransferClock:
    """Modelled completion time of every job on one pair of links (see the module
    docstring); ``bytes_per_s`` defaults to the host link's bandwidth."""

    def __init__(self, timing: TimingModel, bytes_per_s: float | None = None) -> None:
        self.timing = timing
        self.bytes_per_s = bytes_per_s or timing.link_bytes_per_s
        self._link_free = {Direction.STORE: 0.0, Direction.LOAD: 0.0}
        self._done_at: dict[int, float] = {}
        self.busy_seconds = {Direction.STORE: 0.0, Direction.LOAD: 0.0}

    def submit(self, job_id: int, direction: Direction, nbytes: int, now: float) -> float:
        """Start a job at ``now`` (or when its link frees up); return its completion time."""
        seconds = nbytes / self.bytes_per_s
        start = max(now, self._link_free[direction])
        done = start + seconds
        self._link_free[direction] = done
        self._done_at[job_id] = done
        self.busy_seconds[direction] += seconds
        return done

    def done_at(self, job_id: int) -> float:
        """When ``job_id`` completes; 0 for jobs this clock never saw (nothing to wait for)."""
        return self._done_at.get(job_id, 0.0)

    def forget(self, job_id: int) -> None:
        self._done_at.pop(job_id, None)

    def next_completion(self) -> float | None:
        """The earliest completion time of a job not yet forgotten, if any."""
        return min(self._done_at.values(), default=None)

    def __len__(self) -> int:
        return len(self._done_at)
