"""Worker side: register engine caches, move KV blocks between them and host memory.

Needs torch (the ``torch`` extra). ``TransferWorker`` is the entry point; backends
(``CpuBackend``, ``CudaBackend``) implement ``TransferBackend``.
"""

from kvoffload.worker.backend import FailJobs, FaultHook, InjectedFaultError, TransferBackend
from kvoffload.worker.cpu import CpuBackend
from kvoffload.worker.cuda import CudaBackend, StagedCopier
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import (
    CacheLayout,
    CacheTensorLayout,
    GroupLayout,
    GroupTensors,
    PageSegment,
)
from kvoffload.worker.worker import TransferWorker, default_backend

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
    "PageSegment",
    "StagedCopier",
    "TransferBackend",
    "TransferWorker",
    "default_backend",
]
