"""The cores vLLM's CPU backend leaves its engine-core process when a connector is set.

vLLM's CPU backend binds each worker's OpenMP threads to cores and reserves some for the
other processes: one per local worker for the engine-core process (which busy-waits for
the workers), and, whenever a KV connector is configured, one more per local worker for a
disaggregated-prefill transfer thread. kvoffload has no such thread (its copy threads are
niced and sleep between jobs), but the reservation is made for every connector. Where the
machine has no more cores than it would reserve (``2 * local_world_size``: two cores, one
worker), vLLM reserves none at all: a worker's OpenMP team then spans the core the
engine-core process spins on, every parallel region of the forward pass waits for the
thread that shares it, and steps run several times slower (measured on two cores with a
small model: 3.9 requests/s against 12.2 without the connector, 14.9 with it once the
reservation is set right). ``VLLM_CPU_NUM_OF_RESERVED_CPU`` set to the number of local
workers restores what vLLM reserves without a connector; ``reservation_advice`` says so
at start-up where it applies. The reservation is made only by vLLM's multiprocess
executor (``distributed_executor_backend="mp"``, what the server and the CPU backend's
``LLM`` use); an engine run in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
``"uni"`` executor) binds no threads and gets no advice.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def reservation_advice(*, on_cpu: bool, cores: int, local_workers: int,
                       env: Mapping[str, str]) -> str | None:
    """What to set so the engine-core process keeps a core, or None where nothing is
    wrong: not the CPU backend, a reservation or thread binding already chosen by hand, or
    enough cores for vLLM's reservation.

    Args:
        on_cpu: vLLM runs on its CPU backend.
        cores: cores this process may run on.
        local_workers: vLLM's workers on this machine (``local_world_size``).
        env: the process environment.
    """
    if not on_cpu or RESERVED_ENV in env or env.get(BIND_ENV, "auto") not in ("", "auto"):
        return None
    if cores > 2 * local_workers:
        return None
    return (f"vLLM's CPU backend reserves {2 * local_workers} core(s) for other processes "
            f"when a KV connector is configured, and with {cores} core(s) it reserves none: "
            "the workers' OpenMP threads then share the core the engine-core process "
            "spins on, and every step runs several times slower. Start the server with "
            f"{RESERVED_ENV}={local_workers} (what vLLM reserves without a connector).")


def engine_advice(vllm_config: object) -> str | None:
    """``reservation_advice`` for the running engine (this process's cores and
    environment, ``vllm_config``'s local world size); None where the engine's executor
    binds no OpenMP threads (any but vLLM's multiprocess one: module doc)."""
    from vllm.platforms import current_platform

    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "distributed_executor_backend", "mp") != "mp":
        return None
    workers = int(getattr(parallel, "local_world_size", 0)
                  or getattr(parallel, "world_size", 1) or 1)
    return reservation_advice(on_cpu=bool(current_platform.is_cpu()),
                              cores=len(os.sched_getaffinity(0)), local_workers=workers,
                              env=os.environ)
