"""Warm workers: a process per node started ahead, past its imports, that a respawn takes over.

Without an idle spare a dead worker's place waits for a whole new process, most of it imports
(torch alone: seconds, more on a loaded host). With ``--tg-warm-workers N`` the agent keeps N
processes of :mod:`trainguard.launch._warmboot` waiting. A respawn (:meth:`WarmPool.replace`)
hands the oldest live one the slot's command line, environment and log files; it runs the
user's entry with :mod:`runpy` in place of a cold ``python -u script``. Then a new warm one is
started (its imports run in the background, in its own process). The agent process starts them
from its monitor thread, the thread that lives as long as the agent: the warm processes ask for
``SIGKILL`` when that thread ends (``PR_SET_PDEATHSIG``), so none outlives an agent that was
killed; :meth:`WarmPool.close` ends them when the agent stops its workers.

A respawn is cold (torch's handler, as without this option) when no warm process is alive, or
the command is not ``python -u [-m] TARGET ...`` with this interpreter (``--no-python``), or
torch binds workers to NUMA nodes (``--numa-binding``: the binding wraps the command line).

Protocol (all from the agent's monitor thread): :meth:`WarmPool.start` once the workers of a
generation run, :meth:`WarmPool.replace` for each respawn, :meth:`WarmPool.close` when they stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from trainguard.launch import _compat
from trainguard.launch._compat import WorkerLaunch

__all__ = ["WarmPool", "WarmProcess", "entry"]

logger = logging.getLogger(__name__)

#: warm processes that died before they were used, after which the pool starts no more.
MAX_FAILED = 3


def entry(launch: WorkerLaunch) -> tuple[str, str] | None:
    """``("script", path)`` or ``("module", name)`` when ``launch`` is ``python -u [-m] X``
    with this interpreter and no NUMA binding; else ``None`` (a respawn stays cold)."""
    args = [str(a) for a in launch.args]
    if launch.entrypoint != sys.executable or launch.numa_options is not None:
        return None
    if len(args) < 2 or args[0] != "-u":
        return None
    if args[1] == "-m":
        return ("module", args[2]) if len(args) > 2 else None
    if args[1].startswith("-"):
        return None
    return ("script", args[1])


class WarmProcess:
    """One waiting process (its ``Popen``) and the pipe that says its imports are done."""

    def __init__(self, kind: str, target: str, env: dict[str, str]) -> None:
        read, write = os.pipe()
        command = [sys.executable, "-u", "-m", "trainguard.launch._warmboot"]
        command += [str(os.getpid()), str(write), kind, target]
        try:
            self.proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.PIPE,
                pass_fds=(write,),
                start_new_session=True,
            )
        finally:
            os.close(write)
        os.set_blocking(read, False)
        self._ready_fd: int | None = read
        self.ready = False
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def poll_ready(self) -> bool:
        """Whether its imports are done (reads the pipe without blocking)."""
        if not self.ready and self._ready_fd is not None:
            with contextlib.suppress(BlockingIOError):
                self.ready = os.read(self._ready_fd, 1) == b"r"
            if self.ready:
                self._close_pipe()
        return self.ready

    def hand(self, launch: WorkerLaunch, env: dict[str, str]) -> None:
        """Make it the worker ``launch`` describes (the order of :mod:`._warmboot`)."""
        order = {
            "env": env,
            "argv": [str(a) for a in launch.args[1:]],
            "stdout": launch.stdout or None,
            "stderr": launch.stderr or None,
        }
        for path in (launch.stdout, launch.stderr):  # there at once, as torch's handler has them
            if path:
                with open(path, "w"):
                    pass
        assert self.proc.stdin is not None
        data = (json.dumps(order) + "\n").encode()
        if len(data) > 60000:  # a process still importing reads it later: never block on it
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, len(data) + 4096)
        self.proc.stdin.write(data)
        self.proc.stdin.close()
        self._close_pipe()

    def kill(self) -> None:
        """SIGKILL its process group and reap it (a reaped one's id may be another's: no
        signal then)."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None


class WarmPool:
    """Up to ``size`` warm processes of one agent (see the module docstring).

    ``emit(kind, **fields)`` records the pool's events (``launch_warm_started``, and
    ``launch_warm_ready`` with the seconds its imports took).
    """

    def __init__(self, size: int, emit: Callable[..., object] | None = None) -> None:
        self.size = size
        self.emit = emit
        self.waiting: list[WarmProcess] = []
        self.failed = 0
        self._entry: tuple[str, str] | None = None
        self._env: dict[str, str] = {}

    def start(self, context: SubprocessContext) -> None:
        """Fill the pool for the workers of ``context`` (just started by torch)."""
        self.close()
        if self.size <= 0 or not context.subprocess_handlers:
            return
        first = _compat.launch_of(context, min(context.subprocess_handlers))
        self._entry = entry(first)
        if self._entry is None:
            logger.info("warm workers off: the worker command is not python -u [-m] TARGET")
            return
        self._env = dict(os.environ, **first.env)  # a node's worker environment
        self._fill()

    def _fill(self) -> None:
        self.waiting = [w for w in self.waiting if w.alive() or self._lost(w)]
        while self._entry is not None and len(self.waiting) < self.size:
            if self.failed >= MAX_FAILED:
                return
            kind, target = self._entry
            warm = WarmProcess(kind, target, self._env)
            self.waiting.append(warm)
            if self.emit is not None:
                self.emit("launch_warm_started", worker_pid=warm.pid)

    def _lost(self, warm: WarmProcess) -> bool:
        """A warm process that died unused: counted, reaped, dropped (returns False)."""
        self.failed += 1
        logger.warning("warm worker pid %d exited unused (%s)", warm.pid, warm.proc.returncode)
        warm.kill()
        return False

    def poll(self) -> None:
        """Record the waiting processes whose imports just finished (``launch_warm_ready``)."""
        for warm in self.waiting:
            if not warm.ready and warm.poll_ready() and self.emit is not None:
                seconds = time.monotonic() - warm.started
                self.emit("launch_warm_ready", worker_pid=warm.pid, seconds=seconds)

    def take(self) -> WarmProcess | None:
        """The oldest live warm process, out of the pool (the ready ones first)."""
        self.waiting = [w for w in self.waiting if w.alive() or self._lost(w)]
        if not self.waiting:
            return None
        ready = [w for w in self.waiting if w.poll_ready()]
        warm = (ready or self.waiting)[0]
        self.waiting.remove(warm)
        return warm

    def replace(
        self, context: SubprocessContext, local_rank: int, launch: WorkerLaunch
    ) -> tuple[SubprocessHandler, bool]:
        """Start ``local_rank``'s next process: a warm one when there is one (then the pool is
        filled again), else cold (:func:`_compat.replace`). Returns its handler and whether it
        was warm."""
        warm = self.take() if entry(launch) == self._entry else None
        if warm is None:
            return _compat.replace(context, local_rank, launch), False
        env = dict(os.environ, **launch.env)  # what torch's handler gives a cold start
        try:
            warm.hand(launch, env)
        except OSError as exc:  # it died between the check and the order
            logger.warning("warm worker pid %d could not take over (%s)", warm.pid, exc)
            warm.kill()
            self.failed += 1
            return _compat.replace(context, local_rank, launch), False
        new = _compat.adopt(context, local_rank, warm.proc)
        self._fill()
        return new, True

    def close(self) -> None:
        """End every waiting process (SIGKILL, reaped)."""
        waiting, self.waiting = self.waiting, []
        for warm in waiting:
            warm.kill()
