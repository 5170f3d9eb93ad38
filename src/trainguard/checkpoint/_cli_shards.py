"""``trainguard ckpt show|verify`` across the parts of one checkpoint: sharded (DTensor) tensors.

A sharded tensor is saved as chunks, one per part (rank) that wrote one, each at its offsets
in the global tensor (see :mod:`.format.snode`). Here every part's header of one directory is read
into an :class:`~._reshard.Index`: ``show`` lists each sharded tensor with its global shape,
dtype, mesh, placements and the chunk each file holds; ``verify`` checks that the parts of a
multi-rank checkpoint are all there and that the chunks of every sharded tensor cover it exactly
once (naming the tensor, and the overlap or the region no chunk holds).

Directories are the two multi-part layouts: ``rankNNNNN.safetensors`` parts (part = rank), and
a local-checkpoint iteration, ``ownerNNNNN.hNNNNN.safetensors`` copies (part = owner; one copy
per owner is read). A node's local root holds only its clique's owners: coverage is checked only
where every owner of the saved world is present.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.checkpoint._reshard import Index
    from trainguard.checkpoint.format.shards import Box

__all__ = ["part_files", "problems", "show", "uncovered"]

_NUMBERED = re.compile(r"^(rank|owner)(\d{5})(\.h\d{5})?\.safetensors$")


def part_files(
    directory: Path, files: list[Path], usable: Callable[[Path], bool] = lambda p: True
) -> dict[int, Path]:
    """Part number -> file among ``files`` of ``directory``: the rank's part, or the first
    copy of the owner's part (in name order) that is ``usable``."""
    out: dict[int, Path] = {}
    for path in sorted(files):
        match = _NUMBERED.match(path.name)
        if path.parent == directory and match and int(match[2]) not in out and usable(path):
            out[int(match[2])] = path
    return out


def _index(files: dict[int, Path]) -> tuple[Index, int]:
    """The index of these parts' headers, and the saved world size their metadata names
    (the largest; 0 when none says)."""
    from trainguard.checkpoint._reshard import Index
    from trainguard.checkpoint.format.read import read_header

    headers = {part: read_header(path) for part, path in files.items()}
    world = 0
    for header in headers.values():
        size = header.metadata.get("world_size", "0")
        world = max(world, int(size) if size.isdigit() else 0)
    return Index.from_headers(headers), world


def _dotted(key: tuple[Any, ...]) -> str:
    return ".".join(str(k) for k in key)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def show(first: Path, files: list[Path]) -> tuple[list[str], set[str]]:
    """The lines ``show`` prints for the sharded tensors of the checkpoint whose first part is
    ``first`` (its directory's parts among ``files``; none when nothing is sharded), and the
    entry names that hold their chunks (``show`` lists the other entries of ``first``)."""
    from trainguard.errors import CheckpointError

    try:
        return _sharded_lines(part_files(first.parent, files) or {0: first})
    except CheckpointError as exc:
        return [f"  (sharded tensors not shown: {exc})"], set()


def _sharded_lines(files: dict[int, Path]) -> tuple[list[str], set[str]]:
    index, _ = _index(files)
    lines: list[str] = []
    entries: set[str] = set()
    for key, (shape, dtype, chunks) in index.tensors().items():
        parts = sorted({c.part for c in chunks})
        node = index.saved_leaf(key, parts[0] if parts else min(files))
        mesh, placements = node.get("mesh", []), node.get("placements", [])
        lines.append(
            f"  {_dotted(key):<40} {str(dtype).removeprefix('torch.') + str(list(shape)):<16} sharded: "
            f"{_plural(len(chunks), 'chunk')} in {_plural(len(parts), 'file')}, mesh {mesh}, "
            f"placements [{', '.join(map(str, placements))}]"
        )
        entries.update(c.entry for c in chunks)
        for c in sorted(chunks, key=lambda c: (c.part, c.box.offsets)):
            lines.append(
                f"      {files[c.part].name:<34} offsets {list(c.box.offsets)}  "
                f"sizes {list(c.box.sizes)}"
            )
    return lines, entries


def _subtract(box: Box, cut: Box) -> list[Box]:
    """The regions of ``box`` outside ``cut``, as boxes (at most two per dimension)."""
    from trainguard.checkpoint.format.shards import Box

    common = box.intersect(cut)
    if common is None:
        return [box]
    out = []
    offsets, sizes = list(box.offsets), list(box.sizes)
    for d, (lo, n, clo, cn) in enumerate(
        zip(box.offsets, box.sizes, common.offsets, common.sizes, strict=True)
    ):
        for start, stop in ((lo, clo), (clo + cn, lo + n)):
            if stop > start:
                out.append(
                    Box(
                        (*offsets[:d], start, *offsets[d + 1 :]),
                        (*sizes[:d], stop - start, *sizes[d + 1 :]),
                    )
                )
        offsets[d], sizes[d] = clo, cn  # the rest of the walk stays inside the cut
    return out


def uncovered(shape: tuple[int, ...], boxes: list[Box]) -> list[Box]:
    """The regions of a tensor of ``shape`` that none of ``boxes`` holds."""
    from trainguard.checkpoint.format.shards import Box

    rest = [Box((0,) * len(shape), shape)] if all(shape) else []
    for box in boxes:
        rest = [piece for region in rest for piece in _subtract(region, box)]
    return rest


def problems(directory: Path, files: list[Path], usable: Callable[[Path], bool]) -> list[str]:
    """What keeps the parts of ``directory`` among ``files`` from making one whole checkpoint:
    missing rank parts, and sharded tensors whose chunks overlap or leave a region uncovered.
    Parts that are not ``usable`` (they failed their own check) are left out."""
    from trainguard.checkpoint._reshard import key_repr
    from trainguard.errors import CheckpointError

    ranks = any(p.name.startswith("rank") for p in files if p.parent == directory)
    found = part_files(directory, files, usable)
    if not found:
        return []
    try:
        index, world = _index(found)
    except CheckpointError as exc:
        return [f"cannot read the parts together: {exc}"]
    present = {int(m[2]) for p in files if p.parent == directory and (m := _NUMBERED.match(p.name))}
    missing = [r for r in range(world) if r not in present]
    if missing and not ranks:
        return []  # a node's local root: only its clique's owners are here
    out = [
        f"rank{r:05d}.safetensors is missing (the checkpoint has {world} ranks)" for r in missing
    ]
    found_problems = index.coverage_problems()
    for key, (shape, _, chunks) in index.tensors().items():
        holes = uncovered(shape, [c.box for c in chunks])
        if not holes:
            continue
        where = "; no chunk holds " + ", ".join(
            f"offsets {list(h.offsets)} sizes {list(h.sizes)}" for h in holes
        )
        name = f"{key_repr(key)}: "
        at = next(
            (i for i, p in enumerate(found_problems) if p.startswith(name) and "overlap" not in p),
            None,
        )
        if at is None:
            found_problems.append(name + where.removeprefix("; "))
        else:
            found_problems[at] += where
    return out + found_problems
