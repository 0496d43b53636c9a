"""Engine KV-cache tensors, registered per group and reduced to per-block byte pages.

An engine hands over its cache as tensors, one or more per layer, in whatever shape its
attention or state kernels want. The worker only ever moves whole engine blocks, so at
registration every tensor is reduced, once, to one or two *page segments*: a uint8 view of
shape ``(num_blocks, page_bytes)`` whose row ``b`` is exactly the bytes of engine block
``b``. Rows may sit further apart than ``page_bytes`` (padding, or pages of several layers
interleaved in one allocation), but each row must be contiguous.

Accepted tensor forms (``num_blocks`` is the engine's block count for the group):

- ``CacheTensorLayout.BLOCKS_FIRST``: dim 0 indexes blocks. This covers separate K and V
  tensors ``(num_blocks, block_size, heads, head_dim)`` (give both, as a pair), a fused
  block-major tensor ``(num_blocks, 2, ...)``, vLLM's CPU layout
  ``(num_blocks, heads, block_size, 2 * head_dim)``, Mamba state tensors
  ``(num_blocks, ...)`` (conv and SSM states with different page sizes, given as a tuple),
  and raw padded byte pages ``(num_blocks, page_bytes)`` or ``(num_blocks, 1, 1, page_bytes)``
  of dtype uint8/int8.
- ``CacheTensorLayout.KV_FIRST``: ``(2, num_blocks, ...)``, K and V planes first (vLLM's
  FlashAttention layout). Each plane becomes its own segment, K before V.

Host slot layout. A slot holding one offloaded block of group ``g`` stores, segment after
segment in registration order, ``factor`` consecutive pages of that segment (sub-blocks
``0 .. factor-1``)::

    offset(segment s, sub-block j) = factor * sum(page_bytes of segments before s)
                                     + j * page_bytes(s)

so the whole block is one contiguous byte range of ``block_bytes`` bytes, which later tiers
checksum and ship as a unit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from kvoffload.config import OffloadConfig
from kvoffload.errors import LayoutError


class CacheTensorLayout(str, Enum):
    """Which dimension of a registered tensor indexes engine blocks."""

    BLOCKS_FIRST = "blocks_first"
    """Dim 0 indexes blocks; one page segment per tensor."""
    KV_FIRST = "kv_first"
    """Shape ``(2, num_blocks, ...)``: K plane then V plane, two page segments per tensor."""


LayerTensors = torch.Tensor | Sequence[torch.Tensor]
"""One layer's cache: one tensor, or several (K and V, or Mamba conv and SSM states)."""


@dataclass(frozen=True)
class GroupTensors:
    """The cache tensors of one KV-cache group, as the engine hands them over.

    Attributes:
        group: index of the group in ``OffloadConfig.groups``.
        layers: ``(layer name, tensor or tensors)`` in a fixed order. Every rank must use
            the same order: it decides where each page sits inside a host slot.
        layout: how every tensor of this group is shaped (see ``CacheTensorLayout``).
    """

    group: int
    layers: Sequence[tuple[str, LayerTensors]]
    layout: CacheTensorLayout = CacheTensorLayout.BLOCKS_FIRST


@dataclass(frozen=True)
class PageSegment:
    """One per-block byte page of one tensor (or one K/V plane of it).

    Attributes:
        name: ``layer`` or ``layer[i]`` / ``layer.k`` / ``layer.v`` when a layer has several.
        pages: uint8 view of shape ``(num_blocks, page_bytes)`` aliasing the engine tensor;
            rows are contiguous, the row stride may exceed ``page_bytes``.
        host_offset: byte offset of this segment's sub-block 0 inside a host slot.
    """

    name: str
    pages: torch.Tensor
    host_offset: int

    @property
    def page_bytes(self) -> int:
        return int(self.pages.shape[1])

    @property
    def row_stride(self) -> int:
        """Bytes between the starts of consecutive engine blocks."""
        return int(self.pages.stride(0))


