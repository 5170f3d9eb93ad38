"""The persistent background writer process and its protocol.

One :class:`WriterProcess` per checkpointer: started once with the ``spawn`` context (a fresh
interpreter: no forked copy of the training process, its threads or its CUDA context), it runs
at lowered CPU and I/O priority and writes every save of that checkpointer. It imports neither
the training script (see :func:`_main_hidden`) nor torch, unless asked for ``format="torch"``.

Protocol, over one duplex pipe (parent -> writer, then the writer's reply)::

    writer  -> ("ready", pid)                               handshake after start
    parent  -> ("attach", buffer_id, nbytes) + the memfd    (send_handle) map a staging buffer
    parent  -> ("detach", buffer_id)                        unmap it
    parent  -> ("write", WriteJob)
    writer  -> ("done", WriteResult)                        one per write, in order; a failed
                                                            write has ok=False and the error
    parent  -> None                                         stop sentinel
    writer  -> ("bye",)

Jobs are answered in order. If the parent dies, the writer finishes the job at hand (its bytes
are a consistent snapshot) and exits when it reads end-of-file. If the writer dies, the parent
sees its sentinel; :meth:`WriterProcess.result` raises :class:`WriterDied`.

Every caller sends its jobs and waits for their answers through the methods this handle
inherits from :class:`~trainguard.checkpoint._writing.Writing` (``send``, ``wait``, or both as
``write``), whose docstring holds the one wait policy.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import errno
import logging
import mmap
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import platform
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, NoReturn

from trainguard.checkpoint._writing import WriteJob, WriteResult, Writing
from trainguard.checkpoint.format import tmpfile
from trainguard.checkpoint.format.write import fsync_dir, write_file
from trainguard.errors import WriterDied

__all__ = ["WriteJob", "WriteResult", "WriterDied", "WriterProcess"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- writer side


def _lower_priority(nice: int) -> None:
    with contextlib.suppress(OSError):
        os.nice(nice)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    # ioprio_set(IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_BE << 13 | 7): lowest best-effort I/O.
    number = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}.get(platform.machine())
    if number is not None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.syscall(number, 1, 0, (2 << 13) | 7) != 0:
                logger.debug("ioprio_set failed: errno %d", ctypes.get_errno())
        except OSError:
            pass


def _write_torch(job: WriteJob, data: memoryview) -> int:
    import torch

    from trainguard.checkpoint.format.layout import unflatten

    tensors = {}
    for e in job.placed:
        if e.nbytes:
            tensors[e.name] = torch.frombuffer(
                data[e.offset : e.offset + e.nbytes], dtype=torch.uint8
            )
        else:
            tensors[e.name] = torch.empty(0, dtype=torch.uint8)
    state = unflatten(job.skeleton, tensors, allow_pickle=True)
    fd, tmp = tmpfile.create(job.path)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            if job.fsync:
                os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
            tmpfile.publish(f.fileno(), tmp, job.path)
    except BaseException:
        tmpfile.discard(tmp)
        raise
    if job.fsync:
        fsync_dir(os.path.dirname(os.path.abspath(job.path)))
    return size


def _run_job(job: WriteJob, maps: dict[int, mmap.mmap], hasher: Any) -> WriteResult:
    started = time.monotonic()
    try:
        mm = maps[job.buffer_id]
        with memoryview(mm) as data:
            if job.format == "torch":
                nbytes = _write_torch(job, data)
            else:
                nbytes = write_file(
                    job.path, data, job.placed, job.metadata, fsync=job.fsync, hasher=hasher
                )
        return WriteResult(job.job_id, True, nbytes, time.monotonic() - started)
    except Exception as exc:
        code = getattr(exc, "errno", None)
        text = f"{type(exc).__name__}: {exc}"
        if code is not None and code in errno.errorcode:
            text = f"{errno.errorcode[code]} ({os.strerror(code)}) writing {job.path}"
        return WriteResult(job.job_id, False, 0, time.monotonic() - started, text, code)


def _writer_main(conn: multiprocessing.connection.Connection, nice: int) -> None:
    """Entry point of the writer process."""
    # Ctrl-C reaches the whole foreground process group: the training process decides what to
    # do (close() finishes pending saves); the writer must not die with a half-written file.
    # SIGTERM too: a preemption signals every process of the job, and the training process
    # saves its last checkpoint through this writer (it ends when the training process does).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _lower_priority(nice)
    maps: dict[int, mmap.mmap] = {}
    hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainguard-hash")
    conn.send(("ready", os.getpid()))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the parent died: nothing more will come
            if msg is None:
                conn.send(("bye",))
                break
            op = msg[0]
            if op == "attach":
                fd = multiprocessing.reduction.recv_handle(conn)
                try:
                    maps[msg[1]] = mmap.mmap(fd, msg[2], mmap.MAP_SHARED)
                finally:
                    os.close(fd)
            elif op == "detach":
                mm = maps.pop(msg[1], None)
                if mm is not None:
                    mm.close()
            elif op == "write":
                result = _run_job(msg[1], maps, hasher)
                with contextlib.suppress(OSError):
                    conn.send(("done", result))
    finally:
        hasher.shutdown()
        for mm in maps.values():
            with contextlib.suppress(BufferError):
                mm.close()


# --------------------------------------------------------------------------- parent side

_start_lock = threading.Lock()


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """Start a spawn child without re-running the program's main module in it.

    ``spawn`` normally imports the parent's ``__main__`` again in the child (to find functions
    defined there). The writer needs none of it: its entry point lives in this module. Hiding
    ``__main__``'s file and spec while the child is launched keeps the writer from importing the
    training script (and torch, and whatever that imports), which makes it start in a fraction
    of a second and keeps an unguarded script from running twice.
    """
    main = sys.modules.get("__main__")
    with _start_lock:
        if main is None:
            yield
            return
        saved: dict[str, Any] = {
            k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__
        }
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


#: writer processes started by this process and maybe still running (see _end_at_exit)
_STARTED: weakref.WeakSet[Any] = weakref.WeakSet()
_AT_EXIT: list[bool] = []


def _end_at_exit() -> None:
    """At interpreter exit, SIGKILL the writers of checkpointers that were never closed.

    A writer ignores SIGTERM (a preemption signals every process of the job, and the writer
    must finish the last save), so multiprocessing's own exit handler, which SIGTERMs daemonic
    children and then joins them, would wait for it forever. Registered after the first
    writer started, so it runs before that handler (atexit runs last-registered first)."""
    for proc in list(_STARTED):
        with contextlib.suppress(Exception):
            if proc.is_alive():
                proc.kill()
                proc.join(5)


class WriterProcess(Writing):
    """Handle on one writer process (see the module docstring for the protocol).

    Args:
        nice: added to the writer's nice value (lower CPU priority); its I/O priority is set to
            the lowest best-effort level and its scheduling policy to SCHED_BATCH.
        start_timeout: seconds to wait for the handshake.

    Used from one thread at a time (the checkpointer's background thread).
    """

    def __init__(self, *, nice: int = 10, start_timeout: float = 120.0) -> None:
        self.nice = nice
        self.start_timeout = start_timeout
        self._proc: Any = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._attached: set[int] = set()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(
            target=_writer_main, args=(child, self.nice), name="trainguard-writer", daemon=True
        )
        with _main_hidden():
            proc.start()
        _STARTED.add(proc)
        if not _AT_EXIT:
            _AT_EXIT.append(True)
            atexit.register(_end_at_exit)
        child.close()
        ready = multiprocessing.connection.wait([parent, proc.sentinel], self.start_timeout)
        if parent not in ready:
            with contextlib.suppress(Exception):
                proc.kill()
            proc.join(5)
            parent.close()
            raise WriterDied(
                f"the checkpoint writer did not start within {self.start_timeout} s "
                f"(exit code {proc.exitcode})"
            )
        msg = parent.recv()
        assert msg[0] == "ready", msg
        self._proc, self._conn = proc, parent
        self._attached = set()
        logger.debug("checkpoint writer started, pid %d", proc.pid)

    def attach(self, buffer_id: int, fd: int, nbytes: int) -> None:
        assert self._conn is not None and self._proc is not None
        try:
            self._conn.send(("attach", buffer_id, nbytes))
            multiprocessing.reduction.send_handle(self._conn, fd, self._proc.pid)
        except OSError:  # it died since the caller's prepare() found it alive
            self._died()
        self._attached.add(buffer_id)

    def is_attached(self, buffer_id: int) -> bool:
        return buffer_id in self._attached

    def detach(self, buffer_id: int) -> None:
        if self._conn is not None and buffer_id in self._attached:
            self._attached.discard(buffer_id)
            with contextlib.suppress(OSError):
                self._conn.send(("detach", buffer_id))

    def submit(self, job: WriteJob) -> None:
        assert self._conn is not None
        try:
            self._conn.send(("write", job))
        except OSError:
            self._died()

    def result(self, timeout: float | None = None) -> WriteResult | None:
        """The next job's result; None after ``timeout``; :class:`WriterDied` if it died."""
        assert self._conn is not None and self._proc is not None
        ready = multiprocessing.connection.wait([self._conn, self._proc.sentinel], timeout)
        if not ready:
            return None
        try:
            if self._conn in ready or self._conn.poll():
                msg = self._conn.recv()
                if msg[0] == "done":
                    result: WriteResult = msg[1]
                    return result
        except (EOFError, OSError):
            pass
        self._died()

    def _died(self) -> NoReturn:
        """Reap the writer, found dead, and raise :class:`WriterDied` with how it ended."""
        assert self._proc is not None
        self._proc.join(1)
        if self._proc.is_alive():  # its pipe broke, yet it runs: end it
            self._proc.kill()
            self._proc.join(5)
        code = self._proc.exitcode
        self._reap()
        raise WriterDied(
            "the checkpoint writer process died"
            + (f" (signal {-code})" if code is not None and code < 0 else f" (exit code {code})")
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Send the stop sentinel, wait for the writer to exit (killed after ``timeout``)."""
        if self._proc is None:
            return
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("checkpoint writer did not stop within %s s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        self._reap()

    def kill(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.kill()
            self._proc.join(5)
        self._reap()

    def _reap(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            with contextlib.suppress(ValueError):
                self._proc.close()
        self._proc, self._conn = None, None
        self._attached = set()
