"""The one helper for multi-rank tests: start N real ranks, collect what each returned.

Each rank is a separate process that runs an importable function with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT set in its
environment. Ranks are forked from a forkserver that has imported torch once (a spawned
interpreter pays ~2 s of CPU to import torch, per rank, per test); everything else is as with
the spawn context: the rank gets the test process's environment as it is at start, a fresh
``trainguard`` and fresh ``torch.distributed`` state. Each rank leads a process group of its
own, so everything it starts (sidecars, store servers, writer processes) can be found and
killed with it.

    results = run_ranks(fn, 4, args=(...), timeout=60)
    values = [r.get() for r in results]          # raises with the rank's traceback if it failed

For fault tests, :class:`RankGroup` gives control while the ranks run::

    with RankGroup(fn, 4, timeout=60) as group:
        group.start()
        group.wait_until(lambda: marker.exists(), timeout=30)
        group.kill(2)                          # SIGKILL rank 2's process only
        results = group.join()

On the hard timeout every rank's whole process group is killed and the ranks still running are
reported with ``timed_out=True``. After the ranks end, processes they left in their groups are
given a short grace period, then killed and listed in :attr:`RankGroup.leftovers`;
:func:`run_ranks` fails the test if there are any.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: imported once by the forkserver, so that each rank starts in milliseconds; trainguard is not
#: (each rank imports its own, after its environment is set)
_PRELOAD = ["torch", "torch.distributed"]


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class RankResult:
    """What one rank produced: its return value, or the exception it raised, or neither."""

    rank: int
    value: Any = None
    exc_type: str | None = None  # qualified name of the exception's type
    error: str | None = None  # str() of the exception
    traceback: str | None = None
    exception: BaseException | None = None  # the exception itself, when it could be pickled
    exitcode: int | None = None
    timed_out: bool = False
    returned: bool = False

    @property
    def ok(self) -> bool:
        return self.returned and self.exc_type is None

    def get(self) -> Any:
        """The return value, or an AssertionError that carries the rank's traceback."""
        if self.ok:
            return self.value
        if self.timed_out:
            raise AssertionError(f"rank {self.rank} was still running at the timeout (killed)")
        if self.exc_type is not None:
            raise AssertionError(
                f"rank {self.rank} raised {self.exc_type}: {self.error}\n{self.traceback}"
            )
        raise AssertionError(f"rank {self.rank} died without a result (exit code {self.exitcode})")


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    conn: multiprocessing.connection.Connection,
) -> None:
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # lead a group of our own: our descendants die with us on a kill
    os.environ.clear()  # the environment of the test process at start, not the forkserver's
    os.environ.update(env)
    try:
        value = fn(*args, **kwargs)
        payload: dict[str, Any] = {"value": value}
    except BaseException as exc:  # report everything, KeyboardInterrupt and SystemExit too
        payload = {
            "exc_type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "error": str(exc),
            "traceback": traceback.format_exc(),
            "exception": exc,
        }
    try:
        conn.send(payload)
    except Exception as exc:  # the value or the exception could not be pickled
        payload.pop("exception", None)
        if "value" in payload:
            payload = {
                "exc_type": "PicklingError",
                "error": f"rank {rank}'s return value could not be sent: {exc!r}",
                "traceback": "",
            }
        conn.send(payload)
    conn.close()


