"""StorageReader: ``torch.distributed.checkpoint`` loads from trainguard files.

Each rank reads, for every item its load plan needs, exactly the byte range of the saved entry
that holds it (``pread``; never whole files), verifies that entry's checksum, and copies the
requested region into the target. DCP's planners decide which saved chunks each rank needs, so
loading into a different world size or sharding works as with DCP's own storage.
"""

from __future__ import annotations

import io
import os
import time
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint import storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from trainguard import events
from trainguard.checkpoint import _commit, _overwrite
from trainguard.checkpoint.dcp import _metadata
from trainguard.checkpoint.dcp.storage_writer import checkpoint_path, local_path
from trainguard.checkpoint.fileformat import FileHeader, checksum, read_header, read_range
from trainguard.checkpoint.format import validate as _validate
from trainguard.checkpoint.layout import unflatten
from trainguard.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointPickleError,
    CheckpointUncommittedError,
)

__all__ = ["StorageReader"]

#: Classes a non-tensor value may hold beyond what ``weights_only`` allows by itself: a
#: ``BytesIO`` (DCP's way to save raw bytes, e.g. a data loader's state) restores only its bytes,
#: position and an attribute dict that the same restricted unpickler reads.
_SAFE: list[Any] = [io.BytesIO]


class StorageReader(storage.StorageReader):
    """A DCP storage reader for directories written by
    :class:`~trainguard.checkpoint.dcp.StorageWriter`.

    Protocol (DCP's): every rank calls ``dcp.load(state, storage_reader=r)`` with its own ``r``
    and the same path; DCP calls ``reset`` (a ``checkpoint_id`` becomes the path),
    ``read_metadata``, ``set_up_storage_reader``, ``prepare_local_plan``, on the coordinator
    ``prepare_global_plan``, and ``read_data`` on every rank. A directory without the
    ``COMMITTED`` marker is refused (:class:`CheckpointUncommittedError`) unless
    ``allow_uncommitted``. A saved entry whose bytes do not match their checksum raises
    :class:`CheckpointCorruptError` naming the file and the entry.

    Values that are not tensors (DCP saves each with ``torch.save``; its planner loads them
    with ``torch.load(weights_only=False)``, which runs whatever the pickle says) are first
    read here with ``torch.load(weights_only=True)``: numbers, strings, lists, dicts, tuples,
    tensors, ``io.BytesIO`` and the classes given to ``torch.serialization.add_safe_globals``. The planner is
    then handed that value saved again, never the file's bytes; any other value raises
    :class:`CheckpointPickleError` naming it, unless ``allow_pickle`` (only for checkpoints
    you trust: unpickling runs code).

    Args:
        path: the checkpoint directory (e.g. ``trainguard.checkpoint.latest(root)``).
        allow_uncommitted: read a directory that has no commit marker.
        allow_pickle: hand the planner non-tensor values as saved (unpickled with
            ``weights_only=False``: may run code).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allow_uncommitted: bool = False,
        allow_pickle: bool = False,
    ) -> None:
        self.path = checkpoint_path(path)
        self.allow_uncommitted = bool(allow_uncommitted)
        self.allow_pickle = bool(allow_pickle)
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.bytes_read = 0  # bytes of entries read by the latest read_data()
        self._headers: dict[str, tuple[FileHeader, dict[str, Any]]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_path(checkpoint_id, "checkpoint_id")
        self.storage_data = {}
        self._headers = {}

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        _overwrite.settle(self.path)  # an overwrite a crash interrupted
        if not os.path.isdir(self.path):
            raise CheckpointError(f"no checkpoint directory at {self.path}")
        marker = os.path.join(self.path, _commit.MARKER)
        _refuse_other_format(self.path)
        if not self.allow_uncommitted and not os.path.exists(marker):
            raise CheckpointUncommittedError(
                f"{self.path} has no {_commit.MARKER} marker: its save never completed on "
                "every rank; load an older checkpoint (trainguard.checkpoint.latest), or pass "
                "allow_uncommitted=True"
            )
        metadata = _metadata.read(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta(checkpoint_id=self.path)
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``: each saved entry once, checksum verified."""
        started = time.monotonic()
        by_entry: dict[tuple[str, str], list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_entry[self._where(item.storage_index)].append(item)
        nbytes = 0
        for (file, entry), items in by_entry.items():
            raw, node = self._read_entry(file, entry)
            nbytes += len(raw)
            where = f"{self.path}/{file}: entry {entry!r}"
            for item in items:
                if item.type == LoadItemType.BYTE_IO:
                    value = raw if self.allow_pickle else _safe_bytes(raw, file, entry)
                    planner.load_bytes(item, io.BytesIO(value))
                    continue
                region = _region(_as_tensor(raw, entry, node, where), item, where)
                target = planner.resolve_tensor(item).detach()
                if target.size() != region.size():
                    raise CheckpointCorruptError(
                        f"{file}: entry {entry!r} gives a region of shape {tuple(region.size())}"
                        f" where the target needs {tuple(target.size())}"
                    )
                target.copy_(region)
                planner.commit_tensor(item, target)
        self.bytes_read = nbytes
        events.emit(
            "ckpt_load",
            duration=time.monotonic() - started,
            bytes=nbytes,
            path=self.path,
            source="file",
        )
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for a local directory path; False for a URL (``s3://...``) or anything else."""
        return local_path(checkpoint_id)

    # ------------------------------------------------------------------ ours

    def _where(self, index: MetadataIndex) -> tuple[str, str]:
        where = self.storage_data.get(index)
        if (
            not isinstance(where, tuple)
            or len(where) != 2
            or not all(isinstance(x, str) for x in where)
            or os.path.basename(where[0]) != where[0]
        ):
            raise CheckpointCorruptError(
                f"{self.path}: the metadata has no valid place for {index.fqn!r} "
                f"({where!r}); the checkpoint is damaged or was not written by trainguard"
            )
        return where[0], where[1]

    def _header(self, file: str) -> tuple[FileHeader, dict[str, Any]]:
        """``file``'s header and its skeleton's nodes by entry name (read once per load); the
        skeleton's checksum is checked, as ``load`` checks it."""
        if file not in self._headers:
            header = read_header(os.path.join(self.path, file))
            if not header.is_trainguard:
                raise CheckpointCorruptError(f"{header.path}: not a trainguard file")
            tree = _validate.check_skeleton(header.path, header.metadata, verify=True)
            pairs = tree.get("D") if isinstance(tree, dict) and len(tree) == 1 else None
            if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs
            ):
                raise CheckpointCorruptError(
                    f"{header.path}: not a part written by trainguard.checkpoint.dcp (its "
                    "skeleton is not a list of entries); the checkpoint is damaged"
                )
            self._headers[file] = (header, dict(pairs))
        return self._headers[file]

    def _read_entry(self, file: str, entry: str) -> tuple[bytearray, Any]:
        """The verified bytes of ``entry`` in ``file``, and its skeleton node."""
        header, nodes = self._header(file)
        if entry not in header.entries or entry not in nodes:
            raise CheckpointCorruptError(f"{header.path}: tensor {entry!r} is missing")
        _, _, begin, end = header.entries[entry]
        raw = read_range(header.path, header.data_start + begin, header.data_start + end)
        if checksum(raw) != header.checksums().get(entry):
            raise CheckpointCorruptError(
                f"{header.path}: checksum mismatch in tensor {entry!r}; the file is corrupt, "
                "load an older checkpoint"
            )
        return raw, nodes[entry]


def _safe_bytes(raw: bytearray, file: str, entry: str) -> bytes:
    """The bytes of a value DCP saved with ``torch.save``, as ``torch.save`` writes the value
    that ``torch.load(weights_only=True)`` reads from ``raw``: what the planner unpickles then
    holds only globals that reader allows. :class:`CheckpointPickleError` when it refuses."""
    try:
        with torch.serialization.safe_globals(_SAFE):
            value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # an unpickling error, a global weights_only refuses
        raise CheckpointPickleError(
            f"{file}: entry {entry!r} holds a value that torch.load(weights_only=True) refuses "
            f"({_why(exc)}); if you "
            "trust this checkpoint, pass StorageReader(path, allow_pickle=True) (unpickling runs "
            "code), or register its classes with torch.serialization.add_safe_globals"
        ) from None
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def _why(exc: Exception) -> str:
    """The line of a ``weights_only`` error that says what it refused."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if not line.startswith(("Weights only load failed", "Check the documentation")):
            return line
    return type(exc).__name__


def _as_tensor(raw: bytearray, entry: str, node: Any, where: str) -> torch.Tensor:
    """The entry's saved chunk: ``raw`` viewed as its node says, with every check ``load``
    makes (a dtype from a fixed table, a shape whose bytes are exactly the entry's: never an
    allocation, never uninitialised values)."""
    if not (isinstance(node, dict) and node.get("T") == entry):
        raise CheckpointCorruptError(f"{where}: its skeleton node is not a tensor of it")
    data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    try:
        tensor = unflatten(node, {entry: data})
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{where}: {exc}") from None
    if not isinstance(tensor, torch.Tensor) or "stride" in node:
        raise CheckpointCorruptError(f"{where}: its skeleton node is not a whole tensor")
    return tensor


def _refuse_other_format(directory: str) -> None:
    """:class:`CheckpointError` naming the reader to use when ``directory`` holds a checkpoint
    of DCP's own file system layout (``.metadata`` and ``__<rank>_<n>.distcp`` files)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    if any(n.endswith(".distcp") for n in names) and not any(
        n.startswith("rank") and n.endswith(".safetensors") for n in names
    ):
        raise CheckpointError(
            f"{directory} is a checkpoint of another format: DCP's own file system layout "
            "(.metadata and __N_M.distcp files), not trainguard's; read it with "
            "torch.distributed.checkpoint.FileSystemReader (dcp.load(state, checkpoint_id="
            f"{directory!r}) picks it by default)"
        )


def _region(saved: torch.Tensor, item: ReadItem, where: str) -> torch.Tensor:
    """The region of ``saved`` a read item asks for; :class:`CheckpointCorruptError` when the
    metadata's offsets and lengths do not lie inside it."""
    offsets, lengths = list(item.storage_offsets), list(item.lengths)
    if (
        len(offsets) != saved.dim()
        or len(lengths) != saved.dim()
        or not all(
            o >= 0 and n >= 0 and o + n <= size
            for o, n, size in zip(offsets, lengths, saved.shape, strict=True)
        )
    ):
        raise CheckpointCorruptError(
            f"{where}: the metadata asks for offsets {offsets} lengths {lengths} of a saved "
            f"chunk of shape {list(saved.shape)}; the checkpoint is damaged, load an older one"
        )
    region = saved
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        region = region.narrow(dim, offset, length)
    return region
