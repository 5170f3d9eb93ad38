"""What one save of :class:`~trainguard.checkpoint.AsyncCheckpointer` is: the handle the caller
holds, the info its callbacks receive, and the job the background threads carry; and the
:class:`Outcomes` of the saves not finished yet, which the training thread receives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainguard import events
from trainguard.checkpoint.format.write import PlacedEntry
from trainguard.checkpoint.staging import StagingBuffer
from trainguard.errors import CheckpointError, CheckpointWriteError

if TYPE_CHECKING:
    from trainguard.checkpoint.format.layout import Flat
    from trainguard.checkpoint.writer import WriteResult

__all__ = ["Job", "Outcomes", "SaveHandle", "SaveInfo"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    """What the callbacks receive about one save."""

    path: str  # the checkpoint (a file, or the directory of a multi-rank checkpoint)
    file: str  # this rank's file
    rank: int
    world_size: int
    nbytes: int  # bytes of tensor data staged
    file_bytes: int  # size of this rank's file
    staged_seconds: float  # time from save() to the state being in host memory
    durable_seconds: float  # time from save() to this rank's file being durable
    write_seconds: float  # time the writer spent on the file

    @property
    def throughput(self) -> float:
        """Bytes per second the writer achieved on this rank's file."""
        return self.file_bytes / self.write_seconds if self.write_seconds > 0 else 0.0


class SaveHandle:
    """Returned by :meth:`AsyncCheckpointer.save`; tells where one save is."""

    def __init__(self, seq: int, path: str, file: str) -> None:
        self.seq, self.path, self.file = seq, path, file
        self.staged = threading.Event()
        self.written = threading.Event()  # the writer is done with the staging buffer
        self.finished = threading.Event()  # committed or failed
        self.error: CheckpointError | None = None
        self.info: SaveInfo | None = None
        self.commit_key = ""  # the store prefix of its multi-rank commit

    @property
    def committed(self) -> bool:
        return self.finished.is_set() and self.error is None

    def __repr__(self) -> str:
        state = "committed" if self.committed else "failed" if self.error else "pending"
        return f"SaveHandle({self.path!r}, {state})"


@dataclasses.dataclass
class Job:
    """One save on its way: staged, written, committed (or failed)."""

    handle: SaveHandle
    flat: Flat | None  # dropped once the save is finished
    placed: list[PlacedEntry]
    buffer: StagingBuffer
    format: str
    overlap: bool
    on_durable: Callable[[SaveInfo], None] | None
    on_commit: Callable[[SaveInfo], None] | None
    requested: float
    cuda_stream: Any = None
    retired: StagingBuffer | None = None  # a buffer this job's larger one replaced
    commit_key: str = ""
    staged_at: float = 0.0
    nbytes: int = 0
    write_file: str = ""  # where the part is written, when not at handle.file (an overwrite)
    save_id: str = ""  # written into the part (and the commit marker): see Committer.save_id

    def durable(self, result: WriteResult, *, rank: int, world_size: int) -> None:
        """This rank's file is durable: fill in :attr:`SaveHandle.info`, emit the event."""
        now = time.monotonic()
        info = self.handle.info = SaveInfo(
            path=self.handle.path,
            file=self.handle.file,
            rank=rank,
            world_size=world_size,
            nbytes=self.nbytes,
            file_bytes=result.nbytes,
            staged_seconds=self.staged_at - self.requested,
            durable_seconds=now - self.requested,
            write_seconds=result.seconds,
        )
        events.emit(
            "ckpt_durable",
            duration=now - self.requested,
            bytes=result.nbytes,
            write_seconds=result.seconds,
            throughput=info.throughput,
            path=self.handle.path,
        )

    def finish(self, causes: dict[int, str], *, world_size: int) -> str:
        """Committed (no ``causes``) or failed: set the handle's error, emit the event, return
        which. The caller hands the result on, then sets :attr:`SaveHandle.finished`."""
        handle = self.handle
        kind = "failed" if causes else "committed"
        if causes:
            handle.error = CheckpointWriteError(
                f"checkpoint {handle.path} failed; no committed checkpoint was changed by it",
                causes=causes,
            )
            events.emit("ckpt_failed", path=handle.path, causes=causes)
        else:
            events.emit(
                "ckpt_committed",
                duration=time.monotonic() - self.requested,
                path=handle.path,
                world_size=world_size,
            )
        self.flat = None
        return kind


class Outcomes:
    """A checkpointer's saves not finished yet, and what its background threads report about
    them: ``(kind, job)`` on :attr:`results`, ``kind`` being ``"durable"``, ``"committed"`` or
    ``"failed"``. :meth:`deliver` hands them to the training thread: the callbacks run there and
    the first failure is raised (or, between rounds, everything is logged instead)."""

    def __init__(self) -> None:
        self.results: queue.SimpleQueue[tuple[str, Job]] = queue.SimpleQueue()
        self.pending: list[SaveHandle] = []  # in save order; a finished one leaves on delivery

    def open(self) -> list[SaveHandle]:
        """The pending saves not committed or failed yet."""
        return [h for h in self.pending if not h.finished.is_set()]

    def late(self, deadline: float | None) -> SaveHandle | None:
        """The first pending save not finished by ``deadline`` (None: wait without a bound)."""
        for handle in list(self.pending):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handle.finished.wait(remaining):
                return handle
        return None

    def deliver(self, *, logged: bool = False) -> None:
        """Run the callbacks of what was reported, in this thread; raise the first failure.
        ``logged`` (a round ended): failures and callback errors are logged, not raised."""
        first: CheckpointError | None = None
        while True:
            try:
                kind, job = self.results.get_nowait()
            except queue.Empty:
                break
            handle = job.handle
            if kind in ("failed", "committed"):
                with contextlib.suppress(ValueError):
                    self.pending.remove(handle)
            if kind == "failed":
                if logged:
                    logger.warning("a save of the previous round did not commit: %s", handle.error)
                first = first or handle.error
                continue
            callback = job.on_durable if kind == "durable" else job.on_commit
            if callback is None or handle.info is None:
                continue
            try:
                callback(handle.info)
            except Exception as exc:
                if not logged:
                    raise
                logger.warning("a callback of %s raised: %s", handle.path, exc)
        if first is not None and not logged:
            raise first
