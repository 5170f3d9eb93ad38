"""The sidecar service: the launcher's agent watches its workers instead of a node watcher.

Under ``trainguard launch`` each worker's Wrapper connects to its agent
(:class:`~trainguard.restart._helper.HelperHandle`, the agent's transport) instead of this
node's watcher, so a node runs one helper process (the agent). Per connection the service runs
a :class:`~trainguard.restart.sidecar._watch.Watch` (hard timeout, the lines of the worker's
watchdog); node liveness is the agent's own beat in the node ring.

Protocol (the agent's side, in this order):

1. ``SidecarService(name=..., log_dir=..., rejoin_timeout=...)``, :meth:`~SidecarService.start`,
   then every worker gets ``TRAINGUARD_AGENT=<service.address>`` in its environment.
2. Right after each ``Popen`` of a worker: :meth:`~SidecarService.expect` (slot, pid,
   incarnation). Only announced pids of this user may connect (``SO_PEERCRED``); a connection
   that comes before its announcement waits for it up to 2 s.
3. When a worker exited with a non-zero code or a signal, *before* respawning its slot:
   :meth:`~SidecarService.died` (the survivors' in-process restart starts from its notice).
4. Part D, for each rank of a lost node: :meth:`~SidecarService.gone`.
5. :meth:`~SidecarService.close` when the agent stops (its workers then see their watch gone).

Connection (worker side first): the worker sends its :class:`SidecarConfig` as one JSON line;
the service checks that its ``parent`` is the peer's pid, connects to the coordination store and
replies ``{"ok": true, "pid": <agent pid>, "relay": true, "arrival": true}`` (or ``{"ok":
false, "error": ...}`` and closes); then the worker sends its round/hb/bye lines, its asks of
the relay (each round's outcome and layout, read from the store once for all of this node's
workers of the same wrapped call, :mod:`trainguard.restart.sidecar._relay`; its replies are
the only lines the service writes after the handshake) and its barrier records: the agent
arrives at each barrier for its workers of one wrapped call at once, with the node watcher's
code (:mod:`trainguard.restart.sidecar._arrival`). After ``bye`` the service closes the
connection.

Over 400 lines: one class, the agent's side of the sidecar protocol for all of its workers
(accept, handshake, lines, notices, rejoin deadlines); the watch, the relay and the notice it
uses live in their own modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import select
import socket
import threading
import time
from typing import Any

from trainguard import _private, _subproc
from trainguard._timeouts import Timeout, seconds
from trainguard.restart.sidecar._calls import Calls
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._node import accept_own
from trainguard.restart.sidecar._notice import notify, notify_anew
from trainguard.restart.sidecar._watch import Watch

logger = logging.getLogger(__name__)

_EXPECT_GRACE = 2.0  # seconds a connection waits for the agent's expect() of its pid
_HANDSHAKE_TIMEOUT = 30.0  # seconds for the configuration line
_JOIN_TIMEOUT = 5.0  # seconds close() waits for each thread
_KILLER = "the launcher"  # in the cause of a hard-timeout kill
_LOGGERS = ("trainguard.restart.sidecar",)  # what the service's log file gets (this module too)


@dataclasses.dataclass(eq=False)
class _Conn:
    """One worker's connection (one wrapped call of one process)."""

    sock: socket.socket
    pid: int
    pidfd: int  # opened at the accept (:func:`accept_own`); its watch takes it, else closed
    slot: int | None = None
    watch: Watch | None = None
    ended: threading.Event = dataclasses.field(default_factory=threading.Event)

    def shutdown(self, how: int) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(how)


@dataclasses.dataclass
class _Rejoin:
    """A respawned slot's deadline: its old rank's notice turns final if it does not connect."""

    slot: int
    deadline: float
    cfg: SidecarConfig
    rank: int
    round: int
    roster: tuple[int, ...]
    cause: str


