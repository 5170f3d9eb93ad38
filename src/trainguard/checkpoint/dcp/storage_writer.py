"""StorageWriter: ``torch.distributed.checkpoint`` saves through trainguard's writer process.

Each rank's items go into one trainguard file, ``rank%05d.safetensors`` (any safetensors reader
opens it; a checksum per entry), written by the persistent writer process from a shared-memory
staging buffer. The coordinator's ``finish()`` writes DCP's metadata atomically and then the
same ``COMMITTED`` marker as :class:`~trainguard.checkpoint.AsyncCheckpointer`, so
:func:`trainguard.checkpoint.latest` finds the checkpoint, and never an uncommitted one.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import storage
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.futures import Future

from trainguard import _timeouts, events
from trainguard.checkpoint import _commit, _overwrite, _thread_writer
from trainguard.checkpoint._closing import Closing
from trainguard.checkpoint._load import part_name
from trainguard.checkpoint.dcp import _items, _metadata
from trainguard.checkpoint.format.write import PlacedEntry, place
from trainguard.checkpoint.staging import Stager, StagingBuffer
from trainguard.checkpoint.writer import WriteJob, WriterProcess
from trainguard.errors import CheckpointError, CheckpointWriteError, ConfigError, WriterDied

__all__ = ["StorageWriter", "checkpoint_path"]

logger = logging.getLogger(__name__)

#: The version DCP's own FileSystemWriter gives its metadata (its readers check nothing else).
_DCP_VERSION = "1.0.0"


def local_path(checkpoint_id: object) -> bool:
    """Whether ``checkpoint_id`` names a local directory (a non-empty str or PathLike that is not
    a URL such as ``s3://bucket/key``): DCP's ``validate_checkpoint_id`` of this layer."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return False
    text = os.fspath(checkpoint_id)
    return isinstance(text, str) and bool(text) and "://" not in text and "\0" not in text


def checkpoint_path(path: object, what: str = "path") -> str:
    """``path`` as a string; :class:`ConfigError` unless it is a non-empty str or PathLike of
    a local directory (not a URL)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{what}={path!r}: give the checkpoint directory as a str or os.PathLike")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{what}={path!r}: give a non-empty directory path (a str)")
    if not local_path(text):
        raise ConfigError(
            f"{what}={text!r} is not a local directory: trainguard's DCP storage layer writes "
            "and reads local (or mounted) file systems only; use a storage layer for that URL "
            "(or let dcp.save/dcp.load pick one: pass no storage_writer/storage_reader)"
        )
    return text


def _rebuilt(path: str, options: dict[str, Any]) -> StorageWriter:
    """A StorageWriter unpickled in another process (DCP's PROCESS executor): a new one."""
    return StorageWriter(path, **options)


def _release(writer: WriterProcess | _thread_writer.ThreadWriter, stager: Stager) -> None:
    writer.stop()
    stager.close()


class StorageWriter(storage.StorageWriter, Closing):
    """A DCP storage writer that writes trainguard files through one persistent writer process.

    Protocol (DCP's): every rank calls ``dcp.save(state, storage_writer=w)`` (or
    ``dcp.async_save``, with an :class:`~trainguard.checkpoint.dcp.AsyncStager` built on ``w``)
    with its own ``w`` and the same path; DCP then calls, on every rank, ``reset`` (when a
    ``checkpoint_id`` is given: it becomes the path), ``set_up_storage_writer``,
    ``prepare_local_plan`` and ``write_data`` (this rank's file is durable when it returns), and
    on the coordinator ``prepare_global_plan`` and, once every rank's file is durable,
    ``finish`` (metadata, then the ``COMMITTED`` marker).

    A path that already holds a committed checkpoint is overwritten safely (``overwrite=True``,
    the default, as DCP's ``FileSystemWriter``): the new save is written into a sibling
    directory and swapped in by the coordinator only once it is committed, so a crash at any
    moment leaves one complete checkpoint at the path, the old or the new one (see
    :mod:`trainguard.checkpoint._overwrite`). With ``overwrite=False`` such a path is refused
    (:class:`CheckpointError`, raised by DCP on every rank).

    The writer process and the staging buffer live across saves; :meth:`close` (or the end of
    a ``with`` block) stops the process and frees the buffers. One save at a time. In a
    daemonic process (a ``multiprocessing.Pool`` worker), which may not start one, files are
    written from a thread instead. ``dcp.async_save(...,
    async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` works: the writer is pickled as
    its arguments and built anew in DCP's background process (with an
    :class:`~trainguard.checkpoint.dcp.AsyncStager`, whose shared memory cannot go there, it is
    refused: use the THREAD executor, the default).

    Args:
        path: the checkpoint directory (a ``checkpoint_id`` given to ``dcp.save`` replaces it).
        fsync: make files durable (turn off only for benchmarks of memory-only storage).
        staging_threads: threads that copy into the staging buffer (default: up to 4).
        pin_memory: register staging buffers as pinned memory when CUDA is available.
        writer_nice: nice increment of the writer process (0-19).
        start_timeout: how long to wait for the writer process to start.
        overwrite: replace a committed checkpoint at the path (safely); False refuses it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = True,
        staging_threads: int | None = None,
        pin_memory: bool = True,
        writer_nice: int = 10,
        start_timeout: _timeouts.Timeout = 120.0,
        overwrite: bool = True,
    ) -> None:
        self.path = checkpoint_path(path)
        self._options: dict[str, Any] = {
            "fsync": fsync,
            "staging_threads": staging_threads,
            "pin_memory": pin_memory,
            "writer_nice": writer_nice,
            "start_timeout": start_timeout,
            "overwrite": overwrite,
        }
        self.overwrite = bool(overwrite)
        self._target = self.path  # where this rank's save writes (a sibling when overwriting)
        if staging_threads is not None and (
            isinstance(staging_threads, bool)
            or not isinstance(staging_threads, int)
            or staging_threads < 1
        ):
            raise ConfigError("staging_threads must be an int >= 1 (or None for the default)")
        if isinstance(writer_nice, bool) or not isinstance(writer_nice, int):
            raise ConfigError("writer_nice must be an int between 0 and 19")
        if not 0 <= writer_nice <= 19:
            raise ConfigError("writer_nice must be between 0 and 19")
        start = _timeouts.seconds("start_timeout", start_timeout)
        self.fsync = bool(fsync)
        self.rank = 0
        self.is_coordinator = True
        self._stager = Stager(
            threads=staging_threads or min(4, os.cpu_count() or 1), pin=pin_memory
        )
        self._writer = _thread_writer.make_writer(nice=writer_nice, start_timeout=start)
        try:
            self._writer.start()
        except WriterDied as exc:
            self._stager.close()
            raise CheckpointWriteError(str(exc)) from exc
        self._lock = threading.Lock()  # one thread talks to the writer process at a time
        self._seq = itertools.count()
        self._retired: list[StagingBuffer] = []
        self._staged: _items.Staged | None = None
        self._free = threading.Event()  # no staged buffer is waiting to be written
        self._free.set()
        self._claimed_by: threading.Thread | None = None  # the thread of the save that writes it
        self._closed = False
        #: whether the latest save copied its items into this writer's own buffer (False: it
        #: was written straight from the buffer its AsyncStager filled)
        self.last_save_copied = False
        self._release_when_collected(_release, self._writer, self._stager)

    # ------------------------------------------------------------------ DCP's protocol

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_path(checkpoint_id, "checkpoint_id")
        self._target = self.path

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        try:
            self._check_open()
            if kwargs.get("use_collectives", True) is False:
                raise CheckpointError(
                    "trainguard.checkpoint.dcp.StorageWriter commits a checkpoint once every "
                    "rank's file is durable, which needs DCP's collectives: drop "
                    "use_collectives=False"
                )
            if not self.overwrite:
                _overwrite.settle(self.path)
                _commit.refuse_overwrite(self.path)
        except CheckpointError:
            self._release_staged()  # this save will not write it: the next stage may reuse it
            raise
        if self._staged is not None:  # this save writes it, unless this thread fails first
            self._claimed_by = threading.current_thread()
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator only, while the other ranks wait for the plan: finish or clean what an
        interrupted save left at the path (so every rank's :meth:`write_data` then sees the same
        state and chooses the same place to write)."""
        if self.overwrite:
            _overwrite.recover(self.path)
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[storage.WriteResult]]:
        """Write this rank's items into its file; the future is done when the file is durable
        (it is already done when this returns: DCP waits for it at once anyway)."""
        started = time.monotonic()
        try:
            self._check_open()
            resolved = _items.resolve(plan, planner)
            name = part_name(self.rank, "trainguard")
            self._target = self.path  # a sibling of a committed one (the same on every rank)
            if self.overwrite and _overwrite.needs_sibling(self.path):
                seed = os.path.abspath(self.path)  # recover() left no sibling behind
                self._target = _overwrite.sibling(self.path, _overwrite.token(seed))
            file = os.path.join(self._target, name)
            os.makedirs(self._target, exist_ok=True)
            with self._lock:
                buffer, placed = self._layout(resolved)
                nbytes = self._write(file, buffer, placed, [e for _, e in resolved])
        finally:
            self._release_staged()
        events.emit(
            "ckpt_durable", duration=time.monotonic() - started, bytes=nbytes, path=self.path
        )
        results = [
            storage.WriteResult(
                index=item.index, size_in_bytes=e.nbytes, storage_data=(name, e.name)
            )
            for item, e in resolved
        ]
        future: Future[list[storage.WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[storage.WriteResult]]) -> None:
        """Coordinator only, after every rank's file is durable: write DCP's metadata, then
        commit the directory (the ``COMMITTED`` marker)."""
        metadata.version = _DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        beside = self._target != self.path
        _metadata.write(self._target, metadata, fsync=self.fsync)
        if beside:
            _overwrite.kill_point("uncommitted")
        marker = _commit._Marker(self._target, {"world_size": len(results), "format": "dcp"})
        marker.prepare()
        marker.act()
        if beside:
            _overwrite.swap(self._target, self.path)
            self._target = self.path
        events.emit("ckpt_committed", path=self.path, world_size=len(results))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for a local directory path; False for a URL (``s3://...``) or anything else,
        so that DCP picks another storage layer for it."""
        return local_path(checkpoint_id)

    # ------------------------------------------------------------------ ours

    def __reduce__(self) -> tuple[Any, tuple[str, dict[str, Any]]]:
        """Pickled as its arguments (DCP's PROCESS executor builds it anew in its process)."""
        if self._staged is not None:
            raise CheckpointError(
                "a state staged by trainguard's AsyncStager lives in this process's shared "
                "memory and cannot go to DCP's background process: use "
                "dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.THREAD) (the "
                "default) with AsyncStager, or no async_stager with AsyncCheckpointerType.PROCESS"
            )
        return (_rebuilt, (self.path, dict(self._options)))

    def close(self) -> None:
        """Stop the writer process, free the staging buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closed_explicitly()
        with self._lock:
            self._writer.stop()
            for old in self._retired:
                old.close()
            self._retired.clear()
            self._stager.close()
            self._release_staged()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this StorageWriter is closed; create a new one")

    def _release_staged(self) -> None:
        self._staged = None
        self._claimed_by = None
        self._free.set()

    def _wait_free(self, timeout: float) -> bool:
        """Wait until the staged state was written, or its save failed before writing it
        (the thread that claimed it ended: DCP runs each async save in a thread of its own)."""
        deadline = time.monotonic() + timeout
        while not self._free.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            claimed = self._claimed_by
            if claimed is not None and not claimed.is_alive():
                logger.info("the save of the staged state failed before writing it")
                self._release_staged()
                return True
            if time.monotonic() >= deadline:
                return False
        return True

    def _stage_into(self, staged: _items.Staged, retired: StagingBuffer | None) -> None:
        """An AsyncStager filled ``staged`` (replacing ``retired``): the next save writes it."""
        if retired is not None:
            self._retired.append(retired)
        self._staged = staged
        self._free.clear()

    def _layout(self, resolved: list[tuple[Any, Any]]) -> tuple[StagingBuffer, list[PlacedEntry]]:
        """The buffer to write from and the entries' places in it: the staged buffer as it is
        when the items are the staged tensors, else a copy into this writer's own buffer."""
        staged = self._staged
        if staged is not None:
            placed = _items.reuse(resolved, staged)
            if placed is not None:
                self.last_save_copied = False
                return staged.buffer, placed
            logger.info("the items to write are not the staged tensors: copying them")
        self.last_save_copied = True
        entries = [e for _, e in resolved]
        placed, total = place(entries)
        buffer, old = self._stager.ensure(total)
        if old is not None:
            self._retired.append(old)
        self._stager.stage(entries, placed)
        return buffer, placed

    def _write(
        self, file: str, buffer: StagingBuffer, placed: list[PlacedEntry], entries: list[Any]
    ) -> int:
        for old in self._retired:
            self._writer.detach(old.id)
            old.close()
        self._retired.clear()
        try:
            self._writer.prepare()
        except WriterDied as exc:
            raise CheckpointWriteError(f"{exc}; the save of {file} failed") from exc
        meta = {"rank": str(self.rank), "dcp": "1"}
        meta["skeleton"] = json.dumps(_items.skeleton(entries), separators=(",", ":"))
        job = WriteJob(next(self._seq), file, buffer.id, placed, meta, fsync=self.fsync)
        try:  # a failed save's next one starts a new writer (prepare)
            result = self._writer.write(job, buffer)
        except WriterDied as exc:
            raise CheckpointWriteError(f"{exc} while writing {file}; that save failed") from exc
        if not result.ok:
            raise CheckpointWriteError(f"writing {file} failed: {result.error}")
        return result.nbytes
