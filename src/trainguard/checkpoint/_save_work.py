"""The background half of :class:`~trainguard.checkpoint.AsyncCheckpointer`: what its thread
does with one save (stage it when overlapped, have the writer process write it, hand it to the
commit). The checkpointer holds one :class:`SaveWorker` and queues ``(worker.one, job)`` for
its thread, which runs :func:`serve_holding`; the training thread's half is in
:mod:`.async_save`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from trainguard import events
from trainguard.checkpoint import _commit, _overwrite, _rebind
from trainguard.checkpoint._saves import Job
from trainguard.checkpoint._unchanged import UnchangedWatch
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.writer import WriteJob, WriteResult, WriterProcess
from trainguard.errors import CheckpointWriteError, WriterDied

logger = logging.getLogger(__name__)

_J = TypeVar("_J")


def serve_holding(jobs: queue.SimpleQueue[tuple[Callable[[_J], None], _J] | None]) -> None:
    """The loop of a checkpointer's worker thread: call ``handle(job)`` for each
    ``(handle, job)`` taken from ``jobs`` until ``None``. ``handle`` is a method of the
    checkpointer's :class:`SaveWorker` (or a plain function), never of the checkpointer, and
    between items the thread holds nothing: a checkpointer dropped without close() is
    collected, and its release (:func:`stop_serving`) lets the queued work finish first."""
    while True:
        item = jobs.get()
        if item is None:
            return
        handle, job = item
        del item
        handle(job)
        del handle, job


def stop_serving(
    jobs: queue.SimpleQueue[Any], thread: threading.Thread, then: Sequence[Callable[[], object]]
) -> None:
    """Stop a :func:`serve_holding` thread (after its queued work), then call each of ``then``:
    the release of a checkpointer collected without close()."""
    jobs.put(None)
    thread.join()
    for close in then:
        close()


class SaveWorker:
    """The checkpointer's background thread's work on each save (see the module docstring).

    It holds the checkpointer's parts it needs, never the checkpointer itself (a queued item
    refers to this worker only: a checkpointer dropped without ``close()`` is still collected).
    ``slot`` is the round the checkpointer is bound to (rank, world size, committer); it is
    changed only between rounds, while this worker's thread has nothing queued. Outcomes go to
    ``results`` as ``(kind, job)``; :meth:`give_up` makes a write still running fail (close()
    gave up on it).
    """

    def __init__(
        self,
        *,
        stager: Stager,
        writer: WriterProcess,
        slot: _rebind.RoundBinding,
        results: queue.SimpleQueue[tuple[str, Job]],
        fsync: bool,
        close_timeout: float,
        overwrite: bool = True,
    ) -> None:
        self._stager = stager
        self._writer = writer
        self._slot = slot
        self._results = results
        self._fsync = fsync
        self._overwrite = overwrite
        self._close_timeout = close_timeout
        self._giving_up = threading.Event()
        self._unchanged = UnchangedWatch()  # a save identical to the previous one is reported

    @property
    def _committer(self) -> _commit.Committer | None:
        return self._slot.committer

    def give_up(self) -> None:
        """close() gave up: kill a writer still at work; saves not yet written fail."""
        self._giving_up.set()

    def stage(self, job: Job) -> None:
        """Copy ``job``'s state into the staging buffer (the training thread calls it too)."""
        started = time.monotonic()
        if job.cuda_stream is not None:
            torch.cuda.current_stream().wait_stream(job.cuda_stream)  # see Stager.stage
        assert job.flat is not None
        job.nbytes = self._stager.stage(job.flat.entries, job.placed)
        job.staged_at = time.monotonic()
        job.handle.staged.set()
        events.emit(
            "ckpt_staged",
            duration=job.staged_at - started,
            bytes=job.nbytes,
            path=job.handle.path,
            since_request=job.staged_at - job.requested,
        )

    def one(self, job: Job | _commit.Report) -> None:
        """The background thread's work on one item: stage (overlap), write, then hand over
        to commit."""
        if isinstance(job, _commit.Report):
            assert self._committer is not None
            self._committer.put(job)
            return
        try:
            if not job.handle.staged.is_set():
                self.stage(job)
            result = self._write(job)
            error = None if result.ok else result.error
        except Exception as exc:  # staging error or writer death
            logger.warning("checkpoint %s failed: %s", job.handle.path, exc)
            result = WriteResult(job.handle.seq, False, error=str(exc))
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, WriterDied) else str(exc)
        finally:
            job.handle.staged.set()
            job.handle.written.set()
        if error is None:
            job.durable(result, rank=self._slot.rank, world_size=self._slot.world_size)
            self._unchanged.durable(job.handle.path, job.write_file or job.handle.file)
            self._results.put(("durable", job))
        if self._committer is not None:
            self._committer.put(self._report(job, error))
        else:
            self._finish(job, {} if error is None else {0: error})

    def _write(self, job: Job) -> WriteResult:
        if self._giving_up.is_set():
            raise CheckpointWriteError("close() gave up before this save was written")
        file = job.write_file or job.handle.file
        assert job.flat is not None
        os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
        if self._slot.distributed and not self._overwrite:
            _commit.refuse_overwrite(job.handle.path)
        retired, job.retired = job.retired, None
        self._writer.prepare(retired=retired)
        meta = {"rank": str(self._slot.rank), "world_size": str(self._slot.world_size)}
        committer = self._committer
        job.save_id = committer.save_id(job.commit_key) if committer else secrets.token_hex(8)
        meta["save_id"] = job.save_id
        meta["skeleton"] = json.dumps(job.flat.skeleton, separators=(",", ":"))
        write = WriteJob(
            job_id=job.handle.seq,
            path=file,
            buffer_id=job.buffer.id,
            placed=job.placed,
            metadata=meta,
            format=job.format,
            skeleton=job.flat.skeleton if job.format == "torch" else None,
            fsync=self._fsync,
        )
        try:  # no bound while open, but once close() gives up the writer is killed
            result = self._writer.write(write, job.buffer, give_up=self._gave_up)
        except WriterDied:
            if self._giving_up.is_set():
                raise
            try:  # replace it now, so the next save does not wait for a start
                self._writer.start()
            except WriterDied as exc:
                logger.warning("restarting the checkpoint writer failed (%s); will retry", exc)
            raise
        assert result.job_id == job.handle.seq
        return result

    def _gave_up(self) -> str | None:
        if not self._giving_up.is_set():
            return None
        return f"within close_timeout={self._close_timeout:g} s and was killed"

    def _report(self, job: Job, error: str | None) -> _commit.Report:
        def done(causes: dict[int, str]) -> None:
            self._finish(job, causes)

        path = job.handle.path
        if not job.write_file:
            return _commit.Report(
                job.commit_key,
                path,
                error,
                job.handle.file,
                job.format,
                done,
                save_id=job.save_id,
            )
        beside = os.path.dirname(job.write_file)

        def swap() -> None:
            _overwrite.finish(beside, path)

        return _commit.Report(
            job.commit_key,
            path,
            error,
            job.write_file,
            job.format,
            done,
            beside,
            swap,
            save_id=job.save_id,
        )

    def _finish(self, job: Job, causes: dict[int, str]) -> None:
        self._results.put((job.finish(causes, world_size=self._slot.world_size), job))
        job.handle.finished.set()  # after the result is queued: wait() then poll() sees it
