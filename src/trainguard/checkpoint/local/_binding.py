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
import threading
from typing import TYPE_CHECKING, Any

import torch

from trainguard.checkpoint._link import RoundWatch, StoreLink
from trainguard.checkpoint.local._pipeline import SavePipeline
from trainguard.checkpoint.local._remembered import RestoreBuffer
from trainguard.checkpoint.local._spare import SparePrefetch
from trainguard.checkpoint.local._transfer import Channel
from trainguard.checkpoint.local.replication import CliqueReplication, this_host
from trainguard.checkpoint.staging import Stager, StagingBuffer
from trainguard.checkpoint.writer import WriterProcess
from trainguard.coord import gather
from trainguard.errors import CheckpointWriteError, ConfigError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

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
                logger.warning("a save of the previous round did not complete: %s", exc)
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


class Background:
    """Run ``fn(*args)`` in a thread; :meth:`result` returns the exception it raised, or None."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:
                self._error = exc

        self._thread = threading.Thread(target=run, name="trainguard-verify", daemon=True)
        self._thread.start()

    def result(self) -> BaseException | None:
        self._thread.join()
        return self._error


def check_arguments(
    replication: object, keep: object, backend: object, threads: int | None, nice: int
) -> None:
    """Raise :class:`ConfigError` for a constructor argument that cannot work."""
    if replication is not None and not isinstance(replication, CliqueReplication):
        raise ConfigError("replication must be a CliqueReplication(factor, jump) or None")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep={keep!r}: keep at least 1 complete iteration")
    if backend not in (None, "gloo", "nccl"):
        raise ConfigError(f"backend={backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend='nccl' needs CUDA; use backend='gloo'")
    if threads is not None and threads < 1:
        raise ConfigError("staging_threads must be >= 1 (or None for the default)")
    if not 0 <= nice <= 19:
        raise ConfigError("writer_nice must be between 0 and 19")


def check_iteration(iteration: object, largest: int) -> None:
    """Raise :class:`ConfigError` for an iteration number that ``save`` cannot store."""
    if (
        isinstance(iteration, bool)
        or not isinstance(iteration, int)
        or not 0 <= iteration <= largest
    ):
        raise ConfigError(
            f"iteration={iteration!r}: use an integer from 0 to 2**63 - 1 ({largest}); a larger "
            "count can be scaled down or kept in the state"
        )


def round_hosts(
    replication: CliqueReplication,
    link: StoreLink | None,
    store: Store | None,
    rank: int,
    world_size: int,
    timeout: float,
) -> list[str] | None:
    """Each rank's host in this round, when ``replication`` places copies by host: a gather
    of :func:`~.replication.this_host` through the store (every rank binds together), once per
    round. None for placement by rank arithmetic."""
    if not replication.by_host:
        return None
    if link is None or store is None:
        return [this_host()] * world_size  # one rank (world_size is 1)
    got = gather(
        store,
        f"{link.prefix}/hosts",
        this_host(),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        what="host names",
        hint="every rank must build (or bind) its LocalCheckpointManager together",
    )
    return [str(got[r]) for r in range(world_size)]


def clique_of(
    replication: CliqueReplication,
    rank: int,
    world_size: int,
    watch: RoundWatch,
    hosts: list[str] | None,
) -> list[int]:
    """``rank``'s clique in a world of ``world_size`` (``hosts``: each rank's, when placing by
    host); warns when it is short of members (unless not bound yet: built before
    torch.distributed, it binds to the real world later)."""
    clique = replication.clique_of(rank, world_size, hosts)
    if len(clique) < replication.factor and not watch.unbound:
        logger.warning(
            "rank %d's clique %s has %d member(s) for factor %d (world size %d, %s): its parts "
            "have fewer copies",
            rank,
            clique,
            len(clique),
            replication.factor,
            world_size,
            "by rank arithmetic" if hosts is None else f"{len(set(hosts))} host(s)",
        )
    return clique


def dist_ranks() -> tuple[int, int]:
    """This rank and the world size from torch.distributed (0 and 1 when not initialized)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def placement(
    replication: CliqueReplication,
    link: StoreLink | None,
    store: Store | None,
    rank: int,
    world_size: int,
    timeout: float,
    watch: RoundWatch,
) -> tuple[list[str] | None, list[int], bool]:
    """Where this round's copies go, for every rank together when binding: each rank's host
    (:func:`round_hosts`), ``rank``'s clique (:func:`clique_of`) and whether any part is copied
    at all (never without a link to the other ranks)."""
    hosts = round_hosts(replication, link, store, rank, world_size, timeout)
    clique = clique_of(replication, rank, world_size, watch, hosts)
    return hosts, clique, link is not None and replication.replicates(world_size, hosts)
