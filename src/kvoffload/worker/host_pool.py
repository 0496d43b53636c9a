"""The host arena: one rank's offloaded blocks, one slot per offloaded block of any group.

The arena is a single uint8 tensor of shape ``(num_slots, slot_bytes)``, pinned when CUDA
is available so device copies can run asynchronously. Slot ids are chosen by the host tier
(the scheduler side) and are the same on every rank; each rank has its own arena holding its
own shard. The byte layout inside a slot is described in ``kvoffload.worker.layout``.

Pinning. ``torch.empty(..., pin_memory=True)`` goes through torch's caching host
allocator, which rounds every allocation up to the next power of two (pytorch/pytorch
#150517): a 33 GiB arena would page-lock 64 GiB of host memory. The arena is therefore
allocated as ordinary memory and page-locked in place with ``cudaHostRegister``, which pins
exactly its bytes; where that fails, it falls back to torch's pinned allocation (and says
so).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import weakref
from typing import Any

import torch

from kvoffload.worker.layout import CacheLayout, GroupLayout

logger = logging.getLogger(__name__)


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context, not only the current one."""


def register_pinned(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor``'s bytes in place (``cudaHostRegister``); True on success.

    On success the registration is undone (``cudaHostUnregister``) when ``tensor`` is
    collected: views of it must not outlive it (they would still work, unpinned). On
    failure the CUDA runtime's last-error state is cleared, so that the next unrelated
    CUDA call does not report this error.
    """
    ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return False
    try:
        runtime = _cudart()
        error = int(runtime.cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE))
    except Exception:  # no CUDA runtime bindings, or they refused: caller falls back
        logger.debug("cudaHostRegister unavailable", exc_info=True)
        return False
    if error != 0:
        _clear_cuda_error()
        logger.debug("cudaHostRegister(%d bytes) returned error %d", nbytes, error)
        return False
    weakref.finalize(tensor, _unregister, runtime, ptr)
    return True


def _clear_cuda_error() -> None:
    """Reset the calling thread's CUDA last-error state (``cudaGetLastError``), through the
    CUDA runtime library torch already loaded (found in ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:  # not Linux, or no runtime library mapped: nothing to clear
        logger.debug("could not clear the CUDA error state", exc_info=True)


def _unregister(runtime: Any, ptr: int) -> None:
    with contextlib.suppress(Exception):  # interpreter shutting down, CUDA torn down
        runtime.cudaHostUnregister(ptr)


def allocate_arena(shape: tuple[int, int], pin: bool, device: torch.device | None = None,
                   ) -> tuple[torch.Tensor, bool]:
    """A uint8 tensor of ``shape``, page-locked when ``pin``: registered in place (exact
    size) with ``device`` (a CUDA device: the caches') current, else by torch's pinned
    allocator (rounded up to a power of two). Returns the tensor and whether it is
    page-locked."""
    arena = torch.empty(shape, dtype=torch.uint8)
    if not pin:
        return arena, False
    on_device = torch.cuda.device(device) if device is not None and device.type == "cuda" \
        else contextlib.nullcontext()
    with on_device:  # registering creates a CUDA context: on the caches' device
        if register_pinned(arena):
            return arena, True
    nbytes = shape[0] * shape[1]
    logger.warning("could not page-lock the %d-byte host arena in place; using torch's "
                   "pinned allocator, which may reserve up to twice that", nbytes)
    del arena
    return _torch_pinned(shape), True


def _torch_pinned(shape: tuple[int, int]) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True)


class HostPool:
    """Host memory for ``num_slots`` offloaded blocks, laid out by a ``CacheLayout``.

    The pool only allocates and addresses memory; which slot holds what is the host tier's
    business. Views returned here alias the arena: writing them writes the slot.
    """

    def __init__(self, layout: CacheLayout, num_slots: int, *, pin: bool | None = None) -> None:
        """Allocate the arena.

        Args:
            layout: the registered caches (decides every group's bytes inside a slot).
            num_slots: slots to allocate, normally ``OffloadConfig.num_host_slots``.
            pin: page-lock the arena; by default when CUDA is available.
        """
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if layout.slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {layout.slot_bytes}")
        if pin is None:
            pin = torch.cuda.is_available()
        self.layout = layout
        self.num_slots = num_slots
        self.slot_bytes = layout.slot_bytes
        # (num_slots, slot_bytes) uint8; a slot is one row.
        self.arena, self.pinned = allocate_arena((num_slots, self.slot_bytes), pin,
                                                 layout.device)
        self._array: Any = None  # numpy alias of the arena, made on first use

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def _group(self, group: int) -> GroupLayout:
        try:
            return self.layout.groups[group]
        except KeyError:
            raise KeyError(f"group {group} is not registered") from None

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside [0, {self.num_slots})")

    def slot_view(self, slot: int, group: int) -> torch.Tensor:
        """The bytes of ``group``'s offloaded block in ``slot``: shape ``(block_bytes,)``.

        Unused trailing bytes of the slot (a group smaller than the largest) are excluded.
        """
        self.check_slot(slot)
        return self.arena[slot, : self._group(group).block_bytes]  # (block_bytes,)

    def slot_buffer(self, slot: int, group: int) -> memoryview:
        """``slot_view`` as a writable buffer, for file and socket I/O: sliced from a
        numpy alias of the arena, about 100x cheaper than slicing the tensor."""
        self.check_slot(slot)
        if self._array is None:
            self._array = self.arena.numpy()
        return memoryview(self._array[slot, : self._group(group).block_bytes])

    def page_offset(self, group: int, segment: int, sub_block: int) -> int:
        """Byte offset inside a slot of page ``sub_block`` of ``group``'s segment ``segment``."""
        return self._group(group).host_offset(segment, sub_block)

    def page_view(self, slot: int, group: int, segment: int, sub_block: int) -> torch.Tensor:
        """One engine page inside a slot: shape ``(page_bytes,)`` of that segment."""
        self.check_slot(slot)
        layout = self._group(group)
        start = layout.host_offset(segment, sub_block)
        size = layout.segments[segment].page_bytes
        return self.arena[slot, start : start + size]  # (page_bytes,)

    def segment_view(self, group: int, segment: int) -> torch.Tensor:
        """Every slot's pages of one segment: shape ``(num_slots, factor, page_bytes)``.

        A strided view (row stride ``slot_bytes``); ``[slot, j]`` is sub-block ``j``.
        """
        layout = self._group(group)
        seg = layout.segments[segment]
        span = self.arena[:, seg.host_offset : seg.host_offset + seg.page_bytes * layout.factor]
        return span.view(self.num_slots, layout.factor, seg.page_bytes)  # (slots, factor, page)