@dataclass(frozen=True)
class GroupLayout:
    """Every page segment of one group, and where its pages go inside a host slot."""

    group: int
    segments: tuple[PageSegment, ...]
    num_blocks: int
    factor: int

    @property
    def page_bytes(self) -> int:
        """Bytes of one engine block of this group, all segments together."""
        return sum(s.page_bytes for s in self.segments)

    @property
    def block_bytes(self) -> int:
        """Bytes of one offloaded block (``factor`` engine blocks) of this group."""
        return self.page_bytes * self.factor

    def host_offset(self, segment: int, sub_block: int) -> int:
        """Byte offset inside a slot of page ``sub_block`` of segment number ``segment``."""
        if not 0 <= sub_block < self.factor:
            raise IndexError(f"sub-block {sub_block} outside [0, {self.factor})")
        seg = self.segments[segment]
        return seg.host_offset + sub_block * seg.page_bytes


@dataclass(frozen=True)
class CacheLayout:
    """All registered groups of one rank.

    Attributes:
        groups: group index -> its layout; every group of the config is present.
        factor: ``block_size_factor``.
        slot_bytes: bytes of one host slot (``OffloadConfig.slot_bytes``).
        device: the device every registered tensor lives on.
    """

    groups: Mapping[int, GroupLayout]
    factor: int
    slot_bytes: int
    device: torch.device

    @classmethod
    def build(cls, config: OffloadConfig, groups: Sequence[GroupTensors]) -> CacheLayout:
        """Derive the byte pages of every group and check them against ``config``.

        Raises:
            LayoutError: a tensor of an unsupported shape, blocks that are not contiguous
                bytes, block counts or devices that differ inside a group, a group that is
                unknown, registered twice or missing, or page sizes that do not add up to
                the group's ``block_bytes`` in ``config``.
        """
        factor = config.block_size_factor
        out: dict[int, GroupLayout] = {}
        for spec in groups:
            if not 0 <= spec.group < len(config.resolved):
                raise LayoutError(f"group {spec.group}: not in the config, which has "
                                  f"{len(config.resolved)} groups")
            if spec.group in out:
                raise LayoutError(f"group {spec.group}: registered twice")
            out[spec.group] = _build_group(config, spec, factor)
        missing = [i for i in range(len(config.resolved)) if i not in out]
        if missing:
            raise LayoutError(f"groups {missing}: no tensors registered; every group of the "
                              "config needs its cache tensors")
        devices = {g.segments[0].pages.device for g in out.values()}
        if len(devices) != 1:
            raise LayoutError(f"groups live on several devices {sorted(map(str, devices))}; "
                              "one worker moves the caches of one device")
        return cls(groups=dict(sorted(out.items())), factor=factor,
                   slot_bytes=config.slot_bytes, device=devices.pop())


def _build_group(config: OffloadConfig, spec: GroupTensors, factor: int) -> GroupLayout:
    resolved = config.resolved[spec.group]
    label = f"group {spec.group} ({resolved.spec.name or resolved.kind.value})"
    if not spec.layers:
        raise LayoutError(f"{label}: no layers given")
    named: list[tuple[str, torch.Tensor]] = []
    for layer_name, tensors in spec.layers:
        named.extend(_segments_of_layer(label, layer_name, tensors, spec.layout))
    num_blocks = {int(p.shape[0]) for _, p in named}
    if len(num_blocks) != 1:
        counts = ", ".join(f"{n}: {int(p.shape[0])}" for n, p in named)
        raise LayoutError(f"{label}: tensors disagree on the number of blocks ({counts}); "
                          "the layers of a group share one block table")
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        raise LayoutError(f"{label}: tensors on several devices {sorted(map(str, devices))}")
    page_sum = sum(int(p.shape[1]) for _, p in named)
    expected = resolved.block_bytes
    if page_sum * factor != expected:
        raise LayoutError(
            f"{label}: the registered tensors hold {page_sum} bytes per engine block "
            f"({len(named)} page segments), i.e. {page_sum * factor} bytes per offloaded block "
            f"with block_size_factor {factor}, but the config says page_bytes "
            f"{resolved.spec.page_bytes} x num_layers {resolved.spec.num_layers} x factor "
            f"{factor} = {expected}. Fix GroupSpec.page_bytes/num_layers or the tensors.")
    segments = []
    offset = 0
    for name, pages in named:
        segments.append(PageSegment(name=name, pages=pages, host_offset=offset))
        offset += int(pages.shape[1]) * factor
    return GroupLayout(group=spec.group, segments=tuple(segments),
                       num_blocks=num_blocks.pop(), factor=factor)


