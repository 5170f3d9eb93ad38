"""LocalCheckpointManager: checkpoints on node-local storage, replicated to peers.

Every rank saves its *part* (its state) under a local root (typically ``/dev/shm`` or a local
NVMe) and keeps copies of the parts of its clique's members (see :mod:`.replication`), so that
the loss of a node loses no part. See :class:`LocalCheckpointManager` for the protocol.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from trainguard import events
from trainguard.checkpoint.fileformat import load_buffer, load_file, place, verify_path
from trainguard.checkpoint.layout import flatten
from trainguard.checkpoint.local import _inventory
from trainguard.checkpoint.local._exchange import allgather
from trainguard.checkpoint.local._pipeline import SavePipeline, StagedSave
from trainguard.checkpoint.local._transfer import Channel
from trainguard.checkpoint.local.replication import CliqueReplication, no_replication
from trainguard.checkpoint.staging import Stager, StagingBuffer
from trainguard.checkpoint.writer import WriterDied, WriterProcess
from trainguard.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReplicationMismatchError,
    CheckpointWriteError,
    ConfigError,
)

__all__ = ["LocalCheckpointManager"]

logger = logging.getLogger(__name__)

_ATTEMPTS = 3  # loads in a row whose received copies fail their checksums before giving up


def _seconds(value: float | timedelta, name: str) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0:
        raise ConfigError(f"{name} must be positive seconds (or a timedelta), not {value!r}")
    return seconds


class LocalCheckpointManager(SavePipeline):
    """Checkpoints on each rank's local storage, with copies on the other members of its clique.

    Every rank of the job calls every method together, in the same order: the constructor,
    :meth:`find_latest`, :meth:`load`, :meth:`save` (same iterations in the same order),
    :meth:`wait` and :meth:`close`. ::

        mgr = LocalCheckpointManager("/dev/shm/ckpt", replication=CliqueReplication(2), keep=2)
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
      iteration never causes a complete older one to be removed.

    Args:
        root: this rank's local directory (ranks of one node may share it).
        replication: a :class:`CliqueReplication`, or None for one copy per part.
        keep: complete iterations to keep (>= 1).
        store: the torch.distributed Store (default: the default process group's).
        backend: transport for copies: ``"gloo"`` (default) or ``"nccl"``; a dedicated group.
        timeout: seconds (or a timedelta) a rank waits for the others (store and transfers).
        staging_threads, pin_memory, fsync, writer_nice: as for ``AsyncCheckpointer``.
        allow_replication_change: load iterations saved with another replication setting
            instead of raising :class:`CheckpointReplicationMismatchError`.
        key_prefix: prefix of this manager's store keys.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        replication: CliqueReplication | None = None,
        keep: int = 2,
        store: Any = None,
        backend: str | None = None,
        timeout: float | timedelta = 300.0,
        staging_threads: int | None = None,
        pin_memory: bool = True,
        fsync: bool = True,
        writer_nice: int = 10,
        allow_replication_change: bool = False,
        key_prefix: str = "trainguard/local",
    ) -> None:
        if replication is not None and not isinstance(replication, CliqueReplication):
            raise ConfigError("replication must be a CliqueReplication(factor, jump) or None")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep={keep!r}: keep at least 1 complete iteration")
        if backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"backend={backend!r}; use 'gloo' (CPU) or 'nccl' (GPU)")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("backend='nccl' needs CUDA; use backend='gloo'")
        if staging_threads is not None and staging_threads < 1:
            raise ConfigError("staging_threads must be >= 1 (or None for the default)")
        if not 0 <= writer_nice <= 19:
            raise ConfigError("writer_nice must be between 0 and 19")
        self.timeout = _seconds(timeout, "timeout")
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world_size = dist.get_world_size() if initialized else 1
        if store is None and initialized:
            store = dist.distributed_c10d._get_default_store()
        if self.world_size > 1 and store is None:
            raise ConfigError("several ranks need a store; initialize torch.distributed first")
        self.replication = replication or no_replication()
        self.setting = self.replication.describe()
        self.clique = self.replication.clique_of(self.rank, self.world_size)
        if len(self.clique) < self.replication.factor:
            logger.warning(
                "rank %d's clique %s has %d member(s) for factor %d (world size %d): its parts "
                "have fewer copies",
                self.rank,
                self.clique,
                len(self.clique),
                self.replication.factor,
                self.world_size,
            )
        self.root = os.path.abspath(os.fspath(root))
        self.keep = keep
        self.fsync = fsync
        self.allow_replication_change = allow_replication_change
        os.makedirs(self.root, exist_ok=True)
        self._inventory = _inventory.Inventory(self.root)
        self._closed = False
        #: After :meth:`load`: ``{"iteration", "source", "bytes"}``, where ``source`` is
        #: ``"local PATH"`` or ``"rank N"`` (the peer that sent this rank's part).
        self.last_load: dict[str, Any] | None = None
        self._store = self._bg_store = None
        self._key = key_prefix
        if store is not None and self.world_size > 1:
            generation = (store.add(f"{key_prefix}/instances", 1) - 1) // self.world_size
            self._key = f"{key_prefix}/{generation}"
            self._store = store.clone() if hasattr(store, "clone") else store
            self._bg_store = store.clone() if hasattr(store, "clone") else store
            self._store_origin = store  # keeps rank 0's store server alive while we need it
        self._channel: Channel | None = None
        if self.world_size > 1:
            self._channel = Channel(backend or "gloo", self.timeout)
        self._stager = Stager(
            threads=staging_threads or min(4, os.cpu_count() or 1), pin=pin_memory
        )
        self._recv_buffers: dict[int, StagingBuffer] = {}
        self._writer = WriterProcess(nice=writer_nice)
        self._calls = 0
        self._seq = 0
        self._last: StagedSave | None = None
        self._errors: list[str] = []
        self._complete: set[int] = set()
        self._unconfirmed: list[tuple[int, int]] = []  # (seq, iteration) not yet complete
        self._failed: set[int] = set()  # seqs that failed on this rank
        self._lock = threading.Lock()
        self._prune_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[StagedSave | None] = queue.SimpleQueue()
        try:
            self._writer.start()
        except WriterDied as exc:
            self._release()
            raise CheckpointWriteError(str(exc)) from exc
        self._thread = threading.Thread(target=self._run, name="trainguard-local", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API

    def save(self, state: Any, iteration: int, *, pickle: bool = False) -> None:
        """Snapshot ``state`` as this rank's part of ``iteration``. All ranks call it together.

        Returns once the state is copied into host memory (the state may change right after);
        writing and replication run in the background. Waits first for the previous save's
        background work (the buffers are reused). Raises the error of an earlier failed save.
        """
        self._check_open()
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ConfigError(f"iteration={iteration!r}: use an integer >= 0")
        requested = time.monotonic()
        if self._last is not None:
            self._last.done.wait()
        self._raise_errors()
        flat = flatten(state, pickle=pickle)
        placed, nbytes = place(flat.entries)
        buffer, retired = self._stager.ensure(nbytes)
        self._stager.stage(flat.entries, placed)
        job = StagedSave(
            self._seq, iteration, flat.skeleton, placed, nbytes, buffer, retired, requested
        )
        self._seq += 1
        self._last = job
        self._jobs.put(job)
        events.emit(
            "local_ckpt_save",
            duration=time.monotonic() - requested,
            bytes=nbytes,
            iteration=iteration,
            root=self.root,
        )

    def wait(self, timeout: float | timedelta | None = None) -> None:
        """Block until the last saved iteration is durable with every copy on every rank.

        Then applies retention. Raises :class:`CheckpointWriteError` naming the ranks whose
        part or copies failed, or that did not finish within ``timeout`` (default: the
        manager's). Every rank calls it (it reads the store only).
        """
        limit = self.timeout if timeout is None else _seconds(timeout, "timeout")
        job = self._last
        if job is None:
            return
        if not job.done.wait(limit):
            raise CheckpointWriteError(f"iteration {job.iteration} not durable within {limit} s")
        self._raise_errors()
        deadline = time.monotonic() + limit
        while True:
            self._confirm(self._store)
            with self._lock:
                if all(seq != job.seq for seq, _ in self._unconfirmed):
                    break
            if time.monotonic() > deadline:
                raise CheckpointWriteError(
                    f"iteration {job.iteration} was not complete on every rank within {limit} s",
                    causes=self._missing(self._store, job.seq),
                )
            time.sleep(0.005)
        self._raise_errors()
        self._prune()

    def find_latest(self) -> int | None:
        """The newest iteration every owner's part of which a live rank holds, verified.

        Collective through the store: every rank reports the parts it holds and has verified;
        all compute the same answer. None when no iteration is recoverable (then nothing is
        removed: missing parts might still be brought back by hand). Iterations newer than the
        answer are incomplete and can never be completed: they are removed, so that a later
        save of the same number meets no stale copy (``load`` does the same for the iteration
        it loads). Raises
        :class:`CheckpointReplicationMismatchError` when that iteration was saved with another
        replication setting (unless ``allow_replication_change``).
        """
        self._check_open()
        started = time.monotonic()
        self._drain()
        parts = self._inventory.scan()
        merged = self._gather("find", parts)
        candidates = _inventory.complete(merged, self.world_size)
        self._complete.update(candidates)
        found = candidates[0] if candidates else None
        if found is not None:
            chosen = _inventory.choice(merged, found)
            self._check_setting(chosen)
            self._note_orphans(chosen)
            self._drop_newer(found)
        events.emit(
            "local_ckpt_find_latest",
            duration=time.monotonic() - started,
            iteration=found,
            held=len(parts),
            candidates=candidates[:5],
        )
        return found

    def load(self, iteration: int, *, allow_pickle: bool = False) -> Any:
        """This rank's part of ``iteration`` (owner = this rank's number). All ranks call it.

        Each rank hashes its own part again (while the transfers run; copies changed since
        they were last verified are hashed before anything is reported); a rank without a good
        copy of its part receives it from a holder (every rank computes the same transfer plan). When some
        part has no good copy anywhere, the newest older complete iteration is loaded instead,
        with a warning saying why; :class:`CheckpointNotFoundError` when none is. Returns None
        on a rank whose number did not exist in the world that saved (the world grew).
        Tensors are views of a private memory map (or of the received bytes).
        :attr:`last_load` says which copy was used.
        """
        self._check_open()
        started = time.monotonic()
        self._drain()
        for attempt in range(_ATTEMPTS):
            parts = self._inventory.scan()  # hashes only files changed since last verified
            merged = self._gather("load", parts)
            chosen = self._pick(merged, iteration)
            transfers = _inventory.plan(chosen, self.world_size)
            mine = {p.owner: p for p in parts if p.iteration == chosen.iteration}
            own = mine.get(self.rank) if self.rank < chosen.saved_world else None
            # this rank's own copy is hashed again while the transfers run
            check = _Background(verify_path, own.path) if own is not None else None
            received = self._transfer(chosen, transfers, mine)
            state, bad = None, None
            if received is not None:
                source, raw = received
                try:
                    state, _ = load_buffer(
                        raw,
                        f"part of owner {self.rank} from rank {source}",
                        allow_pickle=allow_pickle,
                    )
                except CheckpointCorruptError as exc:  # the sender's copy went bad unseen
                    logger.warning("%s", exc)
                    bad = [self.rank, source]
                where, nbytes = f"rank {source}", len(raw)
            elif own is not None and check is not None:
                error = check.result()
                if error is None:
                    state, _ = load_file(own.path, verify=False, allow_pickle=allow_pickle)
                else:
                    logger.warning("%s", error)
                    bad = [self.rank, self.rank]
                where, nbytes = f"local {own.path}", own.file_size
            outcome = self._gather_values("loaded", bad)
            failed = [v for v in outcome.values() if v is not None]
            if not failed:
                break
            for owner, source in failed:  # the holder hashes that copy again next time
                if source == self.rank and owner in mine:
                    self._inventory.distrust(mine[owner].path)
            logger.warning("load attempt %d: bad copies %s; trying again", attempt + 1, failed)
        else:
            raise CheckpointCorruptError(
                f"load of iteration {iteration}: copies kept failing their checksums after "
                f"transfer ({failed}) in {_ATTEMPTS} attempts"
            )
        self._drop_newer(chosen.iteration)
        if self.rank >= chosen.saved_world:
            logger.warning(
                "rank %d has no part in iteration %d (saved by %d ranks): nothing to load",
                self.rank,
                chosen.iteration,
                chosen.saved_world,
            )
            return None
        self.last_load = {"iteration": chosen.iteration, "source": where, "bytes": nbytes}
        events.emit(
            "local_ckpt_load",
            duration=time.monotonic() - started,
            iteration=chosen.iteration,
            requested=iteration,
            bytes=nbytes,
            source=where,
            transfers=len(transfers),
            attempts=attempt + 1,
        )
        return state

    def _drop_newer(self, iteration: int) -> None:
        """Remove iterations newer than the one every rank resumes from: they are incomplete
        everywhere (or abandoned), and a save of the same number must not meet stale copies."""
        with self._prune_lock:
            removed = self._inventory.remove_newer(iteration)
            with self._lock:
                self._complete.difference_update(removed)
        if removed:
            logger.info("removed iterations %s, newer than the one resumed from", removed)
            events.emit("local_ckpt_pruned", removed=removed, newer_than=iteration)

    def _pick(self, merged: dict[int, dict[str, Any]], iteration: int) -> _inventory.Choice:
        """The iteration to load: ``iteration`` if complete, else the newest older complete."""
        candidates = [it for it in _inventory.complete(merged, self.world_size) if it <= iteration]
        if not candidates or candidates[0] != iteration:
            reason = (
                f"iteration {iteration} is not on any rank"
                if iteration not in merged
                else f"no rank holds a good copy of the part(s) of owner(s) "
                f"{_inventory.missing_owners(merged[iteration], self.world_size)} of "
                f"iteration {iteration}"
            )
            if not candidates:
                raise CheckpointNotFoundError(
                    f"nothing to load under {self.root} and its peers: {reason}, and no older "
                    "iteration is complete"
                )
            logger.warning("%s; loading iteration %d instead", reason, candidates[0])
            events.emit(
                "local_ckpt_fallback", requested=iteration, loaded=candidates[0], reason=reason
            )
        chosen = _inventory.choice(merged, candidates[0])
        self._check_setting(chosen)
        self._note_orphans(chosen)
        return chosen

    def close(self) -> None:
        """Finish pending saves, stop the writer and the thread, free buffers and the group.

        Raises the error of a failed pending save after everything is freed. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join()
        with contextlib.suppress(Exception):
            self._confirm(self._store)
            self._prune()
        self._release()
        self._raise_errors()

    def __enter__(self) -> LocalCheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_error:
            logger.error("closing the local checkpoint manager after an error: %s", close_error)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this LocalCheckpointManager is closed; create a new one")

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise CheckpointWriteError(
                "a local checkpoint failed; the previous complete iteration is still the latest",
                causes={self.rank: "; ".join(errors)},
            )

    def _drain(self) -> None:
        if self._last is not None:
            self._last.done.wait()

    def _release(self) -> None:
        self._writer.stop()
        self._stager.close()
        for buffer in self._recv_buffers.values():
            buffer.close()
        self._recv_buffers.clear()
        if self._last is not None and self._last.retired is not None:
            self._last.retired.close()
        self._last = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _gather(self, what: str, parts: list[_inventory.Part]) -> dict[int, dict[str, Any]]:
        return _inventory.holdings(self._gather_values(what, [p.report() for p in parts]))

    def _gather_values(self, what: str, value: Any) -> dict[int, Any]:
        self._calls += 1
        key = f"{self._key}/{what}/{self._calls}"
        return allgather(self._store, key, self.rank, self.world_size, value, timeout=self.timeout)

    def _check_setting(self, chosen: _inventory.Choice) -> None:
        if chosen.replication == self.setting or self.allow_replication_change:
            return
        raise CheckpointReplicationMismatchError(
            f"iteration {chosen.iteration} under {self.root} was saved with "
            f"{chosen.replication} but this manager uses {self.setting}. Create the manager with "
            "the setting used at save time to resume, pass allow_replication_change=True to "
            "load it anyway (its parts are complete), or start fresh in an empty root"
        )

    def _note_orphans(self, chosen: _inventory.Choice) -> None:
        orphans = chosen.orphans(self.world_size)
        if orphans and self.rank == 0:
            logger.warning(
                "iteration %d was saved by %d ranks, this world has %d: the parts of owner(s) "
                "%s go to nobody",
                chosen.iteration,
                chosen.saved_world,
                self.world_size,
                orphans,
            )
        if orphans:
            events.emit(
                "local_ckpt_world_changed",
                iteration=chosen.iteration,
                saved_world=chosen.saved_world,
                world_size=self.world_size,
                unloaded_owners=orphans,
            )

    def _transfer(
        self,
        chosen: _inventory.Choice,
        transfers: list[tuple[int, int, int]],
        mine: dict[int, _inventory.Part],
    ) -> tuple[int, bytearray | mmap.mmap] | None:
        sends, recvs, maps = [], [], []
        received = None
        for owner, source, dest in transfers:
            if source == self.rank:
                with open(mine[owner].path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                maps.append(mm)
                sends.append((dest, torch.frombuffer(mm, dtype=torch.uint8)))
            if dest == self.rank:
                buf = mmap.mmap(-1, chosen.sizes[owner])
                received = (source, buf)
                recvs.append((source, torch.frombuffer(buf, dtype=torch.uint8)))
        if sends or recvs:
            assert self._channel is not None
            started = time.monotonic()
            self._channel.exchange(sends, recvs)
            events.emit(
                "local_ckpt_transfer",
                duration=time.monotonic() - started,
                iteration=chosen.iteration,
                sent=[(d, int(t.numel())) for d, t in sends],
                received=[(s, int(t.numel())) for s, t in recvs],
            )
        del sends
        for mm in maps:
            with contextlib.suppress(BufferError):
                mm.close()
        return received


class _Background:
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
