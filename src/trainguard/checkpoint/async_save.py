"""AsyncCheckpointer: save without stopping training; load and find checkpoints.

The training loop pays only for copying the state into a reusable shared-memory staging buffer
(or nothing, with ``overlap=True``); one persistent writer process per checkpointer makes the
file durable. See :class:`AsyncCheckpointer` for the protocol.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from trainguard import events
from trainguard.checkpoint import _commit
from trainguard.checkpoint._load import latest, load, part_name
from trainguard.checkpoint.fileformat import place
from trainguard.checkpoint.layout import flatten
from trainguard.checkpoint.staging import Stager, StagingBuffer
from trainguard.checkpoint.writer import WriteJob, WriterDied, WriteResult, WriterProcess
from trainguard.errors import (
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
)

__all__ = ["AsyncCheckpointer", "SaveHandle", "SaveInfo", "latest", "load", "part_name"]

# load and latest live in _load.py (one concept per module); they are part of this API.

logger = logging.getLogger(__name__)

_FORMATS = ("trainguard", "torch")
_IF_BUSY = ("wait", "skip")


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    """What the callbacks receive about one save."""

    path: str  # the checkpoint (a file, or the directory of a multi-rank checkpoint)
    file: str  # this rank's file
    rank: int
    world_size: int
    nbytes: int  # bytes of tensor data staged
    file_bytes: int  # size of this rank's file
    staged_seconds: float  # time from save() to the state being in host memory
    durable_seconds: float  # time from save() to this rank's file being durable
    write_seconds: float  # time the writer spent on the file

    @property
    def throughput(self) -> float:
        """Bytes per second the writer achieved on this rank's file."""
        return self.file_bytes / self.write_seconds if self.write_seconds > 0 else 0.0


class SaveHandle:
    """Returned by :meth:`AsyncCheckpointer.save`; tells where one save is."""

    def __init__(self, seq: int, path: str, file: str) -> None:
        self.seq, self.path, self.file = seq, path, file
        self.staged = threading.Event()
        self.written = threading.Event()  # the writer is done with the staging buffer
        self.finished = threading.Event()  # committed or failed
        self.error: CheckpointError | None = None
        self.info: SaveInfo | None = None
        self.commit_key = ""  # the store prefix of its multi-rank commit

    @property
    def committed(self) -> bool:
        return self.finished.is_set() and self.error is None

    def __repr__(self) -> str:
        state = "committed" if self.committed else "failed" if self.error else "pending"
        return f"SaveHandle({self.path!r}, {state})"


@dataclasses.dataclass
class _Job:
    handle: SaveHandle
    flat: Any
    placed: list[Any]
    buffer: StagingBuffer
    format: str
    overlap: bool
    on_durable: Callable[[SaveInfo], None] | None
    on_commit: Callable[[SaveInfo], None] | None
    requested: float
    cuda_stream: Any = None
    retired: StagingBuffer | None = None  # a buffer this job's larger one replaced
    commit_key: str = ""
    staged_at: float = 0.0
    nbytes: int = 0


@dataclasses.dataclass
class _CommitItem:
    """One report to the store: for a job, or (job None) for a save that failed or was skipped
    before it reached the writer, so that the other ranks do not wait for this rank's part."""

    job: _Job | None
    key: str
    path: str
    error: str | None


