"""The skeleton node of a sharded (DTensor) leaf: built at save, checked at load.

::

    {"S": "<entry>" | null, "dtype": "float32", "shape": [global shape],
     "offsets": [chunk offsets], "sizes": [chunk sizes], "mesh": [mesh shape],
     "placements": ["S0", "R", ...]}

``"S"`` names the entry holding this rank's chunk (contiguous, C order, shape ``sizes``), or is
null when another rank writes the same replica (see :func:`.shards.describe`). Across the files
of one checkpoint the chunks of a tensor cover it exactly once. :mod:`.layout` calls both sides;
:mod:`._reshard` reads the checked nodes to load into any sharding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from trainguard.checkpoint.format.shards import Box, describe
from trainguard.errors import CheckpointCorruptError

__all__ = ["SNode", "check", "make"]

_FIELDS = frozenset(("S", "dtype", "shape", "offsets", "sizes", "mesh", "placements"))


@dataclasses.dataclass(frozen=True)
class SNode:
    """A checked "S" node."""

    entry: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    box: Box


def make(
    t: torch.Tensor, label: str, dtype_name: str
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The node of DTensor ``t`` (its ``"S"`` still None) and the local chunk to write, or None
    when this rank does not write it."""
    info = describe(t, label)
    node: dict[str, Any] = {
        "S": None,
        "dtype": dtype_name,
        "shape": list(info.shape),
        "offsets": list(info.box.offsets),
        "sizes": list(info.box.sizes),
        "mesh": list(info.mesh),
        "placements": list(info.placements),
    }
    if not info.writes:
        return node, None
    local: torch.Tensor = t.to_local().detach()  # type: ignore[attr-defined]
    if tuple(local.shape) != info.box.sizes:
        local = local.reshape(info.box.sizes)
    return node, local.contiguous()


def _ints(value: object, *, positive: bool = False) -> bool:
    return isinstance(value, list) and all(
        type(v) is int and (v > 0 if positive else v >= 0) for v in value
    )


def check(node: dict[str, Any], label: str, entry_nbytes: int | None, dtype: torch.dtype) -> SNode:
    """Check an "S" node's fields (``label`` names it in errors): the field set, integer
    lists, the chunk inside the global shape, and ``entry_nbytes`` (the size of the entry it
    names; None when there is no such entry) equal to the chunk's bytes."""

    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{label}: malformed skeleton: sharded tensor {what}")

    if not node.keys() <= _FIELDS or not node.keys() >= _FIELDS - {"S"}:
        raise bad(f"with fields {sorted(node)}; expected {sorted(_FIELDS)}")
    entry, shape, offsets, sizes = node["S"], node["shape"], node["offsets"], node["sizes"]
    if entry is not None and not isinstance(entry, str):
        raise bad(f"entry {entry!r}")
    if not (_ints(shape) and _ints(offsets) and _ints(sizes)):
        raise bad(f"shape {shape!r}, offsets {offsets!r}, sizes {sizes!r}")
    if not _ints(node["mesh"], positive=True) or not (
        isinstance(node["placements"], list) and all(isinstance(p, str) for p in node["placements"])
    ):
        raise bad(f"mesh {node['mesh']!r} and placements {node['placements']!r}")
    box = Box(tuple(offsets), tuple(sizes))
    if len(offsets) != len(shape) or not box.within(tuple(shape)):
        raise bad(f"chunk at offsets {offsets} sizes {sizes} outside its shape {shape}")
    if entry is not None:
        needed = math.prod(sizes) * dtype.itemsize
        if entry_nbytes is None:
            raise CheckpointCorruptError(f"{label}: tensor {entry!r} is missing")
        if entry_nbytes != needed:
            raise bad(
                f"chunk of sizes {sizes} needs {needed} bytes, its entry holds {entry_nbytes}"
            )
    return SNode(entry, dtype, tuple(shape), box)
