"""Loading a checkpoint into any sharding: an index of the saved chunks, and filling a target.

Every part (one rank's file) of a checkpoint holds a skeleton; a sharded leaf's node names the
entry with that rank's chunk of the global tensor (see :mod:`.format.snode`). :class:`Index` gathers
those chunks from every part's header. :func:`fill` walks a target state (the same structure,
its DTensors sharded any way, on any number of ranks) and, for each tensor, reads the saved
chunks that overlap this rank's part of it (through a ``read`` function that returns a chunk's
bytes with their checksum verified) and copies the overlap in place. A plain (unsharded) saved
tensor is one chunk covering the whole tensor, read from this rank's own part. Callers:
``load(path, into=)`` reads chunks from files (:func:`file_reader`); the local checkpoint
manager reads them from its own files or receives them from peers.

Over 400 lines: the index's checks of the saved chunks (their cover, each target's cover) and
the fill read the same private tables of chunks per tensor; apart, those tables would become
an interface of their own for two readers that change together.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from trainguard.checkpoint.format import snode, validate
from trainguard.checkpoint.format.layout import dtype_from_name, unflatten
from trainguard.checkpoint.format.read import FileHeader, read_range
from trainguard.checkpoint.format.shards import (
    Box,
    copy_overlap,
    dtensor_box,
    local_view,
    uncovered,
)
from trainguard.checkpoint.format.write import checksum
from trainguard.errors import CheckpointCorruptError, CheckpointError

__all__ = [
    "FillStats",
    "Index",
    "ReadChunk",
    "SavedChunk",
    "check_chunk",
    "check_cover",
    "file_reader",
    "fill",
    "key_repr",
]

Key = tuple[Any, ...]


def key_repr(key: Key) -> str:
    """``state['model']['w']``: how errors name a leaf."""
    return "state" + "".join(f"[{k!r}]" for k in key)


@dataclasses.dataclass(frozen=True)
class SavedChunk:
    """One saved region of a tensor: in part ``part``'s file, bytes ``[begin, end)``."""

    key: Key  # the leaf's path in the state, e.g. ("model", "0.weight")
    part: int  # the part (file) holding it: the saving rank's number
    entry: str
    box: Box
    dtype: torch.dtype
    begin: int  # absolute byte offsets in that part's file
    end: int
    checksum: str  # xxh3 of bytes [begin, end)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


#: Returns a chunk's bytes, their checksum verified (see :func:`check_chunk`).
ReadChunk = Callable[[SavedChunk], "memoryview | bytes | bytearray"]


@dataclasses.dataclass
class FillStats:
    """What :func:`fill` read: bytes, chunks (each read once), and the parts they came from."""

    bytes_read: int = 0
    chunks_read: int = 0
    parts_read: set[int] = dataclasses.field(default_factory=set)


def check_chunk(chunk: SavedChunk, data: Any, label: str) -> None:
    """:class:`CheckpointCorruptError` naming ``label`` (the file), the key and the chunk when
    ``data`` is not the chunk's bytes."""
    if len(data) == chunk.nbytes and checksum(data) == chunk.checksum:
        return
    raise CheckpointCorruptError(
        f"{label}: checksum mismatch in chunk of {key_repr(chunk.key)} at offsets "
        f"{chunk.box.offsets} sizes {chunk.box.sizes} (entry {chunk.entry!r}); the file is "
        "corrupt, load an older checkpoint"
    )


def file_reader(
    paths: Mapping[int, str | os.PathLike[str]],
    *,
    verify: bool = True,
    fds: Mapping[int, int] | None = None,
) -> ReadChunk:
    """A :data:`ReadChunk` reading part ``p``'s chunks from ``paths[p]`` (one ``pread`` each);
    with ``fds``, from the descriptor ``fds[p]`` (the one its header was read from)."""

    def read(chunk: SavedChunk) -> bytearray:
        path = os.fspath(paths[chunk.part])
        fd = None if fds is None else fds[chunk.part]
        data = read_range(path, chunk.begin, chunk.end, fd=fd)
        if verify:
            check_chunk(chunk, data, path)
        return data

    return read


