"""The background half of :class:`~trainguard.checkpoint.AsyncCheckpointer`: what its thread
does with one save (stage it when overlapped, have the writer process write it, hand it to the
commit), as a base class of the checkpointer. The training thread's half is in
:mod:`.async_save`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time

import torch

from trainguard import events
from trainguard.checkpoint import _commit, _rebind
from trainguard.checkpoint._closing import Closing
from trainguard.checkpoint._saves import Job
from trainguard.checkpoint.format import tmpfile
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.writer import WriteJob, WriteResult, WriterProcess
from trainguard.errors import CheckpointWriteError, WriterDied

logger = logging.getLogger(__name__)

_SLICE = 0.25  # seconds between looks at a close() that gives up, while the writer works


class SaveWork(Closing):
    """The checkpointer's background thread's work (see the module docstring)."""

    rank: int
    world_size: int
    distributed: bool
    fsync: bool
    close_timeout: float
    _stager: Stager
    _writer: WriterProcess
    _giving_up: threading.Event
    _slot: _rebind.CommitterSlot
    _results: queue.SimpleQueue[tuple[str, Job]]

    @property
    def _committer(self) -> _commit.Committer | None:
        return self._slot.committer

    def _stage(self, job: Job) -> None:
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

    def _one(self, job: Job | _commit.Report) -> None:
        """The background thread's work on one item: stage (overlap), write, then hand over
        to commit."""
        if isinstance(job, _commit.Report):
            assert self._committer is not None
            self._committer.put(job)
            return
        try:
            if not job.handle.staged.is_set():
                self._stage(job)
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
            job.durable(result, rank=self.rank, world_size=self.world_size)
            self._results.put(("durable", job))
        if self._committer is not None:
            self._committer.put(self._report(job, error))
        else:
            self._finish(job, {} if error is None else {0: error})

    def _write(self, job: Job) -> WriteResult:
        if self._giving_up.is_set():
            raise CheckpointWriteError("close() gave up before this save was written")
        file = job.handle.file
        assert job.flat is not None
        os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
        if self.distributed:
            _commit.refuse_overwrite(job.handle.path)
        retired, job.retired = job.retired, None
        self._writer.prepare(job.buffer, retired=retired)
        meta = {"rank": str(self.rank), "world_size": str(self.world_size)}
        meta["skeleton"] = json.dumps(job.flat.skeleton, separators=(",", ":"))
        self._writer.submit(
            WriteJob(
                job_id=job.handle.seq,
                path=file,
                buffer_id=job.buffer.id,
                placed=job.placed,
                metadata=meta,
                format=job.format,
                skeleton=job.flat.skeleton if job.format == "torch" else None,
                fsync=self.fsync,
            )
        )
        try:
            result = self._result(file)
        except WriterDied:
            tmpfile.remove_leftovers(file)
            if self._giving_up.is_set():
                raise
            try:  # replace it now, so the next save does not wait for a start
                self._writer.start()
            except WriterDied as exc:
                logger.warning("restarting the checkpoint writer failed (%s); will retry", exc)
            raise
        assert result is not None and result.job_id == job.handle.seq
        return result

    def _result(self, file: str) -> WriteResult:
        """The writer's answer for ``file``; no bound while open (a write takes what the
        storage needs), but once close() gives up the writer is killed (WriterDied)."""
        while True:
            result = self._writer.result(timeout=_SLICE)
            if result is not None:
                return result
            if self._giving_up.is_set():
                self._writer.kill()
                raise WriterDied(
                    f"the checkpoint writer did not finish {file} within close_timeout="
                    f"{self.close_timeout:g} s and was killed"
                )

    def _report(self, job: Job, error: str | None) -> _commit.Report:
        def done(causes: dict[int, str]) -> None:
            self._finish(job, causes)

        path = job.handle.path
        return _commit.Report(job.commit_key, path, error, job.handle.file, job.format, done)

    def _finish(self, job: Job, causes: dict[int, str]) -> None:
        self._results.put((job.finish(causes, world_size=self.world_size), job))
        job.handle.finished.set()  # after the result is queued: wait() then poll() sees it