class AsyncCheckpointer:
    """Asynchronous checkpoints through one persistent writer process.

    Single process: ``save(state, path)`` writes the file ``path``. With a torch.distributed job
    (or a ``store`` given), every rank calls ``save`` with the same ``path``, in the same order;
    ``path`` is then a directory with one file per rank, committed (a ``COMMITTED`` marker) once
    every rank's file is durable. The count is kept in the store, never in a collective on the
    training group; the last rank to report writes the marker, then every rank's ``on_commit``
    runs (on its next :meth:`poll`/:meth:`wait`). A failure on any rank fails the checkpoint on
    every rank with the same :class:`CheckpointWriteError`.

    Protocol for the caller (the training thread):

    - ``save()`` returns once the state is copied into host memory (default): the state may be
      changed right after. With ``overlap=True`` it returns at once and the copy runs in the
      background; the state must not change until :meth:`wait_staged` returns — the optimizer
      pre-step hook that :meth:`protect` installs does that.
    - Call :meth:`poll` regularly (it never blocks): it runs callbacks of finished saves in the
      calling thread and raises the error of a failed one. :meth:`wait` blocks until every
      pending save is committed or failed. ``save()`` also raises pending errors first.
    - :meth:`close` (or leaving the ``with`` block) waits for pending saves, stops the writer
      and frees everything: no thread, process, shared memory or file descriptor remains.

    Args:
        store: a torch.distributed Store for the commit count (default: the default process
            group's store when torch.distributed is initialized, else single-process).
        rank, world_size: this rank and the number of ranks (default: from torch.distributed).
        staging_threads: threads that copy into the staging buffer (default: up to 4).
        pin_memory: register staging buffers as pinned memory when CUDA is available.
        fsync: make files durable (turn off only for benchmarks of memory-only storage).
        commit_timeout: seconds a rank waits for the other ranks' parts before failing.
        writer_nice: nice increment of the writer process.
        start_timeout: seconds to wait for the writer process to start.
        key_prefix: prefix of the store keys this checkpointer uses. With several ranks, every
            rank must create its checkpointers in the same order (each gets a generation number
            from the store, so keys of an earlier checkpointer never count for a later one).
    """

    def __init__(
        self,
        *,
        store: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        staging_threads: int | None = None,
        pin_memory: bool = True,
        fsync: bool = True,
        commit_timeout: float = 300.0,
        writer_nice: int = 10,
        start_timeout: float = 120.0,
        key_prefix: str = "trainguard/ckpt",
    ) -> None:
        if staging_threads is not None and staging_threads < 1:
            raise ConfigError("staging_threads must be >= 1 (or None for the default)")
        if commit_timeout <= 0 or start_timeout <= 0:
            raise ConfigError("commit_timeout and start_timeout must be positive seconds")
        if not 0 <= writer_nice <= 19:
            raise ConfigError("writer_nice must be between 0 and 19")
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        if store is None and initialized:
            store = dist.distributed_c10d._get_default_store()
        if store is not None:
            if rank is None or world_size is None:
                if not initialized:
                    raise ConfigError(
                        "with a store, pass rank= and world_size= (or initialize torch.distributed)"
                    )
                rank = dist.get_rank() if rank is None else rank
                world_size = dist.get_world_size() if world_size is None else world_size
            if not 0 <= rank < world_size:
                raise ConfigError(f"rank={rank} is not in range(world_size={world_size})")
        elif rank not in (None, 0) or world_size not in (None, 1):
            raise ConfigError("rank/world_size need a store or an initialized torch.distributed")
        self.distributed = store is not None
        self.rank = rank or 0
        self.world_size = world_size or 1
        self.fsync = fsync
        self.commit_timeout = commit_timeout
        self._stager = Stager(
            threads=staging_threads or min(4, os.cpu_count() or 1), pin=pin_memory
        )
        self._writer = WriterProcess(nice=writer_nice, start_timeout=start_timeout)
        self._seq = itertools.count()
        # jobs, and reports of saves that never reached the writer, in save order: every rank
        # must report its saves to the store in the same order, or two ranks could each wait
        # for an outcome that needs the other's next report
        self._jobs: queue.SimpleQueue[_Job | _CommitItem | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[str, _Job]] = queue.SimpleQueue()
        self._pending: list[SaveHandle] = []
        self._last: _Job | None = None
        self._hooks: list[Any] = []
        self._closed = False
        self._store = None
        self._key_base = key_prefix
        if self.distributed:
            generation = (store.add(f"{key_prefix}/instances", 1) - 1) // self.world_size
            self._key_base = f"{key_prefix}/{generation}"
            # a client of our own: a pending wait() holds a TCPStore client for its duration
            self._store = store.clone() if hasattr(store, "clone") else store
            self._store_origin = store  # keeps rank 0's store server alive while we need it
        try:
            self._writer.start()
        except WriterDied as exc:
            raise CheckpointWriteError(str(exc)) from exc
        self._thread = threading.Thread(target=self._run, name="trainguard-ckpt", daemon=True)
        self._thread.start()
        self._committer: threading.Thread | None = None
        self._commits: queue.SimpleQueue[_CommitItem | None] = queue.SimpleQueue()
        self._occurrences: dict[str, int] = {}
        if self.distributed:
            self._committer = threading.Thread(
                target=self._run_commits, name="trainguard-ckpt-commit", daemon=True
            )
            self._committer.start()

    # ------------------------------------------------------------------ training-thread API

    def save(
        self,
        state: Any,
        path: str | os.PathLike[str],
        *,
        on_durable: Callable[[SaveInfo], None] | None = None,
        on_commit: Callable[[SaveInfo], None] | None = None,
        overlap: bool = False,
        if_busy: str = "wait",
        format: str = "trainguard",
        pickle: bool = False,
    ) -> SaveHandle | None:
        """Snapshot ``state`` (nested dicts/lists/tuples of tensors and plain values) to ``path``.

        Every rank calls it with the same ``path``, in the same order. Returns a
        :class:`SaveHandle`, or None when ``if_busy="skip"`` and the previous save is still
        being written (with several ranks, a rank that skips makes that checkpoint fail on the
        others, which name it as the cause; a save that raises here does the same). Raises the error of an earlier failed save first. Objects JSON cannot hold
        need ``pickle=True`` (and ``allow_pickle=True`` to load). ``format="torch"`` writes a
        file that ``torch.load(weights_only=True)`` reads.
        """
        if format not in _FORMATS:
            raise ConfigError(f"format={format!r}; use one of {_FORMATS}")
        if if_busy not in _IF_BUSY:
            raise ConfigError(f"if_busy={if_busy!r}; use one of {_IF_BUSY}")
        self._check_open()
        requested = time.monotonic()
        self.poll()
        path = os.fspath(path)
        events.emit("ckpt_requested", path=path, overlap=overlap, format=format)
        key = self._commit_key(path)
        last = self._last
        if last is not None and not last.handle.written.is_set():
            if if_busy == "skip":
                events.emit("ckpt_skipped", path=path, busy_with=last.handle.path)
                logger.info(
                    "checkpoint %s skipped: %s is still being written", path, last.handle.path
                )
                if self.distributed:  # the other ranks' parts of it cannot be committed
                    reason = f"skipped the save (if_busy='skip'): {last.handle.path} was busy"
                    self._jobs.put(_CommitItem(None, key, path, reason))
                return None
            last.handle.written.wait()
        try:
            flat = flatten(state, pickle=pickle)
            placed, data_nbytes = place(flat.entries)
            buffer, replaced = self._stager.ensure(data_nbytes)
            seq = next(self._seq)
            file = os.path.join(path, part_name(self.rank, format)) if self.distributed else path
            handle = SaveHandle(seq, path, file)
            job = _Job(
                handle, flat, placed, buffer, format, overlap, on_durable, on_commit, requested
            )
            job.commit_key = handle.commit_key = key
            job.retired = replaced
            if any(e.source.is_cuda for e in flat.entries):
                job.cuda_stream = torch.cuda.current_stream()
            if not overlap:
                self._stage(job)
        except Exception as exc:  # raised here; the other ranks learn it through the store
            if self.distributed:
                self._jobs.put(_CommitItem(None, key, path, f"{type(exc).__name__}: {exc}"))
            raise
        self._last = job
        self._pending.append(handle)
        self._jobs.put(job)
        return handle

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the latest save's state is in host memory (the fence for overlap=True).

        After it returns the state may change. A failed staging is reported by :meth:`poll`.
        """
        job = self._last
        if job is None:
            return
        if not job.handle.staged.wait(timeout):
            raise CheckpointWriteError(
                f"staging of {job.handle.path} did not finish in {timeout} s"
            )

    def protect(self, optimizer: torch.optim.Optimizer) -> None:
        """Fence ``optimizer.step()`` on staging: the step waits until a pending overlapped
        copy has finished, so it can never change a tensor before it is staged."""
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.wait_staged()))

    def poll(self) -> None:
        """Run callbacks of finished saves in this thread; raise the first failure. Never blocks."""
        first: CheckpointError | None = None
        while True:
            try:
                kind, job = self._results.get_nowait()
            except queue.Empty:
                break
            handle = job.handle
            if kind == "failed":
                with contextlib.suppress(ValueError):
                    self._pending.remove(handle)
                first = first or handle.error
                continue
            assert handle.info is not None
            callback = job.on_durable if kind == "durable" else job.on_commit
            if kind == "committed":
                with contextlib.suppress(ValueError):
                    self._pending.remove(handle)
            if callback is not None:
                callback(handle.info)
        if first is not None:
            raise first

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed or failed, then :meth:`poll`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in list(self._pending):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handle.finished.wait(remaining):
                raise CheckpointWriteError(f"checkpoint {handle.path} not done within {timeout} s")
        self.poll()

    def close(self, *, abandon: bool = False) -> None:
        """Wait for pending saves, stop the writer, free buffers, threads and hooks.

        Raises the error of a failed pending save after everything is freed. Idempotent.
        ``abandon=True`` (e.g. from a restart's finalize hook, when a rank the commit waits for
        may be dead) gives up the saves not yet committed instead of waiting for the other
        ranks: their commit fails at once on every rank, naming this rank's abandonment as the
        cause, and no error is raised here. The previous committed checkpoint stays the latest.
        """
        if self._closed:
            return
        error: BaseException | None = None
        try:
            if abandon:
                self._abandon()
            elif self._thread.is_alive():
                self.wait()
        except BaseException as exc:
            error = exc
        finally:
            self._shutdown()
        if error is not None:
            raise error

    def _abandon(self) -> None:
        pending = [h for h in self._pending if not h.finished.is_set()]
        if self.distributed and pending:
            store = self._store_origin.clone() if hasattr(self._store_origin, "clone") else None
            for handle in pending:
                try:
                    _commit.abandon(
                        store or self._store_origin,
                        handle.commit_key,
                        rank=self.rank,
                        reason="abandoned: rank closed the checkpointer with abandon=True",
                    )
                except Exception as exc:  # the store is gone: the commit fails on its own
                    logger.info("could not abandon %s: %s", handle.path, exc)
            events.emit("ckpt_abandoned", paths=[h.path for h in pending])
        for handle in pending:
            handle.finished.wait(timeout=self.commit_timeout)
        with contextlib.suppress(CheckpointError):
            self.poll()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already propagating: do not mask it
            self.close()
        except Exception as close_error:
            logger.error("closing the checkpointer after an error: %s", close_error)

    @property
    def writer_pid(self) -> int | None:
        """pid of the writer process (None before it started or after it died)."""
        return self._writer.pid

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this AsyncCheckpointer is closed; create a new one")

    def _shutdown(self) -> None:
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._jobs.put(None)
        self._thread.join()
        if self._committer is not None:
            self._commits.put(None)
            self._committer.join()
        self._writer.stop()
        if self._last is not None and self._last.retired is not None:
            self._last.retired.close()
        self._stager.close()
        self._last = None

    def _stage(self, job: _Job) -> None:
        started = time.monotonic()
        if job.cuda_stream is not None:
            torch.cuda.current_stream().wait_stream(job.cuda_stream)  # see Stager.stage
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

    def _run(self) -> None:
        """The background thread: stage (overlap), write, then hand over to commit."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, _CommitItem):
                self._commits.put(job)
                continue
            try:
                if not job.handle.staged.is_set():
                    self._stage(job)
                result = self._write(job)
                error = None if result.ok else result.error
            except Exception as exc:  # staging error or writer death
                logger.warning("checkpoint %s failed: %s", job.handle.path, exc)
                result = WriteResult(job.handle.seq, False, error=str(exc))
                error = (
                    f"{type(exc).__name__}: {exc}" if not isinstance(exc, WriterDied) else str(exc)
                )
            finally:
                job.handle.staged.set()
                job.handle.written.set()
            if error is None:
                now = time.monotonic()
                job.handle.info = SaveInfo(
                    path=job.handle.path,
                    file=job.handle.file,
                    rank=self.rank,
                    world_size=self.world_size,
                    nbytes=job.nbytes,
                    file_bytes=result.nbytes,
                    staged_seconds=job.staged_at - job.requested,
                    durable_seconds=now - job.requested,
                    write_seconds=result.seconds,
                )
                events.emit(
                    "ckpt_durable",
                    duration=now - job.requested,
                    bytes=result.nbytes,
                    write_seconds=result.seconds,
                    throughput=job.handle.info.throughput,
                    path=job.handle.path,
                )
                self._results.put(("durable", job))
            if self.distributed:
                self._commits.put(_CommitItem(job, job.commit_key, job.handle.path, error))
            else:
                self._finish(job, {} if error is None else {0: error})

    def _write(self, job: _Job) -> WriteResult:
        file = job.handle.file
        os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
        if self.distributed:
            _commit.remove_marker(job.handle.path)
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
            result = self._writer.result()
        except WriterDied:
            with contextlib.suppress(OSError):
                os.unlink(file + ".tmp")
            try:  # replace it now, so the next save does not wait for a start
                self._writer.start()
            except WriterDied as exc:
                logger.warning("restarting the checkpoint writer failed (%s); will retry", exc)
            raise
        assert result is not None and result.job_id == job.handle.seq
        return result

    def _commit_key(self, path: str) -> str:
        """Store prefix for this save: the path and how often this rank has saved to it.

        Every rank computes the same key for the same save, whatever it did with earlier ones
        (a rank that skips or fails a save still reports it), so a late rank can never count
        toward the wrong checkpoint.
        """
        if not self.distributed:
            return ""
        n = self._occurrences.get(path, 0)
        self._occurrences[path] = n + 1
        digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
        return f"{self._key_base}/{digest}/{n}"

    def _run_commits(self) -> None:
        while True:
            item = self._commits.get()
            if item is None:
                return
            try:
                causes = _commit.report(
                    self._store,
                    item.key,
                    rank=self.rank,
                    world_size=self.world_size,
                    error=item.error,
                    directory=item.path,
                    marker_info={
                        "world_size": self.world_size,
                        "format": item.job.format if item.job else None,
                    },
                    timeout=self.commit_timeout,
                )
            except Exception as exc:
                causes = {self.rank: f"store failed during commit: {exc}"}
            if item.job is None:
                continue  # this rank already knows (save() raised or returned None)
            if causes and item.error is None:  # another rank failed: leave no part behind
                with contextlib.suppress(OSError):
                    os.unlink(item.job.handle.file)
            self._finish(item.job, causes)

    def _finish(self, job: _Job, causes: dict[int, str]) -> None:
        handle = job.handle
        if causes:
            handle.error = CheckpointWriteError(
                f"checkpoint {handle.path} failed; the previous checkpoint is still the latest",
                causes=causes,
            )
            events.emit("ckpt_failed", path=handle.path, causes=causes)
            self._results.put(("failed", job))
        else:
            events.emit(
                "ckpt_committed",
                duration=time.monotonic() - job.requested,
                path=handle.path,
                world_size=self.world_size,
            )
            self._results.put(("committed", job))
        job.flat = None
        handle.finished.set()
