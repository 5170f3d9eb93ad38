"""The writer's fallback where no writer process can start: a daemonic process.

A daemonic process (a ``multiprocessing.Pool`` worker, the background process of DCP's
``AsyncCheckpointerType.PROCESS``, torch's ``MultiProcContinuousTest`` ranks) may not have
children, so :class:`~trainguard.checkpoint.writer.WriterProcess` cannot start there.
:class:`ThreadWriter` speaks the same interface and writes each job, exactly as the writer
process would (the same function, from the same staging buffer), in one thread of this process.
:func:`make_writer` picks one of the two.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import mmap
import multiprocessing
import os

from trainguard.checkpoint import writer as _writer
from trainguard.checkpoint._writing import WriteJob, WriteResult, Writing
from trainguard.checkpoint.writer import WriterProcess

__all__ = ["ThreadWriter", "make_writer"]

logger = logging.getLogger(__name__)


def make_writer(*, nice: int, start_timeout: float) -> WriterProcess | ThreadWriter:
    """A writer process, or a :class:`ThreadWriter` in a daemonic process."""
    if multiprocessing.current_process().daemon:
        logger.info("daemonic process: checkpoint files are written from a thread instead")
        return ThreadWriter()
    return WriterProcess(nice=nice, start_timeout=start_timeout)


class ThreadWriter(Writing):
    """Writes jobs in one thread of this process; the interface of :class:`WriterProcess`."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._hasher: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[WriteResult] | None = None

    @property
    def pid(self) -> int | None:
        return os.getpid() if self._pool is not None else None

    def alive(self) -> bool:
        return self._pool is not None

    def start(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "trainguard-writer")
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, "trainguard-hash")

    def attach(self, buffer_id: int, fd: int, nbytes: int) -> None:
        self._maps[buffer_id] = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)

    def is_attached(self, buffer_id: int) -> bool:
        return buffer_id in self._maps

    def detach(self, buffer_id: int) -> None:
        mm = self._maps.pop(buffer_id, None)
        if mm is not None:
            with contextlib.suppress(BufferError):
                mm.close()

    def submit(self, job: WriteJob) -> None:
        assert self._pool is not None
        self._pending = self._pool.submit(_writer._run_job, job, self._maps, self._hasher)

    def result(self, timeout: float | None = None) -> WriteResult | None:
        """The submitted job's result; None after ``timeout``."""
        assert self._pending is not None
        try:
            result = self._pending.result(timeout)
        except concurrent.futures.TimeoutError:
            return None
        self._pending = None
        return result

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the job at hand, stop the thread, unmap the buffers."""
        for pool in (self._pool, self._hasher):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._hasher = None
        for buffer_id in list(self._maps):
            self.detach(buffer_id)

    def kill(self) -> None:
        self.stop()
