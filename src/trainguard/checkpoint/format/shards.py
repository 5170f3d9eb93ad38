"""Box math for sharded tensors, and the one place that touches DTensor internals (no I/O).

A :class:`Box` is a rectangular region of a global tensor: ``offsets`` of its first element and
``sizes`` along every dimension. A DTensor's local shard on this rank is one box of its global
tensor (:func:`dtensor_box`, from ``__create_chunk_list__``, which handles uneven, 2-D and strided
sharding); a plain tensor is the box that covers all of it. Loading into another sharding is
copying the intersection of a saved chunk's box and the target's box (:func:`copy_overlap`);
:func:`uncovered` finds a region of a box that a set of boxes leaves out.

DTensor is imported lazily: importing this module never imports ``torch.distributed.tensor``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from trainguard.errors import CheckpointError

__all__ = [
    "Box",
    "ShardInfo",
    "copy_overlap",
    "describe",
    "dtensor_box",
    "is_dtensor",
    "local_view",
    "uncovered",
]


@dataclasses.dataclass(frozen=True)
class Box:
    """A rectangular region of a global tensor: first element at ``offsets``, extent ``sizes``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def intersect(self, other: Box) -> Box | None:
        """The region both boxes cover, or None when they share no element."""
        if len(self.offsets) != len(other.offsets):
            raise ValueError(f"boxes of {len(self.offsets)} and {len(other.offsets)} dimensions")
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        hi = tuple(
            min(a + n, b + m)
            for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True)
        )
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def end(self) -> tuple[int, ...]:
        """One past the last index along every dimension."""
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    def within(self, shape: tuple[int, ...]) -> bool:
        """Whether the box lies inside a tensor of ``shape``."""
        return len(shape) == len(self.offsets) and all(
            o >= 0 and s >= 0 and o + s <= n
            for o, s, n in zip(self.offsets, self.sizes, shape, strict=True)
        )


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """What a checkpoint stores about a DTensor besides its local chunk (see :func:`describe`)."""

    box: Box
    shape: tuple[int, ...]
    mesh: tuple[int, ...]
    placements: tuple[str, ...]
    writes: bool  # False when another rank holds the same replica and writes it


@functools.cache
def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (or a Parameter wrapping one)."""
    if not isinstance(t, torch.Tensor) or type(t) in (torch.Tensor, torch.nn.Parameter):
        return False
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def _chunk(t: Any) -> Box:
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1:
        raise CheckpointError(
            f"a DTensor with {len(chunks)} local chunks; only one chunk per rank is supported"
        )
    c = chunks[0]
    return Box(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))


def dtensor_box(t: torch.Tensor) -> Box:
    """This rank's chunk of a DTensor in its global tensor; a plain tensor's whole extent."""
    if is_dtensor(t):
        return _chunk(t)
    return Box((0,) * t.dim(), tuple(int(s) for s in t.shape))


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's elements: a DTensor's local shard (writable, sharing the
    DTensor's storage), a plain tensor itself."""
    if is_dtensor(t):
        local: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
        return local
    return t


def _placement_name(p: Any) -> str:
    if p.is_replicate():
        return "R"
    if p.is_partial():
        return "P"
    dim = getattr(p, "dim", None)
    split = getattr(p, "split_factor", None)
    return f"S{dim}" if split is None else f"S{dim}/{split}"


def describe(t: torch.Tensor, label: str) -> ShardInfo:
    """The chunk, global shape, mesh and placements of DTensor ``t``, and whether this rank
    writes its chunk: for every mesh dimension on which ``t`` is replicated, only the rank at
    coordinate 0 of that dimension does, so a checkpoint holds every element exactly once.
    ``Partial`` placements are refused (:class:`CheckpointError` naming ``label``)."""
    spec: Any = t
    placements = tuple(spec.placements)
    names = tuple(_placement_name(p) for p in placements)
    if "P" in names:
        raise CheckpointError(
            f"{label} is a DTensor with a Partial placement {placements}: its local values are "
            "not the tensor's values until they are reduced; redistribute it to Replicate or "
            "Shard placements first (t.redistribute(mesh, [Replicate()]))"
        )
    mesh = spec.device_mesh
    coordinate = mesh.get_coordinate()
    writes = coordinate is not None and all(
        c == 0 for c, name in zip(coordinate, names, strict=True) if name == "R"
    )
    return ShardInfo(
        _chunk(t) if coordinate is not None else Box((0,) * t.dim(), (0,) * t.dim()),
        tuple(int(s) for s in t.shape),
        tuple(int(s) for s in mesh.shape),
        names,
        writes,
    )


def _slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    return tuple(
        slice(i - o, i - o + n)
        for i, n, o in zip(inner.offsets, inner.sizes, outer.offsets, strict=True)
    )


def copy_overlap(src: torch.Tensor, src_box: Box, dst: torch.Tensor, dst_box: Box) -> int:
    """Copy the elements where ``src`` (holding ``src_box``) and ``dst`` (holding ``dst_box``)
    overlap from ``src`` into ``dst``, in place; returns how many elements were copied."""
    common = src_box.intersect(dst_box)
    if common is None:
        return 0
    dst[_slices(common, dst_box)].copy_(src[_slices(common, src_box)])
    return common.numel


def uncovered(box: Box, boxes: list[Box], limit: int = 4096) -> Box | None:
    """A region of ``box`` that none of ``boxes`` holds (None when there is none, or when
    finding one would split ``box`` into more than ``limit`` pieces)."""
    left = [box]
    for other in boxes:
        left = [piece for part in left for piece in _minus(part, other)]
        if len(left) > limit:
            return None
    return left[0] if left else None


def _minus(box: Box, other: Box) -> list[Box]:
    """``box`` without ``other``, as disjoint boxes (at most two per dimension)."""
    common = box.intersect(other)
    if common is None:
        return [box]
    pieces, offsets, sizes = [], list(box.offsets), list(box.sizes)
    for d in range(len(offsets)):
        lo, hi, end = common.offsets[d], common.offsets[d] + common.sizes[d], offsets[d] + sizes[d]
        if lo > offsets[d]:
            pieces.append(Box(tuple(offsets), (*sizes[:d], lo - offsets[d], *sizes[d + 1 :])))
        if hi < end:
            pieces.append(
                Box((*offsets[:d], hi, *offsets[d + 1 :]), (*sizes[:d], end - hi, *sizes[d + 1 :]))
            )
        offsets[d], sizes[d] = lo, hi - lo
    return pieces
