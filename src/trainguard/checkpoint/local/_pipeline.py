"""The background half of :class:`~.manager.LocalCheckpointManager`: write, replicate, retain.

One thread per manager takes the staged saves in order. For each it hands this rank's part to
the writer process, meanwhile exchanges parts with the other members of its clique over the
manager's dedicated group (sizes first, then header and data section as one message per peer,
received straight into a shared-memory buffer the writer maps), has the writer write every
received copy, and reports the outcome to the store. A save is *complete* once every rank has
reported it without error; retention then removes iterations older than the newest ``keep``
complete ones (incomplete iterations never count, so they never cause a removal).

Store keys per save (``S`` = the manager's prefix and the save's sequence number)::

    S/err/<rank>   why this rank's part or copies failed (only on failure)
    S/done/<rank>  this rank finished (ok or not)
    S/count        how many ranks finished
    S/seen         how many ranks have read the outcome; the last deletes S's keys
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
from typing import Any

import torch

from trainguard import events
from trainguard.checkpoint.fileformat import PlacedEntry
from trainguard.checkpoint.local import _inventory
from trainguard.checkpoint.local._transfer import Channel
from trainguard.checkpoint.staging import StagingBuffer
from trainguard.checkpoint.writer import WriteJob, WriterDied, WriterProcess
from trainguard.errors import CheckpointWriteError

logger = logging.getLogger(__name__)


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


class SavePipeline:
    """Mixin holding the background thread's work; the manager sets these attributes."""

    rank: int
    world_size: int
    root: str
    setting: str
    clique: list[int]
    keep: int
    fsync: bool
    _channel: Channel | None
    _writer: WriterProcess
    _inventory: _inventory.Inventory
    _recv_buffers: dict[int, StagingBuffer]
    _bg_store: Any
    _key: str
    _lock: threading.Lock
    _prune_lock: threading.Lock
    _errors: list[str]
    _failed: set[int]
    _complete: set[int]
    _unconfirmed: list[tuple[int, int]]
    _jobs: queue.SimpleQueue[StagedSave | None]

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._process(job)
            except Exception as exc:
                logger.warning("local checkpoint of iteration %d failed: %s", job.iteration, exc)
                job.error = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self._errors.append(job.error)
                    self._failed.add(job.seq)
            finally:
                self._report(job)
                job.done.set()

    def _process(self, job: StagedSave) -> None:
        retired, job.retired = job.retired, None
        self._writer.prepare(retired=retired)
        os.makedirs(_inventory.iteration_dir(self.root, job.iteration), exist_ok=True)
        meta = {
            "rank": str(self.rank),
            "owner": str(self.rank),
            "iteration": str(job.iteration),
            "world_size": str(self.world_size),
            "replication": self.setting,
            "skeleton": json.dumps(job.skeleton, separators=(",", ":")),
        }
        paths = [_inventory.part_path(self.root, job.iteration, self.rank, self.rank)]
        self._submit(job, job.buffer, paths[0], job.placed, meta)
        peers = [m for m in self.clique if m != self.rank]
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
            try:
                result = self._writer.result()
            except WriterDied:
                with contextlib.suppress(OSError):
                    os.unlink(path + ".tmp")
                raise
            assert result is not None
            if not result.ok:
                errors.append(result.error)
            else:
                self._inventory.trust(path)
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
        if not self._writer.is_attached(buffer.id):
            self._writer.attach(buffer.id, buffer.fd, buffer.nbytes)
        self._writer.submit(
            WriteJob(
                job_id=job.seq,
                path=path,
                buffer_id=buffer.id,
                placed=placed,
                metadata=meta,
                fsync=self.fsync,
            )
        )

    def _replicate(
        self, job: StagedSave, peers: list[int], meta: dict[str, str]
    ) -> dict[int, tuple[StagingBuffer, list[PlacedEntry], dict[str, str]]]:
        """Send this rank's part to every peer and receive theirs: sizes, then header + data."""
        assert self._channel is not None
        header = json.dumps(
            {"placed": [dataclasses.astuple(p) for p in job.placed], "meta": meta}
        ).encode()
        sizes_out = torch.tensor([len(header), job.nbytes], dtype=torch.int64)
        sizes_in = {p: torch.zeros(2, dtype=torch.int64) for p in peers}
        self._channel.exchange([(p, sizes_out) for p in peers], list(sizes_in.items()))
        raw_in = {p: bytearray(int(sizes_in[p][0])) for p in peers}
        headers_in = {p: torch.frombuffer(raw_in[p], dtype=torch.uint8) for p in peers}
        buffers = {}
        for p in peers:
            buffers[p] = self._recv_buffer(p, int(sizes_in[p][1]))
        header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        data_out = job.buffer.view(0, job.nbytes)
        sends, recvs = [], []
        for p in peers:
            sends += [(p, header_t), (p, data_out)]
            recvs += [(p, headers_in[p]), (p, buffers[p].view(0, int(sizes_in[p][1])))]
        self._channel.exchange(sends, recvs)
        out = {}
        for p in peers:
            doc = json.loads(bytes(raw_in[p]))
            placed = [
                PlacedEntry(name, dtype, tuple(shape), offset, nbytes)
                for name, dtype, shape, offset, nbytes in doc["placed"]
            ]
            if doc["meta"].get("owner") != str(p) or doc["meta"].get("iteration") != str(
                job.iteration
            ):
                raise CheckpointWriteError(
                    f"rank {p} sent {doc['meta'].get('owner')}'s part of iteration "
                    f"{doc['meta'].get('iteration')} while this rank saves {job.iteration}: the "
                    "ranks do not call save() with the same iterations in the same order"
                )
            out[p] = (buffers[p], placed, doc["meta"])
        return out

    def _recv_buffer(self, peer: int, nbytes: int) -> StagingBuffer:
        buffer = self._recv_buffers.get(peer)
        if buffer is not None and buffer.nbytes >= nbytes:
            return buffer
        if buffer is not None:
            self._writer.detach(buffer.id)
            buffer.close()
        grown = max(nbytes, int(buffer.nbytes * 1.5) if buffer is not None else 0)
        self._recv_buffers[peer] = StagingBuffer(grown, pin=False)
        return self._recv_buffers[peer]

    # ------------------------------------------------------------------ completion, retention

    def _done_key(self, seq: int) -> str:
        return f"{self._key}/save/{seq}"

    def _report(self, job: StagedSave) -> None:
        with self._lock:
            self._unconfirmed.append((job.seq, job.iteration))
        if self._bg_store is not None:
            key = self._done_key(job.seq)
            try:
                if job.error is not None:
                    self._bg_store.set(f"{key}/err/{self.rank}", job.error)
                self._bg_store.set(f"{key}/done/{self.rank}", "1")
                self._bg_store.add(f"{key}/count", 1)
            except Exception as exc:
                logger.warning("reporting iteration %d to the store failed: %s", job.iteration, exc)
        try:
            self._confirm(self._bg_store)
            self._prune()
        except Exception as exc:  # retried by the next save, wait() and close()
            logger.debug("retention after iteration %d: %s", job.iteration, exc)

    def _confirm(self, store: Any) -> None:
        """Move saves that every rank has finished from unconfirmed to complete (or failed)."""
        with self._lock:
            pending = list(self._unconfirmed)
        for seq, iteration in pending:
            key = self._done_key(seq)
            failed: dict[int, str] = {}
            if store is not None:
                if store.add(f"{key}/count", 0) < self.world_size:
                    continue
                for r in range(self.world_size):
                    if store.check([f"{key}/err/{r}"]):
                        failed[r] = store.get(f"{key}/err/{r}").decode(errors="replace")
            elif seq in self._failed:
                failed[self.rank] = "failed here"
            with self._lock:
                if (seq, iteration) not in self._unconfirmed:
                    continue  # the other thread got there first
                self._unconfirmed.remove((seq, iteration))
                self._failed.discard(seq)
                if not failed:
                    self._complete.add(iteration)
                elif all(r != self.rank for r in failed):
                    self._errors.append(
                        f"iteration {iteration} failed on rank(s) "
                        + ", ".join(f"{r} ({why})" for r, why in sorted(failed.items()))
                    )
            if store is not None and store.add(f"{key}/seen", 1) == self.world_size:
                for name in ["count", "seen"] + [
                    f"{kind}/{r}" for r in range(self.world_size) for kind in ("done", "err")
                ]:
                    with contextlib.suppress(Exception):
                        store.delete_key(f"{key}/{name}")

    def _missing(self, store: Any, seq: int) -> dict[int, str]:
        key = self._done_key(seq)
        if store is None:
            return {}
        return {
            r: "did not finish its part and copies (dead or hung?)"
            for r in range(self.world_size)
            if not store.check([f"{key}/done/{r}"])
        }

    def _prune(self) -> None:
        with self._prune_lock:
            with self._lock:
                complete = sorted(self._complete, reverse=True)
            if len(complete) < self.keep:
                return
            keep_from = complete[self.keep - 1]
            removed = self._inventory.remove_older(keep_from)
            with self._lock:
                self._complete.difference_update(removed)
        if removed:
            events.emit("local_ckpt_pruned", removed=removed, kept_from=keep_from)