def proc_stat(pid: int | str) -> list[str] | None:
    """Fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def process_with_pid(pid: int, until: float) -> subprocess.Popen[bytes] | None:
    """A process (``sleep 60``) that leads a session and process group of its own and has pid
    ``pid``, made as soon as ``pid`` is free: the kernel's next pid is set (``ns_last_pid``,
    as root) before each try. None if it could not be had by ``until`` (``time.monotonic``);
    skips the test where the next pid cannot be set."""
    last = Path("/proc/sys/kernel/ns_last_pid")
    while time.monotonic() < until:
        try:
            last.write_text(str(pid - 1))
        except OSError:
            import pytest

            pytest.skip("cannot set the next pid here (/proc/sys/kernel/ns_last_pid)")
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()  # the pid was still held (not reaped yet), or another process took it
        proc.wait()
        time.sleep(0.005)
    return None


def live_processes() -> dict[int, list[str]]:
    """pid -> stat fields (see :func:`proc_stat`) of every process that is not a zombie."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := proc_stat(entry)) is not None and fields[0] != "Z":
            out[int(entry)] = fields
    return out


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``."""
    return [pid for pid, fields in live_processes().items() if int(fields[2]) == pgid]


class RankGroup:
    """N ranks of one test job; see the module docstring.

    Args:
        fn: an importable (module-level) function, called as ``fn(*args, **kwargs)`` per rank.
        world_size: number of rank processes.
        args, kwargs: passed to ``fn`` on every rank.
        timeout: hard limit in seconds for the whole group, counted from :meth:`start`.
        env: extra environment for every rank.
        rank_env: per-rank extra environment, ``rank -> dict``.
        leftover_grace: seconds that processes left behind by ranks get to exit on their own.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        rank_env: Callable[[int], Mapping[str, str]] | None = None,
        leftover_grace: float = 10.0,
    ) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.fn = fn
        self.world_size = world_size
        self.args = tuple(args)
        self.kwargs = dict(kwargs or {})
        self.timeout = timeout
        self.env = dict(env or {})
        self.rank_env = rank_env
        self.leftover_grace = leftover_grace
        self.port = free_port()
        self.leftovers: list[int] = []
        self._ctx = _context()
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._results = [RankResult(rank=r) for r in range(world_size)]
        self._deadline = 0.0

    def start(self) -> RankGroup:
        self._deadline = time.monotonic() + self.timeout
        for rank in range(self.world_size):
            self._spawn(rank, {})
        return self

    def respawn(self, rank: int, env: Mapping[str, str] | None = None) -> int:
        """Start one more process of the same job as ``rank`` (same RANK, ``env`` added), as
        a launcher respawns a dead rank. Returns its index: for :meth:`pid`, :meth:`kill`
        and in :meth:`join`'s results (after the ``world_size`` first ones)."""
        self._results.append(RankResult(rank=rank))
        self._spawn(rank, dict(env or {}))
        return len(self._procs) - 1

    def _spawn(self, rank: int, extra: dict[str, str]) -> None:
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "TG_TEST_JOB": str(self.port),  # names the job (processes it starts inherit it)
            **self.env,
            **(self.rank_env(rank) if self.rank_env else {}),
            **extra,
        }
        recv, send = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_child_main,
            args=(self.fn, rank, env, self.args, self.kwargs, send),
            name=f"rank{rank}",
            daemon=False,
        )
        proc.start()
        send.close()
        self._procs.append(proc)
        self._conns.append(recv)

    def pid(self, rank: int) -> int:
        """The pid of ``rank``'s process (or of the process :meth:`respawn` returned)."""
        pid = self._procs[rank].pid
        assert pid is not None
        return int(pid)

    def is_alive(self, rank: int) -> bool:
        return bool(self._procs[rank].is_alive())

    def kill(self, rank: int, sig: int = signal.SIGKILL, *, whole_group: bool = False) -> None:
        """Send ``sig`` to rank's process, or to its whole process group (a lost "node")."""
        with contextlib.suppress(ProcessLookupError):
            if whole_group:
                os.killpg(self.pid(rank), sig)
            else:
                os.kill(self.pid(rank), sig)

    def wait_until(
        self, predicate: Callable[[], bool], *, timeout: float, interval: float = 0.01
    ) -> None:
        """Poll ``predicate`` (test side only) until true; AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout} s")
            if all(not p.is_alive() for p in self._procs):
                raise AssertionError("every rank ended before the condition was met")
            time.sleep(interval)

    def join(self) -> list[RankResult]:
        """Wait for every rank (up to the hard timeout) and return the results by rank."""
        pending = dict(enumerate(self._conns))
        alive = dict(enumerate(self._procs))
        while pending or alive:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables: list[Any] = list(pending.values()) + [p.sentinel for p in alive.values()]
            ready = multiprocessing.connection.wait(waitables, timeout=remaining)
            for rank, conn in list(pending.items()):
                if conn in ready:
                    try:
                        payload = conn.recv()
                        self._results[rank].returned = True
                        for key, value in payload.items():
                            setattr(self._results[rank], key, value)
                    except (EOFError, OSError):
                        pass  # died without sending
                    del pending[rank]
            for rank, proc in list(alive.items()):
                if proc.sentinel in ready:
                    proc.join()
                    del alive[rank]
                    # its result may still sit in the pipe; a dead writer means EOF soon
        for rank in list(alive):
            self._results[rank].timed_out = True
        self._kill_all()
        for rank, proc in enumerate(self._procs):
            proc.join(timeout=10)
            self._results[rank].exitcode = proc.exitcode
        for conn in self._conns:
            conn.close()
        self._sweep_leftovers()
        return list(self._results)

    def _kill_all(self) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.is_alive():
                self.kill(rank, signal.SIGKILL, whole_group=True)
                self.kill(rank, signal.SIGKILL)  # in case it had not made its group yet

    def _sweep_leftovers(self) -> None:
        pgids = [p.pid for p in self._procs if p.pid is not None]
        deadline = time.monotonic() + self.leftover_grace
        while True:
            members = [pid for pgid in pgids for pid in _group_members(pgid)]
            if not members or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.leftovers = members
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        if any(p.is_alive() for p in self._procs):
            self._deadline = time.monotonic()  # give up now: kill and collect
            self.join()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
    allow_leftovers: bool = False,
    leftover_grace: float = 10.0,
) -> list[RankResult]:
    """Run ``fn`` on ``world_size`` ranks and return every rank's :class:`RankResult`.

    Fails (AssertionError) if the ranks left processes behind, unless ``allow_leftovers``.
    """
    with RankGroup(
        fn,
        world_size,
        args=args,
        kwargs=kwargs,
        timeout=timeout,
        env=env,
        rank_env=rank_env,
        leftover_grace=leftover_grace,
    ) as group:
        group.start()
        results = group.join()
    if group.leftovers and not allow_leftovers:
        raise AssertionError(f"ranks left processes behind (killed): {group.leftovers}")
    return results
