"""The watch over one training process: its lines, its hard timeout, its death notice.

One :class:`Watch` per wrapped call of one training process, in the helper that watches it:
the node watcher (:mod:`._node`, fed from the rank's Unix socket connection,
:meth:`Watch.run_piped`) or the launcher's agent
(:class:`trainguard.restart.sidecar.agent_service.SidecarService`, which feeds it what it reads
and kills the worker's whole process group at the hard timeout, ``group_kill``). Neither beats
per rank: each helper beats once for its node (:mod:`trainguard.coord.node_ring`).

The lines (one JSON object each): ``{"round": n, "roster": [...]}`` after each barrier,
``{"hb": 1, "in_fn": bool, "stall": s}`` from the training process's watchdog thread every few
tenths of a second, ``{"bye": 1}`` when the wrapped call has left the job; and the rank's
barrier records and asks of the node's relay, which go to the helper's hooks
(:attr:`Watch.on_arrive`, :attr:`Watch.on_relay`).

Threads, so that no store operation ever delays the duty that must be on time (a TCPStore
operation on a server that stopped answering blocks far past its timeout):

- the reader (the node watcher's connection thread, or the agent's): no store work until the
  training process is dead.
- ``tg-hard``: the hard timeout, with no store access. When no watchdog line arrived for
  ``hard_timeout`` (a thread holds the GIL), or the watchdog reports the function stalled that
  long, it sends SIGTERM, waits ``termination_grace_time``, sends SIGKILL. Signals go through a
  pidfd (``pidfd_send_signal``), so they never reach a process that reused the pid; with
  ``group_kill`` a SIGCONT goes first (a stopped process cannot handle SIGTERM), the SIGTERM once
  the process no longer shows as stopped (at most a second later), and every signal
  goes to the process group the training process leads, if it leads one.
- ``tg-notice``: a notice about another rank (:meth:`Watch.notice_thread`; the node ring found
  its node silent), on a connection of its own opened for it, so that a notice waiting on a
  barrier holds up nothing else. The notice is idempotent: the first one counts the rank out.

A watch uses the store connection it is given (the node watcher's watches share one): the
rank's own death notice, which may wait for a barrier, goes on a connection of its own when
it is shared.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard import _procfs, events
from trainguard.coord.store import StoreLike, connect
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._notice import notify

logger = logging.getLogger("trainguard.restart.sidecar")

#: after the hard timeout's SIGCONT, how long a stopped process has to resume before SIGTERM
_CONTINUE_S = 1.0


class Watch:
    """See the module docstring.

    Args:
        cfg: the training process's sidecar configuration.
        pid: the watched process (default ``cfg.parent``).
        group_kill: at the hard timeout, SIGCONT first and signal the process group the
            training process leads (the agent does: its workers lead their own groups).
        killer: who kills, for the cause of the death notice ("its sidecar", "the launcher").
        store: the store client to use (default: a new connection to ``cfg``'s store). Any
            object with TCPStore's ``set``, ``compare_set``, ``multi_get``, ``check``,
            ``add``, ``get``, ``wait``, ``delete_key`` and ``clone`` will do; the watch
            drops its reference in :meth:`close`.
        shared: ``store`` serves other watches too (the node watcher's): this rank's death
            notice, which may wait for a barrier, then goes on a connection of its own.
        pidfd: a pidfd of the watched process, opened when it connected (the watch owns it
            from then on); default one opened here.
    """

    def __init__(
        self,
        cfg: SidecarConfig,
        *,
        pid: int | None = None,
        group_kill: bool = False,
        killer: str = "its sidecar",
        store: StoreLike | None = None,
        shared: bool = False,
        pidfd: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.shared = shared
        self.rank = cfg.rank
        self.world = cfg.world
        self.parent = cfg.parent if pid is None else pid
        self.keys = cfg.keys
        self.group_kill = group_kill
        self.killer = killer
        if store is None:
            store = connect(cfg.host, cfg.port, timeout=cfg.store_timeout)
        self.coord: StoreLike = store
        self.pidfd = os.pidfd_open(self.parent) if pidfd is None else pidfd
        self.lock = threading.Lock()  # guards the fields below, shared by the threads
        self.round = -1
        self.roster: tuple[int, ...] = tuple(range(self.world))
        self.last_line = time.monotonic()
        self.in_fn = False
        self.stall = 0.0
        self.said_bye = False
        self.killed: str | None = None  # set by tg-hard before its SIGTERM
        self.done = threading.Event()  # the training process is gone or said goodbye
        self.threads: list[threading.Thread] = []
        self.notices: list[threading.Thread] = []
        self.buffer = b""
        #: the node watcher's hook for the rank's asks of its relay (:mod:`._relay`)
        self.on_relay: Callable[[dict[str, Any]], None] | None = None
        #: the node watcher's hooks of node arrival (:mod:`._arrival`): the rank's records,
        #: and its end (death or goodbye, called before its notice is written)
        self.on_arrive: Callable[[dict[str, Any]], None] | None = None
        self.on_end: Callable[[], None] | None = None

    # lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the clock of the hard timeout and its thread (tg-hard)."""
        self.last_line = time.monotonic()
        self.threads = [threading.Thread(target=self.enforce_hard_timeout, name="tg-hard")]
        for thread in self.threads:
            thread.daemon = True
            thread.start()

    def stop(self) -> None:
        """The training process is gone or said goodbye: end tg-hard (never blocked long: it
        waits on the event, or up to the grace time of a kill)."""
        self.done.set()
        for thread in self.threads:
            thread.join(self.cfg.termination_grace_time + 1.0)

    def close(self) -> None:
        """Drop the store connections and the pidfd (after :meth:`stop`)."""
        del self.coord  # not closed: a node watcher's watches share one connection
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def position(self) -> tuple[int, tuple[int, ...]]:
        """The last round the training process announced (-1: none yet) and its roster."""
        with self.lock:
            return self.round, self.roster

    # lines --------------------------------------------------------------------------------
    def handle(self, line: bytes) -> bool:
        """One line from the training process; True for its goodbye. An ask of the node
        watcher's relay (``{"relay": ...}``) goes to :attr:`on_relay`."""
        msg = json.loads(line)
        if "relay" in msg:
            if self.on_relay is not None:
                self.on_relay(msg)
            return False
        if "arrive" in msg:
            if self.on_arrive is not None:
                self.on_arrive(msg)
            return False
        with self.lock:
            self.last_line = time.monotonic()
            if "hb" in msg:
                self.in_fn = bool(msg["in_fn"])
                self.stall = float(msg["stall"])
            elif "round" in msg:
                self.round = int(msg["round"])
                self.roster = tuple(int(r) for r in msg["roster"])
            if "bye" in msg:
                self.said_bye = True
        return "bye" in msg

    def feed(self, chunk: bytes) -> bool:
        """Bytes read from the training process; True once it said goodbye."""
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return any(self.handle(line) for line in lines if line.strip())

    # tg-hard: the hard timeout, no store access -------------------------------------------
    def enforce_hard_timeout(self) -> None:
        hard = self.cfg.hard_timeout
        while not self.done.is_set():
            now = time.monotonic()
            with self.lock:  # the clock starts at the handshake, before the first line
                silent = now - self.last_line
                stalled = self.stall + silent if self.in_fn else 0.0
            if silent >= hard:
                self.kill_parent(f"no progress of any thread for {silent:.1f} s")
                return
            if stalled >= hard:
                self.kill_parent(f"the function made no progress for {stalled:.1f} s")
                return
            # wake at the earliest deadline; a new line only moves it later
            self.done.wait(max(0.001, hard - max(silent, stalled)))

    def kill_parent(self, why: str) -> None:
        grace = self.cfg.termination_grace_time
        self.killed = f"killed by {self.killer} at the hard timeout ({why})"
        events.emit("hard_timeout", reason=why, pid=self.parent, killed_rank=self.rank)
        logger.error("rank %d: hard timeout: %s; SIGTERM to %d", self.rank, why, self.parent)
        if self.group_kill:
            self.signal(signal.SIGCONT)
            self.await_continued(_CONTINUE_S)
        self.signal(signal.SIGTERM)
        ready, _, _ = select.select([self.pidfd], [], [], grace)
        if not ready:
            logger.error("rank %d: still alive %.1f s after SIGTERM; SIGKILL", self.rank, grace)
            self.signal(signal.SIGKILL)

    def await_continued(self, timeout: float) -> None:
        """After a SIGCONT: wait up to ``timeout`` seconds until the watched process is no
        longer stopped (or is gone). A SIGTERM sent while it is still stopping was seen lost
        (gVisor, under load: the process resumed, its handler never ran, and only the SIGKILL
        after the grace ended it); sent to a process that runs, its handler runs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.pidfd], [], [], 0)
            if ready or _procfs.state_of(self.parent) not in ("T", "t"):
                return
            time.sleep(0.002)

    def signal(self, sig: signal.Signals) -> None:
        """``sig`` to the watched process through its pidfd; with ``group_kill`` to the group
        it leads as well (only while it lives, so the group id cannot have been reused)."""
        with contextlib.suppress(ProcessLookupError):  # gone already: nothing else is hit
            signal.pidfd_send_signal(self.pidfd, sig)
            if self.group_kill and os.getpgid(self.parent) == self.parent:
                os.killpg(self.parent, sig)

    # notices -----------------------------------------------------------------------------
    def notice_thread(
        self, r: int, n: int, roster: tuple[int, ...], cause: str
    ) -> threading.Thread:
        """The notice of rank ``r`` on a connection of its own, in a thread of its own."""
        thread = threading.Thread(
            target=self.clone_notice, args=(r, n, roster, cause), name="tg-notice"
        )
        thread.daemon = True
        thread.start()
        return thread

    def clone_notice(self, r: int, n: int, roster: tuple[int, ...], cause: str) -> None:
        try:
            store = self.coord.clone()
        except Exception:
            logger.exception("could not write the notice that rank %d is gone", r)
            return
        notify(store, self.cfg, r, (n, roster), cause)

    # the node watcher's connection --------------------------------------------------------
    def wait_parent(self, fd: int, buf: bytes = b"") -> str | None:
        """Until goodbye (None) or the training process's death (its cause). ``fd``: the pipe
        the lines come on; ``buf``: what was read from it after the configuration line."""
        os.set_blocking(fd, False)
        eof = False
        if self.feed(buf):
            return None
        while True:
            ready, _, _ = select.select([self.pidfd] if eof else [self.pidfd, fd], [], [])
            # the pipe first: a goodbye written just before a normal exit is not a death
            while not eof:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except ConnectionResetError:  # a socket (node watcher): the peer died unread
                    chunk = b""
                eof = not chunk
                if self.feed(chunk):
                    return None
            if self.pidfd in ready:
                return self.killed or f"process died (pid {self.parent} exited)"

    def run_piped(self, fd: int, buf: bytes = b"") -> int:
        """The watch's life in the node watcher: watch until goodbye or death, then write
        the notice. ``fd``: the rank's connection; ``buf``: what followed its configuration."""
        self.start()
        cause = self.wait_parent(fd, buf)
        self.done.set()
        if self.on_end is not None:
            self.on_end()
        self.threads[0].join()  # never blocked: it only waits on the pidfd and the event
        if cause is None:
            logger.info("the training process said goodbye")
        else:
            n, roster = self.position()
            store = self.coord
            if self.shared:
                with contextlib.suppress(Exception):  # else on the shared one, as it can
                    store = self.coord.clone()
            notify(store, self.cfg, self.rank, (n, roster), cause)
            del store  # a clone closes with it
        # Notices about others still running go on up to the barrier timeout.
        deadline = time.monotonic() + self.cfg.barrier_timeout
        for thread in self.notices:
            thread.join(max(0.0, deadline - time.monotonic()))
        return 0