def _leaves(node: Any, path: Key, out: dict[Key, Any]) -> None:
    """Every non-container node of a skeleton, by path (containers as :mod:`.format.layout` writes)."""
    if isinstance(node, dict) and len(node) == 1:
        ((tag, value),) = node.items()
        if tag == "D" and isinstance(value, list):
            for pair in value:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise CheckpointCorruptError(f"{key_repr(path)}: malformed skeleton dict")
                _leaves(pair[1], (*path, pair[0]), out)
            return
        if tag in ("L", "U") and isinstance(value, list):
            for i, item in enumerate(value):
                _leaves(item, (*path, i), out)
            return
    out[path] = node


@dataclasses.dataclass
class _Tensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[SavedChunk]


class Index:
    """Every part's header of one checkpoint; built from ``{part: FileHeader}``.

    ``saved_world`` is the number of parts (ranks at save time). Every rank of a load builds the
    same index from the same headers, so every rank computes the same plan.
    """

    def __init__(self, headers: Mapping[int, FileHeader]) -> None:
        self.headers = dict(headers)
        self.saved_world = max(self.headers, default=-1) + 1
        self._leaves: dict[int, dict[Key, Any]] = {}
        self._sharded: dict[Key, _Tensor] = {}
        for part in sorted(self.headers):
            self._add(part, self.headers[part])

    @classmethod
    def from_headers(cls, headers: Mapping[int, FileHeader]) -> Index:
        return cls(headers)

    def _add(self, part: int, header: FileHeader) -> None:
        label = header.path
        skeleton = validate.check_skeleton(label, header.metadata, verify=True)
        sums = header.checksums()
        leaves: dict[Key, Any] = {}
        _leaves(skeleton, (), leaves)
        self._leaves[part] = leaves
        for key, node in leaves.items():
            if not (isinstance(node, dict) and "S" in node):
                continue
            name = node["S"]
            entry = header.entries.get(name) if isinstance(name, str) else None
            size = None if entry is None else entry[3] - entry[2]
            where = f"{label}: {key_repr(key)}"
            s = snode.check(node, where, size, dtype_from_name(node.get("dtype")))
            known = self._sharded.setdefault(key, _Tensor(s.shape, s.dtype, []))
            if (known.shape, known.dtype) != (s.shape, s.dtype):
                raise CheckpointCorruptError(
                    f"{where}: global shape {list(s.shape)} of {s.dtype}, but another part "
                    f"saved it as {list(known.shape)} of {known.dtype}"
                )
            if entry is not None and s.entry is not None and s.box.numel:
                begin, end = header.data_start + entry[2], header.data_start + entry[3]
                chunk = SavedChunk(key, part, s.entry, s.box, s.dtype, begin, end, sums[s.entry])
                known.chunks.append(chunk)

    def tensors(self) -> dict[Key, tuple[tuple[int, ...], torch.dtype, list[SavedChunk]]]:
        """Every sharded tensor: its global shape, dtype and saved chunks (plain tensors,
        which each part holds its own of, are not listed)."""
        return {k: (t.shape, t.dtype, list(t.chunks)) for k, t in self._sharded.items()}

    def coverage_problems(self) -> list[str]:
        """What keeps each sharded tensor from being covered by its chunks exactly once:
        overlapping chunks, or elements no chunk holds; ``[]`` when there is nothing."""
        problems = []
        for key, t in self._sharded.items():
            overlaps = [
                f"{key_repr(key)}: the chunks at offsets {a.box.offsets} (part {a.part}) and "
                f"{b.box.offsets} (part {b.part}) overlap at offsets {common.offsets} sizes "
                f"{common.sizes}"
                for i, a in enumerate(t.chunks)
                for b in t.chunks[i + 1 :]
                if (common := a.box.intersect(b.box)) is not None
            ]
            problems += overlaps
            covered, total = sum(c.box.numel for c in t.chunks), Box((), t.shape).numel
            if not overlaps and covered != total:
                gap = uncovered(Box((0,) * len(t.shape), t.shape), [c.box for c in t.chunks])
                hole = f": no chunk holds offsets {gap.offsets} sizes {gap.sizes}" if gap else ""
                problems.append(
                    f"{key_repr(key)}: its chunks cover {covered} of its {total} elements "
                    f"(global shape {list(t.shape)}){hole}"
                )
        return problems

    def refuse_bad_cover(self, label: str) -> None:
        """:class:`CheckpointCorruptError` naming :meth:`coverage_problems` when there are any:
        run before anything is read or copied, so a refusal leaves the target untouched."""
        problems = self.coverage_problems()
        if problems:
            raise CheckpointCorruptError(
                f"{label}: the saved chunks do not cover every sharded tensor exactly once: "
                + "; ".join(problems[:4])
                + "; the checkpoint is damaged, load an older one"
            )

    def saved_leaf(self, key: Key, part: int) -> Any:
        """The skeleton node of ``key`` in ``part`` (:class:`CheckpointError` if none)."""
        leaves = self._leaves.get(part, {})
        if key not in leaves:
            raise CheckpointError(
                f"{key_repr(key)} is not in the checkpoint (part {part}): load(..., into=) "
                "fills only keys the checkpoint holds; remove it from the target, or load a "
                "checkpoint that has it"
            )
        return leaves[key]

    def sources(
        self, key: Key, target: torch.Tensor, plain_part: int
    ) -> tuple[Box, list[SavedChunk]]:
        """The target's box on this rank and the saved chunks overlapping it; checks that
        the saved global shape and dtype are the target's."""
        box, shape = dtensor_box(target), tuple(target.shape)
        saved = self._sharded.get(key)
        if saved is None:
            node = self.saved_leaf(key, plain_part)
            saved = self._plain(key, node, plain_part)
        if (saved.shape, saved.dtype) != (shape, target.dtype):
            raise CheckpointError(
                f"{key_repr(key)}: the checkpoint holds shape {list(saved.shape)} of "
                f"{saved.dtype}, the target has shape {list(shape)} of {target.dtype}; "
                "load into a target of the saved shapes and dtypes"
            )
        return box, [c for c in saved.chunks if c.box.intersect(box) is not None]

    def _plain(self, key: Key, node: Any, part: int) -> _Tensor:
        """A plain saved tensor as one chunk covering it (the whole entry it views)."""
        if not (isinstance(node, dict) and isinstance(node.get("T"), str)):
            raise CheckpointError(
                f"{key_repr(key)}: the target holds a tensor, the checkpoint a "
                f"{type(node).__name__} node; load into a target of the saved structure"
            )
        header = self.headers[part]
        entry = header.entries.get(node["T"])
        shape = node.get("shape")
        if entry is None or not isinstance(shape, list):
            raise CheckpointCorruptError(f"{header.path}: {key_repr(key)}: malformed tensor")
        dtype = dtype_from_name(node.get("dtype"))
        box = Box((0,) * len(shape), tuple(shape))
        begin, end = header.data_start + entry[2], header.data_start + entry[3]
        sums = header.checksums()
        chunk = SavedChunk(key, part, node["T"], box, dtype, begin, end, sums[node["T"]])
        return _Tensor(tuple(shape), dtype, [chunk] if box.numel else [])

    def needed(self, target: Any, *, plain_part: int) -> list[SavedChunk]:
        """The chunks this rank must read to fill ``target`` (each byte range once)."""
        out: dict[tuple[int, int, int], SavedChunk] = {}
        for key, t in _tensor_leaves(target, ()):
            for c in self.sources(key, t, plain_part)[1]:
                out.setdefault((c.part, c.begin, c.end), c)
        return list(out.values())


