"""DCP's write items as trainguard file entries: their names, their bytes, and their place.

A tensor write item (a whole plain tensor, or this rank's chunk of a DTensor) becomes one entry
of its dtype and shape (``U8`` of its bytes when the dtype has no safetensors code); a bytes
write item (DCP's ``BytesIO`` of a pickled object) becomes one ``U8`` entry. The entry is named
after the item's :class:`~torch.distributed.checkpoint.metadata.MetadataIndex`: the fully
qualified name, then ``@`` and the chunk's offsets when it has them.

:func:`reuse` places the entries of one save straight onto the buffer an
:class:`~trainguard.checkpoint.dcp.AsyncStager` filled (no second copy); :func:`skeleton` is
the JSON skeleton that lets :func:`trainguard.checkpoint.load` open one part as a flat dict.
"""

from __future__ import annotations

import dataclasses
import io

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from trainguard.checkpoint.format.layout import Entry, dtype_name
from trainguard.checkpoint.format.layout import tensor_entry as layout_entry
from trainguard.checkpoint.format.write import PlacedEntry
from trainguard.checkpoint.staging import StagingBuffer
from trainguard.errors import CheckpointError

__all__ = ["Staged", "entry_name", "resolve", "reuse", "skeleton", "tensor_entry"]


@dataclasses.dataclass(frozen=True)
class Staged:
    """What an AsyncStager copied into ``buffer``: ``placed`` covers ``[0, end)`` in offset
    order; ``by_ptr`` finds the placed entry of a staged tensor by its data pointer."""

    buffer: StagingBuffer
    placed: list[PlacedEntry]
    by_ptr: dict[int, PlacedEntry]
    end: int


def entry_name(index: MetadataIndex) -> str:
    """The entry name of a write item: ``fqn`` or ``fqn@o0,o1,...`` for a chunk."""
    name = index.fqn
    if index.offset is not None:
        name += "@" + ",".join(str(o) for o in index.offset)
    return "~" + name if name.startswith("__") else name  # "__metadata__" is safetensors'


def tensor_entry(name: str, t: torch.Tensor) -> Entry:
    """An entry whose bytes are ``t``'s elements in C order."""
    t = t.detach()
    if t.layout != torch.strided or t.device.type == "meta":
        raise CheckpointError(
            f"{name}: only dense (strided) tensors can be saved, not layout={t.layout} on "
            f"{t.device}"
        )
    return layout_entry(name, t)


def _bytes_entry(name: str, data: io.BytesIO) -> Entry:
    raw = bytearray(data.getbuffer())
    source = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return layout_entry(name, source)


def resolve(plan: SavePlan, planner: SavePlanner) -> list[tuple[WriteItem, Entry]]:
    """Every item of ``plan`` with its entry (``planner.resolve_data`` gives the data)."""
    out: list[tuple[WriteItem, Entry]] = []
    names: set[str] = set()
    for item in plan.items:
        name = entry_name(item.index)
        if name in names:
            raise CheckpointError(f"two write items of this rank are both named {name!r}")
        names.add(name)
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise CheckpointError(f"{name}: the planner resolved a bytes item to {type(data)}")
            out.append((item, _bytes_entry(name, data)))
        else:
            if not isinstance(data, torch.Tensor):
                raise CheckpointError(f"{name}: the planner resolved a tensor item to {type(data)}")
            out.append((item, tensor_entry(name, data)))
    return out


def reuse(resolved: list[tuple[WriteItem, Entry]], staged: Staged) -> list[PlacedEntry] | None:
    """The placed entries of a file whose data section is ``staged.buffer`` as staged, or None
    when the items are not (mostly) the staged tensors: then the caller copies them.

    Staged tensors this rank does not write (DCP gives each replicated tensor to one rank) stay
    in the file as entries named ``unplanned.<n>``, unless they outweigh the planned ones. Bytes
    items and empty tensors are copied after the staged region, when the buffer has room.
    """
    names: dict[str, str] = {}
    tail: list[Entry] = []
    planned = 0
    for item, entry in resolved:
        if entry.nbytes == 0 or item.type == WriteItemType.BYTE_IO:
            tail.append(entry)
            continue
        src = entry.source
        hit = staged.by_ptr.get(src.data_ptr()) if src.device.type == "cpu" else None
        if hit is None or hit.name in names or hit.nbytes != entry.nbytes:
            return None
        if not src.is_contiguous():
            return None
        names[hit.name] = entry.name
        planned += entry.nbytes
    if staged.end - planned > planned or (
        staged.end + sum(e.nbytes for e in tail) > staged.buffer.nbytes
    ):
        return None
    placed = [
        dataclasses.replace(p, name=names.get(p.name, f"unplanned.{p.name}")) for p in staged.placed
    ]
    offset = staged.end
    for entry in tail:
        if entry.nbytes:
            staged.buffer.view(offset, entry.nbytes).copy_(entry.source.reshape(-1))
        placed.append(PlacedEntry(entry.name, entry.dtype, entry.shape, offset, entry.nbytes))
        offset += entry.nbytes
    return placed


def skeleton(entries: list[Entry]) -> dict[str, object]:
    """A skeleton of ``{entry name: tensor}``: :func:`trainguard.checkpoint.load` of one part
    then returns this rank's entries by name (bytes items as ``uint8`` tensors)."""
    return {
        "D": [
            [
                e.name,
                {"T": e.name, "dtype": dtype_name(e.source.dtype), "shape": list(e.source.shape)},
            ]
            for e in entries
        ]
    }
