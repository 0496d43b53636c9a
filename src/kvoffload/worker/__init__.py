"""Worker side: register engine caches, move KV blocks between them and host memory.

Needs torch (the ``torch`` extra). ``TransferWorker`` is the entry point; backends
(``CudaBackend``, and the CPU backends ``NativeCpuBackend`` and ``MemmoveCpuBackend``, which
share ``CpuBackend``) implement ``TransferBackend``. ``cpu_backend`` picks the CPU copy path,
``default_backend`` the backend for a device.
"""

from kvoffload.worker.backend import FailJobs, FaultHook, InjectedFaultError, TransferBackend
from kvoffload.worker.cpu_common import CpuBackend
from kvoffload.worker.cpu_memmove import MemmoveCpuBackend
from kvoffload.worker.cpu_native import NativeCpuBackend
from kvoffload.worker.cuda import CudaBackend, StagedCopier
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import (
    CacheLayout,
    CacheTensorLayout,
    GroupLayout,
    GroupTensors,
    PageSegment,
)
from kvoffload.worker.worker import TransferWorker, cpu_backend, default_backend

__all__ = [
    "CacheLayout",
    "CacheTensorLayout",
    "CpuBackend",
    "CudaBackend",
    "FailJobs",
    "FaultHook",
    "GroupLayout",
    "GroupTensors",
    "HostPool",
    "InjectedFaultError",
    "MemmoveCpuBackend",
    "NativeCpuBackend",
    "PageSegment",
    "StagedCopier",
    "TransferBackend",
    "TransferWorker",
    "cpu_backend",
    "default_backend",
]
