"""What a checkpointer hands a writer (:class:`WriteJob`), what comes back (:class:`WriteResult`),
and :class:`Writing`: the one job loop of both writers, the writer process
(:class:`~trainguard.checkpoint.writer.WriterProcess`) and its thread fallback
(:class:`~trainguard.checkpoint._thread_writer.ThreadWriter`).

One wait policy for every caller (the asynchronous checkpointer, the DCP storage writer, the
local pipeline): a wait has no bound of its own while the caller waits (a write takes what the
storage needs) and ends, the writer killed, once the caller's ``give_up`` gives a reason; a
:class:`~trainguard.errors.WriterDied` out of it has removed the partial file, and the next
:meth:`Writing.prepare` starts a new writer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from trainguard.checkpoint.format import tmpfile
from trainguard.checkpoint.format.write import PlacedEntry
from trainguard.errors import WriterDied

logger = logging.getLogger(__name__)

_SLICE = 0.25  # seconds between two looks at a caller's give_up while the writer works


@dataclasses.dataclass(frozen=True)
class WriteJob:
    """One file to write from a staging buffer (``buffer_id``) whose bytes are the data section.

    ``format`` is ``"trainguard"`` (see :mod:`trainguard.checkpoint.format`) or ``"torch"``
    (``torch.save`` of the state rebuilt from ``skeleton``; needs torch in the writer).
    """

    job_id: int
    path: str
    buffer_id: int
    placed: Sequence[PlacedEntry]
    metadata: dict[str, str]
    format: str = "trainguard"
    skeleton: Any = None
    fsync: bool = True


@dataclasses.dataclass(frozen=True)
class WriteResult:
    job_id: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    errno: int | None = None


class Writing:
    """The job loop both writers share (see the module docstring), over the primitives each
    defines (``start``, ``alive``, ``kill``, ``attach``, ``submit``, ``result``, ...). Used
    from one thread at a time (the checkpointer's background thread)."""

    @property
    def pid(self) -> int | None:
        raise NotImplementedError

    def alive(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def attach(self, buffer_id: int, fd: int, nbytes: int) -> None:
        raise NotImplementedError

    def is_attached(self, buffer_id: int) -> bool:
        raise NotImplementedError

    def detach(self, buffer_id: int) -> None:
        raise NotImplementedError

    def submit(self, job: WriteJob) -> None:
        raise NotImplementedError

    def result(self, timeout: float | None = None) -> WriteResult | None:
        raise NotImplementedError

    def prepare(self, buffer: Any = None, *, retired: Any = None) -> None:
        """Get ready for the next job: release ``retired`` (a StagingBuffer that a larger one
        replaced; closed here), start a new writer if the last one died, and attach ``buffer``
        (a StagingBuffer) if it is not attached yet."""
        if retired is not None:  # the writer is done with it: unmap on both sides
            self.detach(retired.id)
            retired.close()
        if not self.alive():
            if self.pid is not None:
                self.kill()
            logger.info("starting a new checkpoint writer process")
            self.start()
        if buffer is not None and not self.is_attached(buffer.id):
            self.attach(buffer.id, buffer.fd, buffer.nbytes)

    def send(self, job: WriteJob, buffer: Any = None) -> None:
        """Submit ``job``, attaching ``buffer`` (the StagingBuffer ``job.buffer_id`` names)
        first if the writer has not mapped it yet. Its answer comes from :meth:`wait`."""
        if buffer is not None and not self.is_attached(buffer.id):
            self.attach(buffer.id, buffer.fd, buffer.nbytes)
        self.submit(job)

    def wait(self, path: str, *, give_up: Callable[[], str | None] | None = None) -> WriteResult:
        """The answer to the oldest job sent and not yet answered (its file is ``path``).

        No bound of its own: a write takes what the storage needs. ``give_up`` is asked every
        few tenths of a second; once it returns a reason, the writer is killed and this raises
        :class:`WriterDied` with that reason. Whenever :class:`WriterDied` leaves here (the
        writer died, or was killed), the partial file of ``path`` has been removed."""
        try:
            while True:
                result = self.result(timeout=None if give_up is None else _SLICE)
                if result is not None:
                    return result
                why = None if give_up is None else give_up()
                if why is not None:
                    self.kill()
                    raise WriterDied(f"the checkpoint writer did not finish {path} {why}")
        except WriterDied:
            tmpfile.remove_leftovers(path)
            raise

    def write(
        self, job: WriteJob, buffer: Any = None, *, give_up: Callable[[], str | None] | None = None
    ) -> WriteResult:
        """:meth:`send` ``job``, then :meth:`wait` for its answer (see both)."""
        self.send(job, buffer)
        return self.wait(job.path, give_up=give_up)