def check_cover(key: Key, box: Box, chunks: list[SavedChunk]) -> None:
    """:class:`CheckpointCorruptError` unless the parts of ``chunks`` inside ``box`` cover it
    exactly once: no two overlap (the region they share is named), and their volumes add up
    to the box's (a region no chunk holds is named)."""
    inside = [(c, common) for c in chunks if (common := c.box.intersect(box)) is not None]
    for i, (a, in_a) in enumerate(inside):
        for b, in_b in inside[i + 1 :]:
            both = in_a.intersect(in_b)
            if both is not None:
                raise CheckpointCorruptError(
                    f"{key_repr(key)}: the saved chunks at offsets {a.box.offsets} (part "
                    f"{a.part}) and {b.box.offsets} (part {b.part}) overlap at offsets "
                    f"{both.offsets} sizes {both.sizes}; the checkpoint is damaged, load an "
                    "older one"
                )
    covered = sum(common.numel for _, common in inside)
    if covered != box.numel:
        gap = uncovered(box, [common for _, common in inside])
        hole = "the rest" if gap is None else f"offsets {gap.offsets} sizes {gap.sizes}"
        raise CheckpointCorruptError(
            f"{key_repr(key)}: the checkpoint's chunks cover {covered} of the {box.numel} "
            f"elements of this rank's part (offsets {box.offsets} sizes {box.sizes}); no "
            f"chunk holds {hole}: the checkpoint is incomplete, load an older one"
        )


