"""What a :class:`~.manager.LocalCheckpointManager` keeps across restart rounds, and what it
builds again for each round.

Kept for the life of the manager: the writer process, the staging buffer, the receive buffers
for peers' copies, the inventory of the root (which files are verified), and the prefetch thread
of a spare. Built for each round (each default process group it is bound to): the store link,
the replication group (:class:`~._transfer.Channel`) and the :class:`~._pipeline.SavePipeline`
that uses them. :meth:`Resources.end_round` takes a round's part down; :meth:`Resources.free`
everything.
"""

from __future__ import annotations

import dataclasses
import logging

from trainguard._errtext import brief
from trainguard.checkpoint.local._pipeline import SavePipeline
from trainguard.checkpoint.local._remembered import RestoreBuffer
from trainguard.checkpoint.local._spare import SparePrefetch
from trainguard.checkpoint.local._transfer import Channel
from trainguard.checkpoint.staging import Stager, StagingBuffer
from trainguard.checkpoint.writer import WriterProcess
from trainguard.errors import CheckpointWriteError

__all__ = ["Resources", "abandoned"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Resources:
    """A manager's processes, threads, buffers and group (never the manager itself, so that
    one dropped without close() is still collected and released)."""

    writer: WriterProcess
    stager: Stager
    recv_buffers: dict[int, StagingBuffer] = dataclasses.field(default_factory=dict)
    pipeline: SavePipeline | None = None
    channel: Channel | None = None
    prefetch: SparePrefetch | None = None
    restore: RestoreBuffer = dataclasses.field(default_factory=RestoreBuffer)

    def channel_for(self, needed: bool, backend: str, timeout: float) -> Channel | None:
        """The round's replication group, built on first need (``new_group``, a collective
        over the default group: every rank must call it alike) and given to the pipeline."""
        if needed and self.channel is None:
            self.channel = Channel(backend, timeout)
            if self.pipeline is not None:
                self.pipeline.use_channel(self.channel)
        return self.channel

    def stop_prefetch(self) -> None:
        if self.prefetch is not None:
            self.prefetch.stop()
            self.prefetch = None

    def end_round(self) -> None:
        """Finish the round's queued saves (after a fault they fail at once: the wrapper shut
        the round's connections down), log their errors, free the round's group.

        The ended round's outcomes are not read from its store and retention waits for the next
        save: the next round decides what is complete (``find_latest``), and this runs on the
        way to its first step. The pipeline and group stay referenced until they are closed: a
        restart interrupt landing here (a hang detected while the thread finishes a save) leaves
        them for the next call to close, so that a new pipeline never runs beside the old
        thread (two threads reading one writer's answers would take each other's)."""
        pipeline = self.pipeline
        if pipeline is not None:
            pipeline.close(settle=False)
            self.pipeline = None
            try:
                pipeline.raise_errors()
            except CheckpointWriteError as exc:
                # a save the fault cut (warned as it failed if its round was still on)
                logger.info("a save of the previous round did not complete: %s", brief(str(exc)))
                logger.debug("in full: %s", exc)
            pipeline.release(buffers=False)
        channel = self.channel
        if channel is not None:
            channel.close()
            self.channel = None

    def free(self, *, pipeline_closed: bool) -> None:
        """Stop the writer and the threads, free the buffers and the group. ``pipeline_closed``:
        the caller closed the pipeline already (to raise its errors)."""
        self.stop_prefetch()
        if self.pipeline is not None and not pipeline_closed:
            self.pipeline.close()
        self.writer.stop()
        self.stager.close()
        if self.pipeline is not None:
            self.pipeline.release()
        for buffer in self.recv_buffers.values():
            buffer.close()
        self.recv_buffers.clear()
        self.restore.close()
        if self.channel is not None:
            self.channel.close()
        self.pipeline = self.channel = None


def abandoned(resources: Resources) -> None:
    """What a manager garbage-collected without close() runs (see Closing): close() without
    raising the errors of its saves."""
    resources.free(pipeline_closed=False)
