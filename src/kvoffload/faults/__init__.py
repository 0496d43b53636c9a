"""Fault injection at the worker and tier boundaries, and the soak test built on it.

* ``plan``: ``FaultPlan`` (rate, kinds, seed) and ``FaultLog`` (what was injected);
* ``executor``: ``FaultyExecutor``, faults between the reference engine and its workers;
* ``backend``: ``FaultyBackend``, faults inside a ``TransferWorker``'s copy backend;
* ``store``: ``FaultyBlockStore``, I/O errors, corruption and outages of a lower tier;
* ``soak``: a long replay with faults, byte checks and integrity checks (``SoakReport``).
"""

from kvoffload.faults.plan import ALL_KINDS, FaultKind, FaultLog, FaultPlan

__all__ = ["ALL_KINDS", "FaultKind", "FaultLog", "FaultPlan"]
