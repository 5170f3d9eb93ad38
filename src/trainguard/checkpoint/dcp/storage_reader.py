"""StorageReader: ``torch.distributed.checkpoint`` loads from trainguard files.

Each rank reads, for every item its load plan needs, exactly the byte range of the saved entry
that holds it (``pread``; never whole files), verifies that entry's checksum, and copies the
requested region into the target. DCP's planners decide which saved chunks each rank needs, so
loading into a different world size or sharding works as with DCP's own storage.

A save may overwrite the directory while ranks load it (it is swapped in whole, see
:mod:`trainguard.checkpoint._overwrite`). Each rank's reader opens the directory once, in
``read_metadata``, and reads the marker, the metadata and every part through that descriptor
(the parts are opened there too, so the old directory's removal after a swap cannot take them
away); a read that raced a swap there is tried again. The ranks' plans carry the save id of
the marker each read, and the coordinator refuses a load whose ranks read different saves
(:class:`CheckpointError`, "load again"), so no rank ever resumes from another save than the
others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.distributed.checkpoint import storage
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from trainguard import events
from trainguard.checkpoint import _commit, _load, _overwrite
from trainguard.checkpoint.dcp import _metadata
from trainguard.checkpoint.dcp.storage_writer import checkpoint_path, local_path
from trainguard.checkpoint.format import validate as _validate
from trainguard.checkpoint.format.layout import unflatten
from trainguard.checkpoint.format.read import FileHeader, header_of, open_file, read_range
from trainguard.checkpoint.format.write import checksum
from trainguard.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointPickleError,
    CheckpointUncommittedError,
)

__all__ = ["StorageReader"]

#: Parts a reader opens in ``read_metadata`` (beyond this, each when it is first read).
_EAGER_PARTS = 256


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


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
        self._fds: list[int] = []  # the directory's, then its parts' (closed by _release)
        self._parts: dict[str, int] = {}  # part file -> its descriptor
        self._save_id = ""
        self._closer = weakref.finalize(self, _close_all, self._fds)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_path(checkpoint_id, "checkpoint_id")
        self.storage_data = {}
        self._headers = {}
        self._release()

    def _release(self) -> None:
        """Close the directory's and the parts' descriptors (the next load opens them anew)."""
        _close_all(self._fds)
        self._fds.clear()
        self._parts = {}

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Open the directory (once: see the module) and read its metadata."""
        self._release()
        for attempt in range(_load._ATTEMPTS):
            try:
                return self._open_and_read()
            except (OSError, CheckpointError):
                opened = _load._Opened(self.path, self._fds[0], None) if self._fds else None
                replaced = _load._replaced(self.path, opened)  # before its descriptor closes
                self._release()
                if attempt + 1 == _load._ATTEMPTS or not replaced:
                    raise
        raise AssertionError("unreachable")

    def _open_and_read(self) -> Metadata:
        _overwrite.settle(self.path)  # an overwrite a crash interrupted
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(f"no checkpoint directory at {self.path}") from None
        self._fds.append(fd)
        opened = _load._Opened(self.path, fd, None)
        _refuse_other_format(self.path, fd)
        if opened.has(_commit.MARKER):
            info = _load._marker(opened.file(_commit.MARKER), fd)
            self._save_id = str(info.get("save_id", ""))
        elif not self.allow_uncommitted:
            raise CheckpointUncommittedError(
                f"{self.path} has no {_commit.MARKER} marker: its save never completed on "
                "every rank; load an older checkpoint (trainguard.checkpoint.latest), or pass "
                "allow_uncommitted=True"
            )
        else:
            self._save_id = ""
        metadata = _metadata.read(self.path, dir_fd=fd)
        if isinstance(metadata.storage_data, dict):
            files = sorted({w[0] for w in metadata.storage_data.values() if _valid_place(w)})
            for name in files[:_EAGER_PARTS]:  # the old directory's removal cannot take them
                self._part_fd(name)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta(checkpoint_id=self.path)
        return metadata

    def _part_fd(self, file: str) -> int:
        """The descriptor of the part ``file`` in the opened directory (opened on first use)."""
        if file not in self._parts:
            if not self._fds:
                raise CheckpointError(f"{self.path}: read_metadata() was not called first")
            fd = open_file(os.path.join(self.path, file), dir_fd=self._fds[0])
            self._fds.append(fd)
            self._parts[file] = fd
        return self._parts[file]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = dict(metadata.storage_data)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan, carrying the save id this rank read (checked by the coordinator)."""
        return dataclasses.replace(plan, storage_data=self._save_id)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator only: refuse a load whose ranks read different saves (one replaced the
        directory between two ranks' ``read_metadata``)."""
        seen = sorted({str(p.storage_data) for p in plans})
        if len(seen) > 1:
            raise CheckpointError(
                f"the ranks read different saves of {self.path} (saves {seen}): a save replaced "
                "it while they loaded; load again (every rank then reads the new one)"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan``: each saved entry once, checksum verified."""
        started = time.monotonic()
        by_entry: dict[tuple[str, str], list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_entry[self._where(item.storage_index)].append(item)
        try:
            nbytes = self._read_items(by_entry, planner)
        finally:
            self._release()
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

    def _read_items(
        self, by_entry: dict[tuple[str, str], list[ReadItem]], planner: LoadPlanner
    ) -> int:
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
        return nbytes

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for a local directory path; False for a URL (``s3://...``) or anything else."""
        return local_path(checkpoint_id)

    # ------------------------------------------------------------------ ours

    def _where(self, index: MetadataIndex) -> tuple[str, str]:
        where = self.storage_data.get(index)
        if where is None or not _valid_place(where):
            raise CheckpointCorruptError(
                f"{self.path}: the metadata has no valid place for {index.fqn!r} "
                f"({where!r}); the checkpoint is damaged or was not written by trainguard"
            )
        return str(where[0]), str(where[1])

    def _header(self, file: str) -> tuple[FileHeader, dict[str, Any]]:
        """``file``'s header and its skeleton's nodes by entry name (read once per load); the
        skeleton's checksum is checked, as ``load`` checks it."""
        if file not in self._headers:
            header = header_of(self._part_fd(file), os.path.join(self.path, file))
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
        raw = read_range(
            header.path, header.data_start + begin, header.data_start + end, fd=self._part_fd(file)
        )
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


def _valid_place(where: object) -> bool:
    """Whether a metadata's storage data is a place this reader wrote: (file name, entry)."""
    return (
        isinstance(where, tuple)
        and len(where) == 2
        and all(isinstance(x, str) for x in where)
        and os.path.basename(where[0]) == where[0]
        and where[0] not in ("", ".", "..")
    )


def _refuse_other_format(directory: str, dir_fd: int) -> None:
    """:class:`CheckpointError` naming the reader to use when ``directory`` (open as
    ``dir_fd``) holds a checkpoint of DCP's own file system layout (``.metadata`` and
    ``__<rank>_<n>.distcp`` files)."""
    try:
        names = os.listdir(dir_fd)
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
