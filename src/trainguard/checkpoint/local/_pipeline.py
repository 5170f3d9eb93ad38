"""The background half of :class:`~.manager.LocalCheckpointManager`: write, replicate, retain.

One thread per manager takes the staged saves in order. For each it hands this rank's part to
the writer process, meanwhile exchanges parts with the other members of its clique over the
manager's dedicated group (sizes first, then header and data section as one message per peer,
received straight into a shared-memory buffer the writer maps), has the writer write every
received copy, and reports the outcome to the store. A save is *complete* once every rank has
reported it without error; retention then removes iterations older than the newest ``keep``
complete ones (incomplete iterations never count, so they never cause a removal).

Each save is one :class:`~trainguard.coord.commit.CommitRound` under ``<prefix>/save/<seq>``:
every rank reports once its part and copies are durable (or failed), the last one decides, and
every rank settles the save on that one outcome (read without waiting after each save, waited
for by :meth:`SavePipeline.wait`), so that every rank counts the same iterations complete.

Over 400 lines: one class whose methods follow one save through the thread in the order it
happens (write, exchange, report, settle, retain) with the calls the manager makes between
saves; the exchange's protocol is in :mod:`._replicate`, what is left would split only into
functions reading this class's private members.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from trainguard import _aborts, events
from trainguard._errtext import brief
from trainguard._threads import serve
from trainguard.checkpoint._link import StoreLink
from trainguard.checkpoint.format.write import PlacedEntry
from trainguard.checkpoint.local import _inventory, _root
from trainguard.checkpoint.local._replicate import Received, exchange_parts
from trainguard.checkpoint.local._transfer import Channel
from trainguard.checkpoint.staging import StagingBuffer
from trainguard.checkpoint.writer import WriteJob, WriterProcess
from trainguard.coord.commit import COMMITTED, FAILED, CommitRound, Outcome
from trainguard.errors import CheckpointWriteError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

logger = logging.getLogger(__name__)

#: how long a failed save waits to see whether its round is being aborted (a fault elsewhere)
_ABORT_WAIT_S = 2.0


@dataclasses.dataclass
class StagedSave:
    seq: int
    iteration: int
    skeleton: Any
    placed: list[PlacedEntry]
    nbytes: int
    buffer: StagingBuffer
    retired: StagingBuffer | None
    requested: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: str | None = None
    own_written: bool = False  # this rank's part is durable, written from ``buffer``


@dataclasses.dataclass(frozen=True)
class Place:
    """Who this rank is in the local checkpoints, and where its files go."""

    rank: int
    world_size: int
    root: str
    setting: str  # the replication setting, stored in every part
    clique: list[int]
    keep: int
    fsync: bool


class SavePipeline:
    """The background thread of one :class:`~.manager.LocalCheckpointManager`, and what it
    knows about which iterations are complete.

    The manager's thread calls :meth:`submit` (in save order), :meth:`wait`, :meth:`drain`,
    :meth:`raise_errors`, :meth:`note_complete`, :meth:`drop_newer`, finally :meth:`close`
    and, once the writer has stopped, :meth:`release`.
    ``link`` is None with one rank (nothing to agree on).
    """

    def __init__(
        self,
        place: Place,
        *,
        writer: WriterProcess,
        inventory: _inventory.Inventory,
        channel: Channel | None,
        link: StoreLink | None,
        caller_store: Store | None = None,
        recv_buffers: dict[int, StagingBuffer] | None = None,
    ) -> None:
        self.place = place
        self.rank, self.world_size, self.root = place.rank, place.world_size, place.root
        self._writer = writer
        self._inventory = inventory
        self._channel = channel
        self._link = link
        self._aborts = _aborts.count()  # another count: the round was aborted
        # the background thread's client, connected here: a thread connecting for itself could
        # wait out the whole connect timeout on a store whose round ended meanwhile, and
        # close() (the next round's re-bind) waits for that thread; its calls never wait and
        # go through _aborts.bound: an abort's shutdown of the round's connections cuts none
        self._bg_store: Store | None = (
            _aborts.bound(link.client(), self._aborts) if link is not None else None
        )
        # the caller's (``caller_store``: one the caller's thread uses for its own waits too)
        if link is not None and caller_store is None:
            caller_store = link.client()
        self._fg_store = caller_store if link is not None else None
        # receive buffers (per peer): the manager's, kept across rounds when it passes them
        self._recv_buffers: dict[int, StagingBuffer] = {} if recv_buffers is None else recv_buffers
        self.last: StagedSave | None = None
        self._errors: list[str] = []
        self._complete: set[int] = set()
        self._unconfirmed: list[tuple[int, int]] = []  # (seq, iteration) not yet settled
        self._failed: set[int] = set()  # seqs that failed on this rank
        self._waited: int | None = None  # the seq wait() waits for: wait() closes its round
        self._lock = threading.Lock()
        self._prune_lock = threading.Lock()
        self._jobs: queue.SimpleQueue[StagedSave | None] = queue.SimpleQueue()
        self._stopped = threading.Event()  # set as the thread ends
        self._thread = threading.Thread(target=self._run, name="trainguard-local", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller's thread

    def submit(self, job: StagedSave) -> None:
        self.last = job
        self._jobs.put(job)

    def use_channel(self, channel: Channel) -> None:
        """The replication group, built by the manager before the first save that needs it."""
        self._channel = channel

    def drain(self) -> None:
        """Wait until the background thread is done with the last save."""
        if self.last is not None:
            self.last.done.wait()

    def wait(self, limit: float) -> None:
        """Block until the last save is settled on every rank (at most ``limit`` seconds for
        its background work, then as long again for the other ranks), then apply retention."""
        job = self.last
        if job is None:
            return
        if not job.done.wait(limit):
            raise CheckpointWriteError(f"iteration {job.iteration} not durable within {limit} s")
        self.raise_errors()
        with self._lock:
            unsettled = (job.seq, job.iteration) in self._unconfirmed
            self._waited = job.seq if unsettled else None
        if self._fg_store is not None and unsettled:
            # this rank's round stays open (its keys stay) until this wait closes it
            round_ = self._round(self._fg_store, job.seq)
            try:
                outcome = round_.wait(limit)
            finally:
                with self._lock:
                    self._waited = None
            self._settle(job.seq, job.iteration, outcome)
            round_.close()
        self._confirm(self._fg_store)
        self.raise_errors()
        self._prune()

    def raise_errors(self) -> None:
        """Raise the failures of earlier saves (this rank's, or the others' as the outcome
        named them) as one :class:`CheckpointWriteError`, once."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise CheckpointWriteError(
                "a local checkpoint failed; the previous complete iteration is still the latest",
                causes={self.rank: "; ".join(errors)},
            )

    def note_complete(self, iterations: list[int]) -> None:
        with self._lock:
            self._complete.update(iterations)

    def drop_newer(self, iteration: int, *, keep: list[int] | tuple[int, ...] = ()) -> list[int]:
        """Remove iterations newer than ``iteration`` but those in ``keep`` (see the manager's
        ``find_latest``)."""
        with self._prune_lock:
            removed = self._inventory.remove_newer(iteration, keep=keep)
            with self._lock:
                self._complete.difference_update(removed)
        return removed

    def drop(self, iteration: int) -> list[int]:
        """Remove ``iteration`` from this rank's root (it is about to be saved again)."""
        with self._prune_lock:
            removed = [iteration] if self._inventory.remove(iteration) else []
            with self._lock:
                self._complete.discard(iteration)
        return removed

    def close(self, *, settle: bool = True) -> None:
        """Finish the saves queued so far, stop the thread; ``settle``: then settle what can be
        settled and apply retention (store round trips and a scan of the root). May be called
        again after an interrupted call."""
        self._jobs.put(None)
        # an event, not join() alone: a join() that an exception interrupted marks the thread
        # stopped while it still runs (bpo-45274's handling in threading), so a second join()
        # would return at once
        self._stopped.wait()
        self._thread.join()
        if settle:
            with contextlib.suppress(Exception):
                self._confirm(self._fg_store)
                self._prune()

    def release(self, *, buffers: bool = True) -> None:
        """Free the receive buffers (after the writer has stopped; ``buffers=False`` keeps
        them for the manager's next round) and a retired staging buffer."""
        if buffers:
            for buffer in self._recv_buffers.values():
                buffer.close()
            self._recv_buffers.clear()
        if self.last is not None and self.last.retired is not None:
            self.last.retired.close()
        self.last = None

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        try:
            serve(self._jobs, self._one)
        finally:
            self._stopped.set()

    def _one(self, job: StagedSave) -> None:
        ended = False
        try:
            self._process(job)
        except Exception as exc:
            # cut by a fault's abort: the next round tells of it; not reported (see _report)
            ended = self._bg_store is not None and self._ends_within(_ABORT_WAIT_S)
            log = logger.debug if ended else logger.warning
            log("local checkpoint of iteration %d failed: %s", job.iteration, brief(str(exc)))
            job.error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._errors.append(job.error)
                self._failed.add(job.seq)
        finally:
            self._report(job, ended)
            job.done.set()

    def _round_over(self) -> bool:
        return _aborts.count() != self._aborts

    def _ends_within(self, limit: float) -> bool:
        """Whether the round is over within ``limit`` s (a fault's abort arrives late here)."""
        deadline = time.monotonic() + limit
        while not self._round_over():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _process(self, job: StagedSave) -> None:
        retired, job.retired = job.retired, None
        self._writer.prepare(retired=retired)
        _root.prepare_root(self.root)  # the root may have been removed (and re-created)
        _root.make_private_dir(_inventory.iteration_dir(self.root, job.iteration))
        meta = {
            "rank": str(self.rank),
            "owner": str(self.rank),
            "iteration": str(job.iteration),
            "world_size": str(self.world_size),
            "replication": self.place.setting,
            "skeleton": json.dumps(job.skeleton, separators=(",", ":")),
        }
        paths = [_inventory.part_path(self.root, job.iteration, self.rank, self.rank)]
        self._submit(job, job.buffer, paths[0], job.placed, meta)
        peers = [m for m in self.place.clique if m != self.rank]
        failure: BaseException | None = None
        if peers:
            started = time.monotonic()
            try:
                got = self._replicate(job, peers, meta)
            except Exception as exc:  # collect the writer's answer for our own part first
                failure, got = exc, {}
            received = 0
            for peer, (buffer, placed, peer_meta) in got.items():
                path = _inventory.part_path(self.root, job.iteration, peer, self.rank)
                self._submit(job, buffer, path, placed, peer_meta)
                paths.append(path)
                received += placed[-1].offset + placed[-1].nbytes if placed else 0
            if failure is None:
                events.emit(
                    "local_ckpt_replicate",
                    duration=time.monotonic() - started,
                    iteration=job.iteration,
                    peers=peers,
                    bytes_sent=job.nbytes * len(peers),
                    bytes_received=received,
                )
        errors = []
        for path in paths:
            result = self._writer.wait(path)
            if not result.ok:
                errors.append(result.error)
            else:
                try:  # every result above is read first: the writer answers in order
                    os.chmod(path, _root.PART_MODE, follow_symlinks=False)
                except OSError as exc:
                    errors.append(f"{path}: cannot make it private: {exc}")
                    continue
                self._inventory.trust(path)
                job.own_written = job.own_written or path == paths[0]
        if failure is not None:
            raise CheckpointWriteError(f"replication to {peers} failed: {failure}") from failure
        if errors:
            raise CheckpointWriteError("; ".join(errors))
        events.emit(
            "local_ckpt_durable",
            duration=time.monotonic() - job.requested,
            iteration=job.iteration,
            files=len(paths),
        )

    def _submit(
        self,
        job: StagedSave,
        buffer: StagingBuffer,
        path: str,
        placed: list[PlacedEntry],
        meta: dict[str, str],
    ) -> None:
        self._writer.send(
            WriteJob(
                job_id=job.seq,
                path=path,
                buffer_id=buffer.id,
                placed=placed,
                metadata=meta,
                fsync=self.place.fsync,
            ),
            buffer,
        )

    def _replicate(
        self, job: StagedSave, peers: list[int], meta: dict[str, str]
    ) -> dict[int, Received]:
        """Send this rank's part to every peer and receive theirs (:func:`exchange_parts`)."""
        assert self._channel is not None
        return exchange_parts(
            self._channel,
            peers,
            iteration=job.iteration,
            placed=job.placed,
            buffer=job.buffer,
            nbytes=job.nbytes,
            meta=meta,
            recv_buffers=self._recv_buffers,
            writer=self._writer,
        )

    # ------------------------------------------------------------------ completion, retention

    def _round(self, store: Store, seq: int) -> CommitRound:
        assert self._link is not None
        key = f"{self._link.prefix}/save/{seq}"
        return CommitRound(store, key, rank=self.rank, world_size=self.world_size)

    def _report(self, job: StagedSave, ended: bool) -> None:
        with self._lock:
            self._unconfirmed.append((job.seq, job.iteration))
        store = self._bg_store
        if store is not None and (ended or self._round_over()):
            # never committed, as after a failed report (torch prints a trace per failed call)
            logger.debug("iteration %d: its round was aborted; not reported", job.iteration)
            return
        if store is not None:
            try:
                self._round(store, job.seq).report(job.error)
            except Exception as exc:
                log = logger.debug if self._round_over() else logger.warning
                log(
                    "reporting iteration %d to the store failed: %s", job.iteration, brief(str(exc))
                )
        try:
            self._confirm(store)
            self._prune()
        except Exception as exc:  # retried by the next save, wait() and close()
            logger.debug("retention after iteration %d: %s", job.iteration, exc)

    def _confirm(self, store: Store | None) -> None:
        """Settle the saves whose outcome is published (never waits)."""
        with self._lock:
            pending = list(self._unconfirmed)
            failed = set(self._failed)
        for seq, iteration in pending:
            if store is None:  # one rank: its own result is the outcome
                causes = {self.rank: "failed here"} if seq in failed else {}
                self._settle(seq, iteration, Outcome(FAILED if causes else COMMITTED, causes, 0))
                continue
            round_ = self._round(store, seq)
            outcome = round_.poll()
            if outcome is not None and self._settle(seq, iteration, outcome):
                round_.close()

    def _settle(self, seq: int, iteration: int, outcome: Outcome) -> bool:
        """Record the outcome of save ``seq`` once (either thread may get there first).
        True when this call settled it and its round is the caller's to close (not waited)."""
        with self._lock:
            if (seq, iteration) not in self._unconfirmed:
                return False
            self._unconfirmed.remove((seq, iteration))
            self._failed.discard(seq)
            if outcome.committed:
                self._complete.add(iteration)
            elif all(r != self.rank for r in outcome.causes):
                self._errors.append(
                    f"iteration {iteration} failed on rank(s) "
                    + ", ".join(f"{r} ({why})" for r, why in sorted(outcome.causes.items()))
                )
            return self._waited != seq

    def _prune(self) -> None:
        with self._prune_lock:
            visible = set(self._inventory.iterations())  # never count what a scan misses
            with self._lock:
                complete = sorted(self._complete & visible, reverse=True)
            if len(complete) < self.place.keep:
                return
            keep_from = complete[self.place.keep - 1]
            removed = self._inventory.remove_older(keep_from)
            with self._lock:
                self._complete.difference_update(removed)
        if removed:
            events.emit("local_ckpt_pruned", removed=removed, kept_from=keep_from)