def _segments_of_layer(label: str, layer: str, tensors: LayerTensors,
                       layout: CacheTensorLayout) -> list[tuple[str, torch.Tensor]]:
    parts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not parts:
        raise LayoutError(f"{label}, layer {layer!r}: no tensors given")
    out: list[tuple[str, torch.Tensor]] = []
    for i, tensor in enumerate(parts):
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{label}, layer {layer!r}: entry {i} is a "
                              f"{type(tensor).__name__}, not a torch.Tensor")
        name = layer if len(parts) == 1 else f"{layer}[{i}]"
        if layout is CacheTensorLayout.KV_FIRST:
            if tensor.dim() < 2 or tensor.shape[0] != 2:
                raise LayoutError(
                    f"{label}, layer {name!r}: shape {tuple(tensor.shape)} is not "
                    "(2, num_blocks, ...) as the kv_first layout requires")
            out.append((f"{name}.k", _page_view(label, f"{name}.k", tensor[0])))
            out.append((f"{name}.v", _page_view(label, f"{name}.v", tensor[1])))
        else:
            out.append((name, _page_view(label, name, tensor)))
    return out


def _page_view(label: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Return the uint8 ``(num_blocks, page_bytes)`` view of ``tensor`` (blocks on dim 0)."""
    where = f"{label}, layer {name!r}: tensor of shape {tuple(tensor.shape)}, " \
            f"stride {tuple(tensor.stride()) if tensor.layout == torch.strided else '-'}"
    if tensor.layout != torch.strided:
        raise LayoutError(f"{where}: layout {tensor.layout} is not strided")
    if tensor.dim() < 1 or tensor.shape[0] == 0:
        raise LayoutError(f"{where}: no block dimension (need num_blocks > 0 on dim 0)")
    itemsize = tensor.element_size()
    page_elems = 1
    for size in tensor.shape[1:]:
        page_elems *= int(size)
    if page_elems == 0:
        raise LayoutError(f"{where}: empty pages")
    # Each block's elements must be one dense run: walk the per-block dims innermost first.
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            raise LayoutError(f"{where}: the bytes of one block are not contiguous; pass the "
                              "cache with its block dimension outermost and each block dense")
        expected *= int(size)
    num_blocks = int(tensor.shape[0])
    row_stride = int(tensor.stride(0))
    if num_blocks > 1 and row_stride < page_elems:
        raise LayoutError(f"{where}: blocks overlap (block stride {row_stride} elements "
                          f"< {page_elems} elements per block)")
    page_bytes = page_elems * itemsize
    # (num_blocks, page_bytes) uint8, aliasing the same storage.
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    view.set_(tensor.untyped_storage(), tensor.storage_offset() * itemsize,
              (num_blocks, page_bytes), (max(row_stride, page_elems) * itemsize, 1))
    return view


_WIDE_DTYPES: tuple[tuple[int, torch.dtype], ...] = (
    (16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16),
    (1, torch.uint8),
)


def widest_dtype(*byte_quantities: int) -> torch.dtype:
    """The widest plain element type whose size divides every given byte count/address.

    Copies through wide elements are bit-exact (no arithmetic touches them) and cost fewer
    element operations than byte copies, and keep element counts under the thresholds at
    which torch splits one copy over its intra-op threads.
    """
    for size, dtype in _WIDE_DTYPES:
        if all(q % size == 0 for q in byte_quantities):
            return dtype
    return torch.uint8


def as_elements(pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 view whose last dim is dense as ``dtype`` (last dim shrinks)."""
    if dtype == torch.uint8:
        return pages
    return pages.view(dtype)
