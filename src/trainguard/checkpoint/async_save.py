"""AsyncCheckpointer: save without stopping training; load and find checkpoints.

The training loop pays only for copying the state into a reusable shared-memory staging buffer
(or nothing, with ``overlap=True``); one persistent writer process per checkpointer makes the
file durable. See :class:`AsyncCheckpointer` for the protocol.

Over 400 lines: one class, the training thread's half of the protocol in the order a caller
meets it (bind, save, the staging fence, poll and wait, and the three ways to end: close,
abandon, give up). The rest already lives beside it: the background half in
:mod:`._save_work`, the round binding in :mod:`._rebind`, a save's records and the outcomes
of those not finished in :mod:`._saves`, the commit in :mod:`._commit`, the settings in
:mod:`.options`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainguard import _progress, _settings, _timeouts, events
from trainguard.checkpoint import _commit, _link, _onerror, _overwrite, _rebind
from trainguard.checkpoint._closing import Closing
from trainguard.checkpoint._load import latest, load, part_name
from trainguard.checkpoint._save_work import SaveWorker, serve_holding, stop_serving
from trainguard.checkpoint._saves import Job, Outcomes, SaveHandle, SaveInfo
from trainguard.checkpoint.format.kinds import FORMATS
from trainguard.checkpoint.format.layout import flatten
from trainguard.checkpoint.format.write import check_header_fits, place
from trainguard.checkpoint.options import AsyncOptions
from trainguard.checkpoint.staging import Stager
from trainguard.checkpoint.writer import WriterProcess
from trainguard.errors import CheckpointError, CheckpointWriteError, ConfigError, WriterDied

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["AsyncCheckpointer", "SaveHandle", "SaveInfo", "latest", "load", "part_name"]

# load and latest live in _load.py, SaveHandle and SaveInfo in _saves.py (one concept per
# module); they are part of this API.

logger = logging.getLogger(__name__)

_Item = tuple[Callable[[Any], None], Any]  # (handle, job): a Job, a Report, or an Event

_IF_BUSY = ("wait", "skip")
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
        staging_threads, pin_memory, fsync, commit_timeout, writer_nice, start_timeout,
            close_timeout, key_prefix, overwrite, on_error: the settings, as :class:`~.options.AsyncOptions`
            describes them (one field each); timeouts in seconds or as a ``timedelta``.
        options: those settings as one :class:`~.options.AsyncOptions` instead of as
            keywords; :attr:`options` holds them either way.
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
        overwrite: bool = True,
        on_error: str = "report",
        options: AsyncOptions | None = None,
    ) -> None:
        built = AsyncOptions(
            staging_threads=staging_threads,
            pin_memory=pin_memory,
            fsync=fsync,
            commit_timeout=commit_timeout,
            writer_nice=writer_nice,
            start_timeout=start_timeout,
            close_timeout=close_timeout,
            key_prefix=key_prefix,
            overwrite=overwrite,
            on_error=on_error,
        )
        #: The settings, checked (built from the keywords unless given as ``options``).
        self.options = opts = _settings.chosen(options, built, "AsyncCheckpointer")
        self._failures = _onerror.FailurePolicy(opts.on_error, "AsyncCheckpointer")
        self.commit_timeout = opts.commit_timeout
        start = opts.start_timeout
        self.close_timeout = opts.close_timeout
        started = time.monotonic()
        _link.resolve(store, rank, world_size)  # bad arguments fail here
        self.fsync = opts.fsync
        threads = opts.staging_threads or min(4, os.cpu_count() or 1)
        self._stager = Stager(threads=threads, pin=opts.pin_memory)
        self._writer = WriterProcess(nice=opts.writer_nice, start_timeout=start)
        self._seq = itertools.count()
        # jobs, and reports of saves that never reached the writer, in save order (see _commit)
        self._jobs: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()  # see serve_holding
        self._outcomes = Outcomes()  # the saves not finished yet, and what was reported
        self._last: Job | None = None
        self._hooks: list[Any] = []
        self._closed = False
        try:
            self._writer.start()
        except WriterDied as exc:
            raise CheckpointWriteError(str(exc)) from exc
        self._slot = _rebind.RoundBinding(key_prefix=opts.key_prefix, timeout=self.commit_timeout)
        self._worker = SaveWorker(
            stager=self._stager,
            writer=self._writer,
            slot=self._slot,
            results=self._outcomes.results,
            fsync=opts.fsync,
            close_timeout=self.close_timeout,
            overwrite=opts.overwrite,
        )
        self._slot.bind(store, rank, world_size, started=started)
        self._thread = threading.Thread(target=serve_holding, args=(self._jobs,), daemon=True)
        self._thread.name = "trainguard-ckpt"
        self._thread.start()
        then = [self._slot.close, self._writer.stop, self._stager.close]  # if never closed
        self._release_when_collected(stop_serving, self._jobs, self._thread, then)

    @property
    def rank(self) -> int:
        """This rank in the round the checkpointer is bound to."""
        return self._slot.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the round the checkpointer is bound to."""
        return self._slot.world_size

    @property
    def distributed(self) -> bool:
        """Whether the ranks commit together (a store is used)."""
        return self._slot.distributed

    def bind(
        self, store: Store | None = None, *, rank: int | None = None, world_size: int | None = None
    ) -> None:
        """Re-bind to a new round; every rank calls it (after its ``init_process_group``).

        Not needed with torch.distributed: before ``save``, ``poll`` and ``wait`` the
        checkpointer checks whether the default process group changed (a restart round
        initialized it again) and re-binds by itself. Call it when it was given a ``store``
        (or ``rank``/``world_size``): pass the new round's. Saves of the previous round not yet
        committed are given up (they fail on every rank of that round; after a fault they
        could never commit) and their errors logged, not raised; the writer process, staging
        buffer and hooks are kept.
        """
        self._check_open()
        started = time.monotonic()
        flushed = threading.Event()
        self._jobs.put((_rebind.set_event, flushed))  # the queued saves reach the committer
        flushed.wait()
        _rebind.retire(self._slot, self._outcomes, self.commit_timeout)
        self._slot.bind(store, rank, world_size, started=started)

    def _ensure_bound(self) -> None:
        """Re-bind first when a new round began (see :meth:`bind`)."""
        self._check_open()
        if self._slot.changed():
            self.bind()

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
        others, which name it as the cause; a save that raises here does the same). An earlier failed save is reported or raised first (``on_error``). Objects JSON cannot hold
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
        committer = self._slot.committer
        key = committer.key(path) if committer is not None else ""
        if self._busy(path, key, if_busy):
            return None
        try:
            target = path
            if self.distributed:
                busy = any(h.path == path for h in self._outcomes.open())
                target = _overwrite.write_dir(
                    path, seed=key, overwrite=self.options.overwrite, busy=busy
                )
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
            if target != path:
                job.write_file = os.path.join(target, part_name(self.rank, format))
            job.retired = replaced
            if any(e.source.is_cuda for e in flat.entries):
                job.cuda_stream = torch.cuda.current_stream()
            if not overlap:
                self._worker.stage(job)
        except Exception as exc:  # raised here; the other ranks learn it through the store
            if self.distributed:
                self._jobs.put(
                    (self._worker.one, _commit.Report(key, path, f"{type(exc).__name__}: {exc}"))
                )
            raise
        self._last = job
        self._outcomes.pending.append(handle)
        self._jobs.put((self._worker.one, job))
        _progress.mark()
        return handle

    def _busy(self, path: str, key: str, if_busy: str) -> bool:
        """Wait until the previous save is written; True (skip this one) instead with
        ``if_busy="skip"`` while it is still being written."""
        last = self._last
        if last is None or last.handle.written.is_set():
            return False
        if if_busy == "skip":
            events.emit("ckpt_skipped", path=path, busy_with=last.handle.path)
            logger.info("checkpoint %s skipped: %s is still being written", path, last.handle.path)
            if self.distributed:  # the other ranks' parts of it cannot be committed
                reason = f"skipped the save (if_busy='skip'): {last.handle.path} was busy"
                self._jobs.put((self._worker.one, _commit.Report(key, path, reason)))
            return True
        last.handle.written.wait()
        return False

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
        """Run callbacks of finished saves in this thread; a failed save is reported (the
        default) or raised, as ``on_error`` says. Never blocks (except to re-bind to a new
        round, see :meth:`bind`)."""
        self._ensure_bound()
        self._deliver()

    def _deliver(self) -> None:
        """Hand the finished saves' outcomes to this thread; a failure goes to ``on_error``."""
        try:
            self._outcomes.deliver()
        except CheckpointWriteError as exc:
            self._failures.handle(exc)

    @property
    def failures(self) -> list[CheckpointError]:
        """The background failures reported so far (``on_error="report"``), oldest first."""
        return list(self._failures.failures)

    def wait(self, timeout: _timeouts.Timeout | None = None) -> None:
        """Block until every pending save is committed or failed, then :meth:`poll`.

        Bounded: at most ``timeout`` (seconds or a ``timedelta``; None: ``close_timeout``). A
        save not done by then (it goes on) and a save that failed are
        :class:`CheckpointWriteError` errors that ``on_error`` reports (the default) or raises.
        """
        limit = _timeouts.optional_seconds("timeout", timeout)
        if limit is None:
            limit = self.close_timeout
        self._ensure_bound()
        late = self._outcomes.late(time.monotonic() + limit)
        if late is not None:
            error = CheckpointWriteError(f"checkpoint {late.path} not done within {limit:g} s")
            self._failures.handle(error)
        self._deliver()

    def close(self, *, abandon: bool = False) -> None:
        """Wait for pending saves, stop the writer, free buffers, threads and hooks.

        The error of a failed pending save is reported or raised (``on_error``) after everything
        is freed. Idempotent. ``abandon=True`` (e.g. from a restart's finalize hook, when a rank the commit waits for
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
            elif self._thread.is_alive() and self._outcomes.late(deadline) is not None:
                self._give_up()
            else:
                self._deliver()
        except BaseException as exc:
            error = exc
        finally:
            self._shutdown()
        if error is not None:
            raise error

    def _abandon(self, deadline: float) -> None:
        pending = self._outcomes.open()
        committer = self._slot.committer
        if committer is not None and pending:
            reason = "abandoned: rank closed the checkpointer with abandon=True"
            committer.abandon([h.commit_key for h in pending], reason)
            events.emit("ckpt_abandoned", paths=[h.path for h in pending])
        try:
            if self._outcomes.late(deadline) is not None:
                self._give_up()
        except CheckpointWriteError as exc:
            logger.warning("%s", exc)
        with contextlib.suppress(CheckpointError):
            self._outcomes.deliver()

    def _give_up(self) -> None:
        """close_timeout has passed: kill the writer, fail the pending saves, raise."""
        pending = self._outcomes.open()
        reason = f"close() gave up after close_timeout={self.close_timeout:g} s"
        self._worker.give_up()  # the background thread kills a writer still at work
        if self._slot.committer is not None:
            self._slot.committer.abandon([h.commit_key for h in pending], reason)
        self._outcomes.late(time.monotonic() + _GRACE)  # they fail at once now
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
        self._slot.close()
        self._writer.stop()
        if self._last is not None and self._last.retired is not None:
            self._last.retired.close()
        self._stager.close()
        self._last = None