class SidecarService:
    """The agent's watch over its workers; see the module docstring for the protocol.

    A *slot* is the worker's global rank (``RANK``, the same in every incarnation): the agent
    passes the same numbers to :meth:`expect`, :meth:`died` and :meth:`gone`.

    Args:
        name: the start of the socket name (the run id, say); the agent's pid and random bytes
            follow, in :attr:`address`.
        log_dir: where the service writes its log, ``sidecar-service-<pid>.log`` (None: only
            the agent's own logging).
        rejoin_timeout: seconds a respawned slot has to connect again after
            :meth:`died` with ``returning=True`` before its rank is counted out of the job.
    """

    def __init__(self, *, name: str, log_dir: str | None, rejoin_timeout: Timeout) -> None:
        self.rejoin_timeout = seconds("rejoin_timeout", rejoin_timeout)
        self.address = f"trainguard-{name}-{os.getpid()}-{secrets.token_hex(8)}"
        self.log_dir = log_dir
        self._cond = threading.Condition()  # guards the fields below
        self._expected: dict[int, tuple[int, int]] = {}  # pid -> (slot, incarnation)
        self._conns: list[_Conn] = []
        self._rejoins: dict[int, _Rejoin] = {}  # slot -> deadline
        self._joined: dict[int, float] = {}  # slot -> when a process of it last connected
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self._wake = -1  # eventfd: wakes the listener (a new deadline, or close)
        self._closing = threading.Event()
        self._log: logging.StreamHandler[Any] | None = None
        self._calls = Calls()  # per wrapped call: its relay and its node arrival
        self._last_cfg: SidecarConfig | None = None  # of the last worker that connected
        self._pending: dict[int, str] = {}  # slot -> cause: gone before any worker connected

    # the agent's calls --------------------------------------------------------------------
    def start(self) -> None:
        """Listen (idempotent): one thread accepts connections and keeps rejoin deadlines."""
        with self._cond:
            if self._listener is not None or self._closing.is_set():
                return
            self._open_log()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            sock.bind("\0" + self.address)
            sock.listen(128)
            self._listener = sock
            self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            self._spawn(self._listen, "tg-service")
        logger.info("sidecar service listening at @%s", self.address)

    def expect(self, slot: int, pid: int, incarnation: int) -> None:
        """The agent started worker ``pid`` for ``slot`` (call it right after ``Popen``)."""
        with self._cond:
            self._expected[pid] = (slot, incarnation)
            self._cond.notify_all()

    def died(
        self, slot: int, pid: int, exit_code: int | None, *, returning: bool, timeout: float
    ) -> bool:
        """Worker ``pid`` of ``slot`` exited with ``exit_code`` (``Popen.returncode``): write
        its death notice (``returning``: the agent respawns the slot). True when the worker
        was in a wrapped call (a notice is written; it may go on in the background past
        ``timeout``), False when it never connected or had said goodbye. Blocks <= ``timeout``.
        With ``returning=True`` and a notice that keeps the rank's place, a new process of the
        slot must connect within ``rejoin_timeout``, else the rank is counted out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._expected.pop(pid, None)
            conns = [c for c in self._conns if c.pid == pid]
        for conn in conns:  # the reader takes what the dead process wrote, then ends
            conn.shutdown(socket.SHUT_RD)
        threads = []
        for conn in conns:
            conn.ended.wait(max(0.0, deadline - time.monotonic()))
            watch = conn.watch
            if not conn.ended.is_set() or watch is None or watch.said_bye:
                continue
            cause = watch.killed or _subproc.exit_text(exit_code)
            args = (conn, slot, cause, returning, time.monotonic())
            threads.append(self._spawn(self._death_notice, "tg-notice", args))
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return bool(threads)

    def gone(self, slot: int, cause: str) -> None:
        """Rank ``slot`` (a global rank of a lost node) is gone for good: its notice, written
        in the background in the wrapped call of a worker of this agent, from the round that
        worker is in. With none in a wrapped call now, in the last one a worker of this agent
        was in, from the latest round the store published; with none ever (a replacement node
        whose workers are still starting), as soon as the first one connects: the node is
        marked lost, so nobody else will count its ranks out."""
        with self._cond:
            live = [c.watch for c in self._conns if c.watch is not None and not c.watch.said_bye]
            cfg = self._last_cfg
            if not live and cfg is None:
                self._pending[slot] = cause
        if live:  # a worker in no round yet (a newcomer): the store's latest round
            watch, where = live[-1], live[-1].position()
            args: tuple[Any, ...] = (watch.cfg, slot, where if where[0] >= 0 else None, cause)
        elif cfg is not None:
            args = (cfg, slot, None, cause)
        else:
            logger.warning("rank %d gone (%s); its notice waits for a worker here", slot, cause)
            return
        self._spawn(notify_anew, "tg-notice", args)

    def close(self) -> None:
        """Stop every thread, close every socket and store connection; workers still connected
        see their connection close."""
        self._closing.set()
        with self._cond:
            if self._wake >= 0:
                os.eventfd_write(self._wake, 1)
            conns = list(self._conns)
        for conn in conns:
            conn.shutdown(socket.SHUT_RDWR)
        self._calls.close()
        waited: set[threading.Thread] = set()
        while True:  # threads may start others meanwhile (a notice): until none is left
            with self._cond:
                left = [t for t in self._threads if t not in waited]
            if not left:
                break
            for thread in left:
                waited.add(thread)
                thread.join(_JOIN_TIMEOUT)
                if thread.is_alive():
                    logger.warning("sidecar service: %s still running at close", thread.name)
        with self._cond:
            for conn in list(self._conns):
                self._drop(conn)
            self._conns.clear()
            self._rejoins.clear()
            if self._pending:  # no worker connected: no wrapped call to count them out of
                logger.warning("closed before a notice for ranks %s", sorted(self._pending))
            self._threads.clear()
            if self._listener is not None:
                self._listener.close()
            if self._wake >= 0:
                os.close(self._wake)
                self._wake = -1
        self._close_log()

    # threads ------------------------------------------------------------------------------
    def _spawn(self, target: Any, name: str, args: tuple[Any, ...] = ()) -> threading.Thread:
        """Start a thread that :meth:`close` waits for."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._cond:  # started under the lock: close() sees it, pruning keeps it
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            thread.start()
        return thread

    def _listen(self) -> None:
        """tg-service: accept connections (uid check here), fire rejoin deadlines."""
        assert self._listener is not None
        while not self._closing.is_set():
            with self._cond:
                due = min((r.deadline for r in self._rejoins.values()), default=None)
            wait = None if due is None else max(0.0, due - time.monotonic())
            ready, _, _ = select.select([self._listener.fileno(), self._wake], [], [], wait)
            if self._closing.is_set():
                return
            if self._wake in ready:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)
            if self._listener.fileno() in ready:
                self._accept()
            self._expire()

    def _accept(self) -> None:
        assert self._listener is not None
        peer = accept_own(self._listener, "this agent's")
        if peer is None:
            return
        conn = _Conn(*peer)
        with self._cond:
            self._conns.append(conn)
        self._spawn(self._serve, "tg-conn", (conn,))

    def _serve(self, conn: _Conn) -> None:
        """tg-conn: the handshake, then the worker's lines until goodbye or its end."""
        try:
            watch = self._handshake(conn)
            while watch is not None and not watch.said_bye:
                chunk = conn.sock.recv(65536)
                if not chunk:  # the worker ended (or the agent shut the connection down)
                    break
                watch.feed(chunk)
        except Exception:
            logger.exception("connection of pid %d failed", conn.pid)
        finally:
            self._end(conn)

    def _handshake(self, conn: _Conn) -> Watch | None:
        """Check the peer, read its configuration, connect its watch to the store, reply."""
        with self._cond:
            self._cond.wait_for(lambda: conn.pid in self._expected, timeout=_EXPECT_GRACE)
            slot = self._expected.get(conn.pid, (None, 0))[0]
        if slot is None:
            self._refuse(conn, f"pid {conn.pid} was not started by this agent")
            return None
        conn.slot = slot
        conn.sock.settimeout(_HANDSHAKE_TIMEOUT)
        data = b""
        while b"\n" not in data and (chunk := conn.sock.recv(65536)):
            data += chunk
        line, _, rest = data.partition(b"\n")
        try:
            cfg = SidecarConfig.from_json(json.loads(line))
        except Exception as exc:
            self._refuse(conn, f"no configuration line ({type(exc).__name__}: {exc})")
            return None
        if cfg.parent != conn.pid:
            self._refuse(conn, f"its configuration names pid {cfg.parent}")
            return None
        try:
            watch = Watch(
                cfg,
                pid=conn.pid,
                group_kill=True,
                killer=_KILLER,
                pidfd=conn.pidfd,
            )
        except Exception as exc:
            self._refuse(conn, f"{type(exc).__name__}: {exc}")
            return None
        conn.watch, conn.pidfd = watch, -1  # the pidfd is the watch's now
        conn.sock.settimeout(None)
        self._calls.join(cfg, watch, conn.sock)
        watch.start()  # the hard timeout counts from the handshake
        reply = {"ok": True, "pid": os.getpid(), "relay": True, "arrival": True}
        conn.sock.sendall(json.dumps(reply).encode() + b"\n")
        with self._cond:
            self._joined[slot] = time.monotonic()
            self._rejoins.pop(slot, None)
            self._last_cfg, pending, self._pending = cfg, self._pending, {}
        logger.info("watching rank %d (slot %d, pid %d)", cfg.rank, slot, conn.pid)
        for gone, cause in pending.items():  # the store's latest round: the worker is new
            logger.info("writing the notice that rank %d is gone (%s) now", gone, cause)
            self._spawn(notify_anew, "tg-notice", (cfg, gone, None, cause))
        watch.feed(rest)
        return watch

    @property
    def relay_reads(self) -> int:
        """Round keys its relays read from the store so far, for all workers (tests)."""
        return self._calls.relay_reads

    def _refuse(self, conn: _Conn, why: str) -> None:
        logger.warning("refused a connection of pid %d: %s", conn.pid, why)
        with contextlib.suppress(OSError):
            conn.sock.sendall(json.dumps({"ok": False, "error": why}).encode() + b"\n")

    def _end(self, conn: _Conn) -> None:
        """The connection's reader ended: keep the watch of a worker that did not say goodbye
        (its death notice needs it), drop the rest."""
        watch = conn.watch
        if watch is not None:
            watch.stop()
            if watch.on_end is not None:  # its node arrival waits for it no longer
                watch.on_end()
        with self._cond:
            if watch is None or watch.said_bye or self._closing.is_set():
                self._drop(conn)
            else:
                conn.sock.close()
        conn.ended.set()

    def _drop(self, conn: _Conn) -> None:
        """Forget ``conn`` (lock held): its socket, its watch's store connection and pidfd."""
        conn.sock.close()
        if conn.watch is not None:
            conn.watch.close()
        if conn.pidfd >= 0:
            os.close(conn.pidfd)
            conn.pidfd = -1
        with contextlib.suppress(ValueError):
            self._conns.remove(conn)

    # notices ------------------------------------------------------------------------------
    def _death_notice(
        self, conn: _Conn, slot: int, cause: str, returning: bool, died_at: float
    ) -> None:
        """tg-notice: the notice of a worker the agent saw die, on its watch's connection."""
        watch = conn.watch
        assert watch is not None
        n, roster = watch.position()
        notice = notify(watch.coord, watch.cfg, watch.rank, (n, roster), cause, returning=returning)
        with self._cond:
            self._drop(conn)
            kept = returning and notice is not None and getattr(notice, "returning", False)
            if kept and self._joined.get(slot, -1.0) < died_at:  # not back yet: arm the deadline
                deadline = died_at + self.rejoin_timeout
                info = (watch.cfg, watch.rank, n, roster, cause)
                self._rejoins[slot] = _Rejoin(slot, deadline, *info)
                if self._wake >= 0:
                    os.eventfd_write(self._wake, 1)

    def _expire(self) -> None:
        """tg-service: slots past their rejoin deadline are counted out of the job."""
        now = time.monotonic()
        with self._cond:
            due = [r for r in self._rejoins.values() if r.deadline <= now]
            for rejoin in due:
                del self._rejoins[rejoin.slot]
        for r in due:
            cause = f"{r.cause}; not back within rejoin_timeout={self.rejoin_timeout:g} s"
            logger.warning("slot %d: %s", r.slot, cause)
            self._spawn(notify_anew, "tg-notice", (r.cfg, r.rank, (r.round, r.roster), cause))

    # the log ------------------------------------------------------------------------------
    def _open_log(self) -> None:
        if self.log_dir is None:
            return
        path = os.path.join(self.log_dir, f"sidecar-service-{os.getpid()}.log")
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            stream = os.fdopen(_private.open_append(path), "a", buffering=1)
        except (OSError, ValueError) as exc:
            logger.warning("the sidecar service cannot log to %s: %s", path, exc)
            return
        self._log = logging.StreamHandler(stream)
        self._log.setFormatter(
            logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(message)s")
        )
        for name in _LOGGERS:
            logging.getLogger(name).addHandler(self._log)

    def _close_log(self) -> None:
        handler, self._log = self._log, None
        if handler is not None:
            for name in _LOGGERS:
                logging.getLogger(name).removeHandler(handler)
            handler.close()
            handler.stream.close()
