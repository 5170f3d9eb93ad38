"""LocalCheckpointManager: checkpoints on node-local storage, replicated to peers.

Every rank saves its *part* (its state) under a local root (typically ``/dev/shm`` or a local
NVMe) and keeps copies of the parts of its clique's members (see :mod:`.replication`), so that
the loss of a node loses no part. See :class:`LocalCheckpointManager` for the protocol.

Over 400 lines: one class, the user's half of the protocol (build, save, wait, find_latest,
load, restore from memory, close), each method with the docstring that states its contract.
The work behind it lives beside it: saving and replication in :mod:`._pipeline`, loading in
:mod:`._loading`, the round's resources in :mod:`._resources`, the settings in :mod:`.options`,
failure reports in :mod:`trainguard.checkpoint._onerror`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainguard import _progress, _settings, _timeouts, events
from trainguard.checkpoint import _link, _onerror
from trainguard.checkpoint._closing import Closing
from trainguard.checkpoint.format.layout import flatten
from trainguard.checkpoint.format.write import check_header_fits, place
from trainguard.checkpoint.local import (
    _inventory,
    _part_load,
    _reshard_load,
    _root,
    _transfer,
)
from trainguard.checkpoint.local._binding import RoundGather, dist_ranks, placement
from trainguard.checkpoint.local._loading import Loader
from trainguard.checkpoint.local._pipeline import Place, SavePipeline, StagedSave
from trainguard.checkpoint.local._remembered import Remembered
from trainguard.checkpoint.local._resources import Resources, abandoned
from trainguard.checkpoint.local._spare import SparePrefetch
from trainguard.checkpoint.local.options import LocalOptions
from trainguard.checkpoint.local.replication import CliqueReplication, no_replication
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.writer import WriterProcess
from trainguard.errors import (
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    WriterDied,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["LocalCheckpointManager"]

logger = logging.getLogger(__name__)


class LocalCheckpointManager(Closing):
    """Checkpoints on each rank's local storage, with copies on the other members of its clique.

    Every rank of the job calls every method together, in the same order: the constructor,
    :meth:`find_latest`, :meth:`load`, :meth:`save` (same iterations in the same order),
    :meth:`wait` and :meth:`close`. ::

        mgr = LocalCheckpointManager(f"/dev/shm/ckpt-{os.getuid()}", replication=CliqueReplication(2), keep=2)
        it = mgr.find_latest()          # newest iteration every rank can recover, or None
        if it is not None:
            state = mgr.load(it)        # this rank's part, wherever a good copy is
        ...
        mgr.save(state, iteration)      # returns once the state is copied to host memory
        mgr.close()

    - ``save`` copies the state into a reusable shared-memory buffer and returns; in the
      background the writer process writes this rank's part while the part is sent, as one
      message, to the other clique members, which write it too. :meth:`wait` blocks until the
      iteration is durable with all its copies on every rank.
    - Parts are named by iteration and *owner* (this rank's number at save time). After a
      restart that renumbered the ranks, rank ``r`` loads owner ``r``'s part.
    - Retention: once an iteration is complete on every rank, complete iterations beyond the
      newest ``keep`` are removed (and incomplete ones older than those); an incomplete newer
      iteration never causes a complete older one to be removed. Whether an iteration is
      complete is decided once for every rank (:mod:`trainguard.coord.commit`), so every rank
      keeps the same iterations. Loading an older iteration never removes a newer complete
      one (see :mod:`._newer`); :meth:`discard_newer` rolls back explicitly.

    - Build it once per process and use it in every restart round: before each operation it
      re-binds to a new round by itself (see :meth:`bind`), keeping its writer process,
      buffers and files. :meth:`load` restores from the staging buffer when it still holds
      this rank's part of the iteration (after an exception or a hang), reading no file.
    - A spare (built with ``spare_roots``, before torch.distributed is initialized) copies the
      newest complete iteration found under those roots into its root while it waits (see
      :mod:`._spare`), so that taking over a rank needs no transfer.
    - The root is created with mode 0700 (parts are written 0600); a root owned by another
      user, writable by group or others, or that is not a directory raises
      :class:`ConfigError` here (see :mod:`._root`).

    Args:
        root: this rank's local directory (ranks of one node may share it).
        store: the torch.distributed Store (default: the default process group's).
        replication, keep, backend, timeout, staging_threads, pin_memory, fsync, writer_nice,
            allow_replication_change, key_prefix, spare_roots, spare_interval: the settings,
            as :class:`~.options.LocalOptions` describes them (one field each); timeouts in
            seconds or as a ``timedelta``.
        options: those settings as one :class:`~.options.LocalOptions` instead of as
            keywords; :attr:`options` holds them either way.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        replication: CliqueReplication | None = None,
        keep: int = 2,
        store: Store | None = None,
        backend: str | None = None,
        timeout: _timeouts.Timeout = 300.0,
        staging_threads: int | None = None,
        pin_memory: bool = True,
        fsync: bool = True,
        writer_nice: int = 10,
        allow_replication_change: bool = False,
        key_prefix: str = "trainguard/local",
        spare_roots: Sequence[str | os.PathLike[str]] | None = None,
        spare_interval: _timeouts.Timeout = 1.0,
        on_error: str = "report",
        options: LocalOptions | None = None,
    ) -> None:
        built = LocalOptions(
            replication=replication,
            keep=keep,
            backend=backend,
            timeout=timeout,
            staging_threads=staging_threads,
            pin_memory=pin_memory,
            fsync=fsync,
            writer_nice=writer_nice,
            allow_replication_change=allow_replication_change,
            key_prefix=key_prefix,
            spare_roots=spare_roots,
            spare_interval=spare_interval,
            on_error=on_error,
        )
        #: The settings, checked (built from the keywords unless given as ``options``).
        self.options = opts = _settings.chosen(options, built, "LocalCheckpointManager")
        self._failures = _onerror.FailurePolicy(opts.on_error, "LocalCheckpointManager")
        started = time.monotonic()
        self.timeout = opts.timeout
        _link.resolve(store, *dist_ranks())  # bad arguments fail here, before anything starts
        self.replication = opts.replication or no_replication()
        self.setting = self.replication.describe()
        self.root = os.path.abspath(os.fspath(root))
        self.keep = opts.keep
        self.fsync = opts.fsync
        self.allow_replication_change = opts.allow_replication_change
        self._backend = opts.backend or "gloo"
        self._key_prefix = opts.key_prefix
        _root.prepare_root(self.root)
        self._inventory = _inventory.Inventory(self.root)
        self._closed = False
        #: After :meth:`load`: ``{"iteration", "source", "bytes"}``; ``source`` is ``"memory"``,
        #: ``"local PATH"`` or ``"rank N"`` (the peer that sent it); with ``into``: ``"local"``,
        #: ``"ranks 1, 3"`` or ``"local + ranks 3"``, and ``bytes_local``, ``bytes_received``,
        #: ``chunks`` and ``parts``.
        self.last_load: dict[str, Any] | None = None
        self._remembered: Remembered | None = None  # what the staging buffer holds
        threads = opts.staging_threads or min(4, os.cpu_count() or 1)
        stager = Stager(threads=threads, pin=opts.pin_memory)
        self._res = Resources(WriterProcess(nice=opts.writer_nice), stager)
        self._writer, self._stager = self._res.writer, stager
        try:
            self._writer.start()
            self._bind(store, explicit=store is not None, started=started)
        except BaseException as exc:
            self._res.free(pipeline_closed=False)
            if isinstance(exc, WriterDied):
                raise CheckpointWriteError(str(exc)) from exc
            raise
        if opts.spare_roots and self._watch.unbound:
            roots = [os.path.abspath(r) for r in opts.spare_roots]
            interval = opts.spare_interval
            self._res.prefetch = SparePrefetch(self.root, roots, interval, self._inventory)
        self._release_when_collected(abandoned, self._res)

    def _bind(self, store: Store | None, *, explicit: bool, started: float) -> None:
        """Bind to this round: store, rank, world size, replication group, pipeline.

        The round is noted last: an interrupt landing in here leaves the manager to bind again
        at its next operation."""
        watch = _link.RoundWatch(_link.default_group(), explicit=explicit)
        store, self.rank, self.world_size = _link.resolve(store, *dist_ranks())
        if self.world_size > 1 and store is None:
            raise ConfigError("several ranks need a store; initialize torch.distributed first")
        link = None
        if store is not None and self.world_size > 1:
            link = _link.StoreLink.join(
                store, key_prefix=self._key_prefix, world_size=self.world_size
            )
        # for gathers, and the pipeline's waits in this thread: the default group's store (torch
        # uses it from this thread too; connected already), or a client of a store given
        caller = None if link is None else link.client() if explicit else link.origin
        where = (self.replication, link, caller, self.rank, self.world_size, self.timeout)
        # this round's host of each rank, this rank's clique; the replication group is built on
        # first need (a save that replicates, a transfer)
        self.hosts, self.clique, self._replicates = placement(*where, watch)
        # per round: a rank interrupted before a save the others made is not behind for good
        self._seq = 0
        place = Place(
            self.rank, self.world_size, self.root, self.setting, self.clique, self.keep, self.fsync
        )
        self._pipeline = self._res.pipeline = SavePipeline(
            place,
            writer=self._writer,
            inventory=self._inventory,
            channel=None,
            link=link,
            caller_store=caller,
            recv_buffers=self._res.recv_buffers,
        )
        self._loader = Loader(
            rank=self.rank,
            world_size=self.world_size,
            root=self.root,
            setting=self.setting,
            allow_replication_change=self.allow_replication_change,
            inventory=self._inventory,
            gather=RoundGather(
                link, caller, rank=self.rank, world_size=self.world_size, timeout=self.timeout
            ),
            channel_for=functools.partial(
                self._res.channel_for, backend=self._backend, timeout=self.timeout
            ),
            pipeline=self._pipeline,
            restore=self._res.restore,
        )
        self._watch = watch
        _link.setup_done("local", started, self.rank, self.world_size)

    def bind(self, store: Store | None = None) -> None:
        """Re-bind this manager to a new round; every rank calls it together (it builds the
        round's replication group, a collective over the default group).

        Not needed with torch.distributed: before each operation the manager checks whether
        the default process group changed (a restart round initialized it again) and re-binds
        by itself. Call it when the manager was given a ``store``: pass the new round's (None:
        the default group's). Waits for the previous round's background work (after a fault it
        fails at once) and logs its errors, then takes the new round's store, rank and world
        size. Writer process, buffers (what a restore from memory needs) and files are kept.
        """
        self._check_open()
        started = time.monotonic()
        self._res.stop_prefetch()
        self._res.end_round()
        self._bind(store, explicit=store is not None, started=started)

    def _ensure_bound(self) -> None:
        """Re-bind first when a new round began (see :meth:`bind`); a spare's prefetch ends."""
        self._check_open()
        self._res.stop_prefetch()
        if self._watch.changed():
            self.bind()

    # ------------------------------------------------------------------ API

    def save(self, state: Any, iteration: int, *, pickle: bool = False) -> None:
        """Snapshot ``state`` as this rank's part of ``iteration``. All ranks call it together.

        Returns once the state is copied into host memory (the state may change right after);
        writing and replication run in the background. Waits first for the previous save's
        background work (the buffers are reused). Raises the error of an earlier failed save.
        """
        self._ensure_bound()
        _inventory.check_iteration(iteration)
        requested = time.monotonic()
        self._pipeline.drain()
        try:
            self._pipeline.raise_errors()
        except CheckpointWriteError as exc:
            self._failures.handle(exc)
        self._loader.before_save(iteration)
        flat = flatten(state, pickle=pickle)
        placed, nbytes = place(flat.entries)
        check_header_fits(placed, flat.skeleton)  # what a reader would refuse
        self._remembered = None  # the buffer is about to change (an interrupt may land midway)
        buffer, retired = self._stager.ensure(nbytes)
        self._stager.stage(flat.entries, placed)
        job = StagedSave(
            self._seq, iteration, flat.skeleton, placed, nbytes, buffer, retired, requested
        )
        self._seq += 1
        self._group(self._replicates)
        self._pipeline.submit(job)
        self._remembered = Remembered(iteration, self.rank, job)
        _progress.mark()
        events.emit(
            "local_ckpt_save",
            duration=time.monotonic() - requested,
            bytes=nbytes,
            iteration=iteration,
            root=self.root,
        )

    def wait(self, timeout: _timeouts.Timeout | None = None) -> None:
        """Block until the last saved iteration is durable with every copy on every rank.

        Then applies retention. A failure (the ranks whose part or copies failed, or that did
        not finish within ``timeout``, default: the manager's) is a :class:`CheckpointWriteError`
        that ``on_error`` reports (the default) or raises. Every rank calls it (it reads the
        store only).
        """
        limit = _timeouts.optional_seconds("timeout", timeout)
        self._ensure_bound()
        try:
            self._pipeline.wait(self.timeout if limit is None else limit)
        except CheckpointWriteError as exc:
            self._failures.handle(exc)

    @property
    def failures(self) -> list[CheckpointError]:
        """The background failures reported so far (``on_error="report"``), oldest first."""
        return list(self._failures.failures)

    def find_latest(self) -> int | None:
        """The newest iteration every owner's part of which a live rank holds, verified.

        Collective through the store: every rank reports the parts it holds and has verified;
        all compute the same answer. None when no iteration is recoverable (then nothing is
        removed: missing parts might still be brought back by hand). Newer iterations whose save
        never finished are removed, so that a later save of the same number meets no stale
        copy; newer ones that a read error hides are kept (see :meth:`discard_newer`;
        ``load`` does the same for the iteration it loads). Raises :class:`CheckpointReplicationMismatchError` when that iteration was
        saved with another replication setting (unless ``allow_replication_change``). Each
        rank also reports the iteration it could restore from memory (see :class:`MemoryRound`).
        """
        self._ensure_bound()
        started = time.monotonic()
        self._pipeline.drain()
        return self._loader.find_latest(self._remembered, self._seq, started)

    def load(self, iteration: int, *, into: Any = None, allow_pickle: bool = False) -> Any:
        """This rank's part of ``iteration`` (owner = this rank's number). All ranks call it.

        With ``into`` (a target state of this world, e.g. from ``get_state_dict``; its DTensors
        may be sharded over fewer or more ranks than at save): fills it in place and returns
        it; each rank reads only the chunks overlapping its target, from its own copies or
        received from holders (see :mod:`._reshard_load`). Without ``into``, a part holding
        sharded tensors raises :class:`CheckpointError`.

        Each rank hashes its own part again (while the transfers run; copies changed since
        they were last verified are hashed before anything is reported); a rank without a good
        copy of its part receives it from a holder (every rank computes the same plan). When some
        part has no good copy anywhere, the newest older complete iteration is loaded instead,
        with a warning saying why; :class:`CheckpointNotFoundError` when none is. Returns None
        on a rank whose number did not exist in the world that saved (the world grew).
        Tensors are views of a private memory map (or of the received bytes).
        :attr:`last_load` says which copy was used.
        """
        self._ensure_bound()
        started = time.monotonic()
        self._pipeline.drain()
        loader = self._loader
        if into is not None:
            state = _reshard_load.load_into(
                loader, iteration, into, allow_pickle=allow_pickle, started=started
            )
        else:
            state = _part_load.load_part(
                loader,
                iteration,
                remembered=self._remembered,
                seq=self._seq,
                allow_pickle=allow_pickle,
                started=started,
            )
        if loader.last_load is not None:
            self.last_load = loader.last_load
        return state

    def discard_newer(self, iteration: int) -> list[int]:
        """Remove every iteration newer than ``iteration``, complete ones included: roll back.

        A load of an older iteration (asked for, or a fallback because a newer one did not
        read) never removes a newer complete iteration, so ``find_latest`` would return it
        again; call this (every rank together, with the same ``iteration``) after such a load
        to resume from ``iteration`` for good. Returns the iterations removed from this rank's
        root.
        """
        self._ensure_bound()
        _inventory.check_iteration(iteration)
        self._pipeline.drain()
        return self._loader.discard_newer(iteration)

    def close(self) -> None:
        """Finish pending saves, stop the writer and the thread, free buffers and the group.

        The error of a failed pending save is reported or raised (``on_error``) after
        everything is freed. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._closed_explicitly()
        self._res.stop_prefetch()
        pipeline = self._pipeline
        pipeline.close()
        self._res.free(pipeline_closed=True)
        self._remembered = None
        try:
            pipeline.raise_errors()
        except CheckpointWriteError as exc:
            self._failures.handle(exc)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this LocalCheckpointManager is closed; create a new one")

    def _group(self, needed: bool) -> _transfer.Channel | None:
        """This round's replication group, built when first ``needed`` (every rank alike)."""
        return self._res.channel_for(needed, self._backend, self.timeout)
