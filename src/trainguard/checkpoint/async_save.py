"""AsyncCheckpointer: save without stopping training; load and find checkpoints.

The training loop pays only for copying the state into a reusable shared-memory staging buffer
(or nothing, with ``overlap=True``); one persistent writer process per checkpointer makes the
file durable. See :class:`AsyncCheckpointer` for the protocol.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainguard import _progress, _timeouts, events
from trainguard.checkpoint import _commit, _link, _tmpfile
from trainguard.checkpoint._closing import Closing, serve_holding, stop_serving
from trainguard.checkpoint._formats import FORMATS
from trainguard.checkpoint._load import latest, load, part_name
from trainguard.checkpoint._saves import Job, SaveHandle, SaveInfo
from trainguard.checkpoint.fileformat import check_header_fits, place
from trainguard.checkpoint.layout import flatten
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.writer import WriteJob, WriteResult, WriterProcess
from trainguard.errors import CheckpointError, CheckpointWriteError, ConfigError, WriterDied

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["AsyncCheckpointer", "SaveHandle", "SaveInfo", "latest", "load", "part_name"]

# load and latest live in _load.py, SaveHandle and SaveInfo in _saves.py (one concept per
# module); they are part of this API.

logger = logging.getLogger(__name__)

_Item = tuple[Callable[["Job | _commit.Report"], None], "Job | _commit.Report"]

_IF_BUSY = ("wait", "skip")
_SLICE = 0.25  # seconds between looks at a close() that gives up, while the writer works
_GRACE = 30.0  # seconds close() waits for given-up saves to fail


class AsyncCheckpointer(Closing):
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
      and frees everything: no thread, process, shared memory or file descriptor remains. It
      waits at most ``close_timeout``: a writer stuck in I/O is then killed and close() raises.

    Multi-rank commit (see :mod:`trainguard.checkpoint._commit`): each save is one round of
    :class:`trainguard.coord.commit.CommitRound`. The outcome is decided once; the rank that
    completes the round writes the marker only after checking every part was reported durable,
    a rank that times out decides "failed" first (so a late rank cannot commit it), and no
    part is removed unless the decided outcome is "failed".

    Args:
        store: a torch.distributed Store for the commit count (default: the default process
            group's store when torch.distributed is initialized, else single-process).
        rank, world_size: this rank and the number of ranks (default: from torch.distributed).
        staging_threads: threads that copy into the staging buffer (default: up to 4).
        pin_memory: register staging buffers as pinned memory when CUDA is available.
        fsync: make files durable (turn off only for benchmarks of memory-only storage).
        commit_timeout: how long a rank waits for the other ranks' parts before it fails the
            checkpoint (seconds or a ``timedelta``).
        writer_nice: nice increment of the writer process.
        start_timeout: how long to wait for the writer process to start.
        close_timeout: how long :meth:`close` waits for pending saves (their writes and
            commits) before it gives them up: it kills the writer (e.g. stuck in ``fsync``),
            fails their commits on every rank and raises :class:`CheckpointWriteError`.
        key_prefix: prefix of the store keys this checkpointer uses. With several ranks, every
            rank must create its checkpointers in the same order (each gets a generation number
            from the store, so keys of an earlier checkpointer never count for a later one).
    """

    def __init__(
        self,
        *,
        store: Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        staging_threads: int | None = None,
        pin_memory: bool = True,
        fsync: bool = True,
        commit_timeout: _timeouts.Timeout = 300.0,
        writer_nice: int = 10,
        start_timeout: _timeouts.Timeout = 120.0,
        close_timeout: _timeouts.Timeout = 900.0,
        key_prefix: str = "trainguard/ckpt",
    ) -> None:
        if staging_threads is not None and staging_threads < 1:
            raise ConfigError("staging_threads must be >= 1 (or None for the default)")
        self.commit_timeout = _timeouts.seconds("commit_timeout", commit_timeout)
        start = _timeouts.seconds("start_timeout", start_timeout)
        self.close_timeout = _timeouts.seconds("close_timeout", close_timeout)
        if not 0 <= writer_nice <= 19:
            raise ConfigError("writer_nice must be between 0 and 19")
        given, self.rank, self.world_size = _link.resolve(store, rank, world_size)
        self.distributed = given is not None
        self.fsync = fsync
        self._stager = Stager(
            threads=staging_threads or min(4, os.cpu_count() or 1), pin=pin_memory
        )
        self._writer = WriterProcess(nice=writer_nice, start_timeout=start)
        self._seq = itertools.count()
        # jobs, and reports of saves that never reached the writer, in save order (see _commit)
        self._jobs: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()  # see serve_holding
        self._results: queue.SimpleQueue[tuple[str, Job]] = queue.SimpleQueue()
        self._pending: list[SaveHandle] = []
        self._last: Job | None = None
        self._hooks: list[Any] = []
        self._closed = False
        self._giving_up = threading.Event()  # close() gave up: kill a writer that is still busy
        link = None
        if given is not None:
            link = _link.StoreLink.join(given, key_prefix=key_prefix, world_size=self.world_size)
        try:
            self._writer.start()
        except WriterDied as exc:
            raise CheckpointWriteError(str(exc)) from exc
        self._committer: _commit.Committer | None = None
        if link is not None:
            self._committer = _commit.Committer(
                link, rank=self.rank, world_size=self.world_size, timeout=self.commit_timeout
            )
        self._thread = threading.Thread(target=serve_holding, args=(self._jobs,), daemon=True)
        self._thread.name = "trainguard-ckpt"
        self._thread.start()
        then = [self._writer.stop, self._stager.close]  # what close() frees, if never called
        then[:0] = [self._committer.close] if self._committer is not None else []
        self._release_when_collected(stop_serving, self._jobs, self._thread, then)

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

        Every rank calls it with the same ``path``, in the same order. With several ranks,
        ``path`` must not be a committed checkpoint (nor one an earlier save is still
        committing): that raises :class:`CheckpointError` on every rank and leaves it as it was
        (a new path per checkpoint; remove an old one to reuse its name). Returns a
        :class:`SaveHandle`, or None when ``if_busy="skip"`` and the previous save is still
        being written (with several ranks, a rank that skips makes that checkpoint fail on the
        others, which name it as the cause; a save that raises here does the same). Raises the error of an earlier failed save first. Objects JSON cannot hold
        need ``pickle=True`` (and ``allow_pickle=True`` to load). ``format="torch"`` writes a
        file that ``torch.load(weights_only=True)`` reads.
        """
        if format not in FORMATS:
            raise ConfigError(f"format={format!r}; use one of {FORMATS}")
        if if_busy not in _IF_BUSY:
            raise ConfigError(f"if_busy={if_busy!r}; use one of {_IF_BUSY}")
        self._check_open()
        requested = time.monotonic()
        self.poll()
        path = os.fspath(path)
        events.emit("ckpt_requested", path=path, overlap=overlap, format=format)
        key = self._committer.key(path) if self._committer is not None else ""
        last = self._last
        if last is not None and not last.handle.written.is_set():
            if if_busy == "skip":
                events.emit("ckpt_skipped", path=path, busy_with=last.handle.path)
                logger.info(
                    "checkpoint %s skipped: %s is still being written", path, last.handle.path
                )
                if self.distributed:  # the other ranks' parts of it cannot be committed
                    reason = f"skipped the save (if_busy='skip'): {last.handle.path} was busy"
                    self._jobs.put((self._one, _commit.Report(key, path, reason)))
                return None
            last.handle.written.wait()
        try:
            if self.distributed:
                busy = any(h.path == path and not h.finished.is_set() for h in self._pending)
                _commit.refuse_overwrite(path, busy=busy)
            flat = flatten(state, pickle=pickle, allow_sharded=format != "torch")
            placed, data_nbytes = place(flat.entries)
            check_header_fits(placed, flat.skeleton)  # what a reader would refuse
            buffer, replaced = self._stager.ensure(data_nbytes)
            seq = next(self._seq)
            file = os.path.join(path, part_name(self.rank, format)) if self.distributed else path
            handle = SaveHandle(seq, path, file)
            job = Job(
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
                self._jobs.put(
                    (self._one, _commit.Report(key, path, f"{type(exc).__name__}: {exc}"))
                )
            raise
        self._last = job
        self._pending.append(handle)
        self._jobs.put((self._one, job))
        _progress.mark()
        return handle

    def wait_staged(self, timeout: _timeouts.Timeout | None = None) -> None:
        """Block until the latest save's state is in host memory (the fence for overlap=True).

        After it returns the state may change. A failed staging is reported by :meth:`poll`.
        """
        limit = _timeouts.optional_seconds("timeout", timeout)
        job = self._last
        if job is not None and not job.handle.staged.wait(limit):
            raise CheckpointWriteError(f"staging of {job.handle.path} did not finish in {limit} s")

    def protect(self, optimizer: torch.optim.Optimizer) -> None:
        """Fence ``optimizer.step()`` on staging: the step waits until a pending overlapped
        copy has finished, so it can never change a tensor before it is staged."""
        ref = weakref.ref(self)  # the optimizer must not keep this checkpointer alive

        def fence(*_: object) -> None:
            checkpointer = ref()
            if checkpointer is not None:
                checkpointer.wait_staged()

        self._hooks.append(optimizer.register_step_pre_hook(fence))

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

    def wait(self, timeout: _timeouts.Timeout | None = None) -> None:
        """Block until every pending save is committed or failed, then :meth:`poll`.

        ``timeout`` (seconds or a ``timedelta``; None: no bound) raises
        :class:`CheckpointWriteError` when a save is not done by then (it goes on).
        """
        limit = _timeouts.optional_seconds("timeout", timeout)
        late = self._late(None if limit is None else time.monotonic() + limit)
        if late is not None:
            raise CheckpointWriteError(f"checkpoint {late.path} not done within {limit} s")
        self.poll()

    def close(self, *, abandon: bool = False) -> None:
        """Wait for pending saves, stop the writer, free buffers, threads and hooks.

        Raises the error of a failed pending save after everything is freed. Idempotent.
        ``abandon=True`` (e.g. from a restart's finalize hook, when a rank the commit waits for
        may be dead) gives up the saves not yet committed instead of waiting for the other
        ranks: their commit fails at once on every rank, naming this rank's abandonment as the
        cause, and no error is raised here. The previous committed checkpoint stays the latest.

        Waits at most ``close_timeout`` for pending saves: past it, the writer is killed (a
        write stuck in I/O), the saves fail on every rank and :class:`CheckpointWriteError`
        says so (with ``abandon=True`` too, then only logged).
        """
        if self._closed:
            return
        deadline = time.monotonic() + self.close_timeout
        error: BaseException | None = None
        try:
            if abandon:
                self._abandon(deadline)
            elif self._thread.is_alive() and self._late(deadline) is not None:
                self._give_up()
            else:
                self.poll()
        except BaseException as exc:
            error = exc
        finally:
            self._shutdown()
        if error is not None:
            raise error

    def _late(self, deadline: float | None) -> SaveHandle | None:
        """The first pending save not finished (committed or failed) by ``deadline``, if any."""
        for handle in list(self._pending):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handle.finished.wait(remaining):
                return handle
        return None

    def _abandon(self, deadline: float) -> None:
        pending = [h for h in self._pending if not h.finished.is_set()]
        if self._committer is not None and pending:
            reason = "abandoned: rank closed the checkpointer with abandon=True"
            self._committer.abandon([h.commit_key for h in pending], reason)
            events.emit("ckpt_abandoned", paths=[h.path for h in pending])
        try:
            if self._late(deadline) is not None:
                self._give_up()
        except CheckpointWriteError as exc:
            logger.warning("%s", exc)
        with contextlib.suppress(CheckpointError):
            self.poll()

    def _give_up(self) -> None:
        """close_timeout has passed: kill the writer, fail the pending saves, raise."""
        pending = [h for h in self._pending if not h.finished.is_set()]
        reason = f"close() gave up after close_timeout={self.close_timeout:g} s"
        self._giving_up.set()  # the background thread kills a writer still at work
        if self._committer is not None:
            self._committer.abandon([h.commit_key for h in pending], reason)
        self._late(time.monotonic() + _GRACE)  # they fail at once now
        events.emit("ckpt_close_timeout", paths=[h.path for h in pending])
        raise CheckpointWriteError(
            f"{reason}: the checkpoint(s) {[h.path for h in pending]} were still being written "
            "or committed; the writer process was killed (stuck in I/O?) and they failed on "
            "every rank. No committed checkpoint was changed by them; raise close_timeout if "
            "the storage is this slow"
        )

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
        self._closed_explicitly()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._jobs.put(None)
        self._thread.join()
        if self._committer is not None:
            self._committer.close()
        self._writer.stop()
        if self._last is not None and self._last.retired is not None:
            self._last.retired.close()
        self._stager.close()
        self._last = None

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
            _tmpfile.remove_leftovers(file)
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