def _tensor_leaves(node: Any, path: Key) -> Iterator[tuple[Key, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        yield path, node
    elif isinstance(node, dict):  # the containers fill() walks
        for k, v in node.items():
            yield from _tensor_leaves(v, (*path, k))
    elif type(node) in (list, tuple):
        for i, v in enumerate(node):
            yield from _tensor_leaves(v, (*path, i))


def _as_bytes_tensor(data: Any) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only buffers (bytes): only ever read from here
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


class _Filler:
    def __init__(self, index: Index, read: ReadChunk, plain_part: int, allow_pickle: bool):
        self.index, self.read, self.plain_part = index, read, plain_part
        self.allow_pickle = allow_pickle
        self.stats = FillStats()
        self.cache: dict[tuple[int, int, int], torch.Tensor] = {}  # plain entries, shared

    def raw(self, chunk: SavedChunk) -> torch.Tensor:
        where = (chunk.part, chunk.begin, chunk.end)
        if where in self.cache:
            return self.cache[where]
        raw = _as_bytes_tensor(self.read(chunk))
        self.stats.bytes_read += chunk.nbytes
        self.stats.chunks_read += 1
        self.stats.parts_read.add(chunk.part)
        if chunk.key not in self.index._sharded:
            self.cache[where] = raw
        return raw

    def source(self, chunk: SavedChunk) -> torch.Tensor:
        raw = self.raw(chunk)
        if chunk.key in self.index._sharded:
            return raw.view(chunk.dtype).view(chunk.box.sizes)
        node = self.index.saved_leaf(chunk.key, chunk.part)
        try:
            rebuilt: torch.Tensor = unflatten(node, {chunk.entry: raw})
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(f"{self.index.headers[chunk.part].path}: {exc}") from None
        return rebuilt

    def tensor(self, key: Key, target: torch.Tensor) -> None:
        box, chunks = self.index.sources(key, target, self.plain_part)
        check_cover(key, box, chunks)  # before anything is copied: a refusal changes nothing
        view = local_view(target)
        with torch.no_grad():
            for chunk in chunks:
                copy_overlap(self.source(chunk), chunk.box, view, box)

    def value(self, key: Key) -> Any:
        node = self.index.saved_leaf(key, self.plain_part)
        if isinstance(node, dict) and ("T" in node or "S" in node):
            raise CheckpointError(
                f"{key_repr(key)}: the checkpoint holds a tensor, the target does not; put a "
                "tensor of the saved shape there to load it"
            )
        return unflatten(node, {}, allow_pickle=self.allow_pickle)

    def visit(self, node: Any, path: Key) -> Any:
        if isinstance(node, torch.Tensor):
            self.tensor(path, node)
            return node
        if isinstance(node, dict) or type(node) is list:
            pairs = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            for k, v in pairs:
                new = self.visit(v, (*path, k))
                if new is not v:
                    node[k] = new
            return node
        if type(node) is tuple:
            return tuple(self.visit(v, (*path, i)) for i, v in enumerate(node))
        return self.value(path)


def fill(
    target: Any,
    index: Index,
    read: ReadChunk,
    *,
    plain_part: int,
    allow_pickle: bool = False,
) -> FillStats:
    """Fill ``target`` in place from the checkpoint ``index`` describes; returns what was read.

    Each tensor leaf (a DTensor: this rank's local shard) gets the elements of the saved chunks
    that overlap it, each chunk read once with ``read``; plain saved tensors, and every leaf that
    is not a tensor (replaced in its dict or list by the saved value; tuples are rebuilt), come
    from part ``plain_part`` (this rank's own part; 0 when this rank did not exist at save).
    Raises :class:`CheckpointError` naming the key for a target key the checkpoint lacks, a
    global shape or dtype that differs, or elements no saved chunk holds. Saved keys that the
    target lacks are ignored.
    """
    filler = _Filler(index, read, plain_part, allow_pickle)
    filler.visit(target, ())
    return filler.stats
