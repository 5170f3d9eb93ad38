"""The node watcher: one helper process for every rank of a wrapped call on this host.

Outside ``trainguard launch`` the ranks of one host share one watcher process
(:class:`~trainguard.restart._helper.HelperHandle` is their handle). For each rank it keeps a
:class:`~trainguard.restart.sidecar._watch.Watch` (the death notice as soon as the rank's
process dies, its pidfd waking; the hard timeout); for all of them it arrives at the barriers
(:mod:`._arrival`), reads each round's outcome and layout once (:mod:`._relay`), and beats once
for the node and judges the nodes after it: its member of the node ring,
:class:`trainguard.coord.node_ring.NodeRing`, named by its lowest live rank and listing its
ranks; a silent node gets a death notice for each of its ranks. It never imports torch
(:mod:`trainguard.coord._wire`).

Protocol:

1. Its address, a Unix socket in Linux's abstract namespace, is :func:`address` of the call's
   keyspace (it holds a digest of the job secret: unguessable) and this user's id. Who starts
   it, and when it may exit, is decided under a lock file in this user's private directory
   (:func:`lock_path`): a rank takes the lock, connects (or starts the watcher, detached in a
   session of its own so that it outlives that rank, and connects), sends its configuration,
   and releases the lock.
2. Each connection: the peer must be this user's (``SO_PEERCRED``; the rank checks the
   watcher the same way before it sends anything), its pidfd is taken at the accept
   (:func:`accept_own`) and its configuration must name the peer's pid. A rank that sent its
   configuration and died before the accept (its pid may be gone or reused) gets its death
   notice written from that configuration, and nothing is signalled. Otherwise the watcher
   connects the rank's watch to the store and replies
   ``{"ok": true, "pid": ..., "relay": true, "arrival": ...}`` (``arrival``: it arrives at
   the barriers for the rank, :mod:`._arrival`); then the rank's lines (round, hb, bye) follow,
   as on a sidecar's stdin, and its asks of the node's relay (:mod:`._relay`: each round's
   outcome and layout, read from the store once for all the node's ranks; the replies are the
   only lines the watcher writes after the handshake). The watcher closes the connection when
   the rank said goodbye or died.
3. When its last rank has left, it takes the lock, accepts a connection that came meanwhile if
   there is one (and goes on), else closes its socket and exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainguard import _private
from trainguard.coord import _wire
from trainguard.coord.keys import Keyspace
from trainguard.coord.node_ring import WINDOW, NodeRing, Position
from trainguard.restart.sidecar._calls import Calls
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._notice import notify
from trainguard.restart.sidecar._watch import Watch

logger = logging.getLogger("trainguard.restart.sidecar")

_HANDSHAKE_S = 30.0  # seconds a connection has to send its configuration
_FIRST_S = 60.0  # seconds the watcher waits for its first rank before it gives up
_LOOK_S = 0.1  # seconds between two looks at whether the last rank has left


def _name(keys: Keyspace) -> str:
    digest = hashlib.sha256(f"{keys.job}\0{keys.call}\0{keys.secret}".encode()).hexdigest()
    return f"{os.getuid()}-{digest[:32]}"


def address(keys: Keyspace) -> str:
    """The watcher's abstract socket name (without the leading NUL) for this call and user."""
    return f"trainguard-node-{_name(keys)}"


def log_path(config: SidecarConfig) -> Path:
    """The node watcher's log: ``sidecar-node-<host>.log`` in the events directory, else
    ``sidecar-node-<job>-<call>.log`` in this user's private directory
    (:func:`trainguard._private.private_dir`), where no other user can plant a file."""
    if config.log_dir:
        return Path(config.log_dir) / f"sidecar-node-{socket.gethostname()}.log"
    return _private.private_dir() / f"sidecar-node-{config.job}-{config.call}.log"


def lock_path(keys: Keyspace) -> Path:
    """The lock file that orders starting, joining and leaving the watcher."""
    return _private.private_dir() / f"node-{_name(keys)}.lock"


@contextlib.contextmanager
def locked(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created 0600, never through a link)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path} stayed locked for {timeout:g} s") from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # releases the lock


def accept_own(
    listener: socket.socket, owner: str, *, keep_gone: bool = False
) -> tuple[socket.socket, int, int] | None:
    """Accept a connection on the Unix socket ``listener``: the socket, the peer's pid and a
    pidfd of it, or None when accepting failed, the peer is another user's (``SO_PEERCRED``;
    refused and logged, ``owner`` naming whose it should be) or it is gone already.

    The pidfd is opened at once, before anything is read, and only kept while the connection
    is still open: a peer that had died before could have left its pid to another process,
    which the watch would then signal. The caller owns the pidfd (a :class:`Watch` takes it).

    ``keep_gone``: a peer of this user that is gone already (it connected, may have sent its
    configuration, and died before this accept; its parent may have reaped it) is returned
    with pidfd ``-1`` instead of refused, so that the caller can still write its death notice
    from what it sent (and never signals its pid)."""
    try:
        sock, _ = listener.accept()
    except OSError:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        logger.warning("refused a connection of pid %d: user %d is not %s", pid, uid, owner)
        sock.close()
        return None
    why = None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        pidfd, why = -1, "it is gone"
    if why is None and _closed(sock):
        os.close(pidfd)
        pidfd, why = -1, "it closed the connection at once (gone: its pid may be another process's)"
    if why is not None and not keep_gone:
        logger.warning("refused a connection of pid %d: %s", pid, why)
        sock.close()
        return None
    return sock, pid, pidfd


def _closed(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` closed its end (data it sent before may still be unread)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP)
    return bool(poller.poll(0))


class NodeWatcher:
    """The watcher process's server; see the module docstring.

    Args:
        keys: the wrapped call's keyspace (its address and lock file).
    """

    def __init__(self, keys: Keyspace) -> None:
        self.keys = keys
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.bind("\0" + address(keys))
        self.listener.listen(128)
        self.cond = threading.Condition()
        self.live = 0  # connections being served
        self.served = 0
        self.threads: list[threading.Thread] = []
        self.calls = Calls()  # the call's relay and node arrival, made with its first rank
        self.beats: Any = None  # the watches' one store connection, made likewise
        self.ring: NodeRing | None = None  # the node's member of the node ring
        self.watching: dict[Watch, None] = {}  # the watches whose ranks the ring beats for

    def serve(self) -> int:
        """Accept ranks until the last has left; the number of ranks served."""
        started = time.monotonic()
        while True:
            ready, _, _ = select.select([self.listener], [], [], _LOOK_S)
            if ready:
                self._accept()
                continue
            with self.cond:
                idle = self.live == 0
            if idle and (self.served or time.monotonic() - started > _FIRST_S) and self._leave():
                break
        for thread in self.threads:
            thread.join()
        self.calls.close()
        if self.ring is not None:  # its beats are not waited for when stuck in a store call
            self.ring.close(wait=1.0)
        if self.beats is not None:  # not close(): a beat stuck in a call would hold it up
            self.beats.interrupt()
            self.beats = None
        return self.served

    def _leave(self) -> bool:
        """Under the lock file: close the socket unless a rank is connecting (True: closed)."""
        with locked(lock_path(self.keys), _HANDSHAKE_S):
            ready, _, _ = select.select([self.listener], [], [], 0)
            if ready:
                return False
            self.listener.close()
        return True

    def _accept(self) -> None:
        peer = accept_own(self.listener, "this user", keep_gone=True)
        if peer is None:
            return
        sock, pid, pidfd = peer
        with self.cond:
            self.live += 1
            self.served += 1
        thread = threading.Thread(target=self._serve, args=(sock, pid, pidfd), name="tg-rank")
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()

    def _serve(self, sock: socket.socket, pid: int, pidfd: int) -> None:
        try:
            self._watch(sock, pid, pidfd)
        except Exception:
            logger.exception("the watch of pid %d failed", pid)
        finally:
            sock.close()
            with self.cond:
                self.live -= 1
                self.cond.notify_all()

    def _beats(self, cfg: SidecarConfig) -> Any:
        """The node's one store connection for its ring's beats and its watches (made with the
        first rank's store address; a watch's notice clones it)."""
        with self.cond:
            if self.beats is not None:
                return self.beats
        store = _wire.connect(cfg.host, cfg.port, timeout=cfg.store_timeout)
        with self.cond:
            if self.beats is None:
                self.beats = store
            else:
                store.close()  # another rank's connect came first
            return self.beats

    def _gone_before(self, cfg: SidecarConfig) -> None:
        """Rank ``cfg.rank`` connected, sent its configuration and died before this watcher
        accepted it (its parent may have reaped it: no pidfd can be had). Nothing may be
        signalled, but the rank is gone: write its death notice, on a connection of its own,
        as its watch would have (it never announced a round: the notice finds it)."""
        logger.warning("rank %d (pid %d) died before its watch began", cfg.rank, cfg.parent)
        store = _wire.connect(cfg.host, cfg.port, timeout=cfg.store_timeout)
        try:
            where = (-1, tuple(range(cfg.world)))
            notify(store, cfg, cfg.rank, where, "its process died before its node watcher took it")
        finally:
            store.close()

    def _watch(self, sock: socket.socket, pid: int, pidfd: int) -> None:
        """Serve one rank; ``pidfd`` (of ``pid``, from :func:`accept_own`) goes to its watch,
        or is closed here when it is refused."""
        watch: Watch | None = None
        why = ""
        try:
            sock.settimeout(_HANDSHAKE_S)
            data = b""
            while b"\n" not in data and (chunk := sock.recv(65536)):
                data += chunk
            line, _, rest = data.partition(b"\n")
            cfg = SidecarConfig.from_json(json.loads(line))
            if cfg.parent != pid:
                raise ValueError(f"its configuration names pid {cfg.parent}, not its own")
            if cfg.keys.prefix != self.keys.prefix:
                raise ValueError("its configuration is of another wrapped call")
            if pidfd < 0:  # gone before the accept: its notice, from what it sent
                self._gone_before(cfg)
                return
            # the node beats once for its ranks (:meth:`_node_ring`), not a watch per rank
            watch = Watch(cfg, store=self._beats(cfg), shared=True, pidfd=pidfd)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        finally:
            if watch is None and pidfd >= 0:
                os.close(pidfd)
        if watch is None and pidfd < 0:
            if why:
                logger.warning("no notice for pid %d, gone before its watch began: %s", pid, why)
            return
        if watch is None:
            logger.warning("refused pid %d: %s", pid, why)
            sock.sendall(json.dumps({"ok": False, "error": why}).encode() + b"\n")
            return
        try:
            sock.settimeout(None)
            self.calls.join(cfg, watch, sock)  # one relay and node arrival for the node
            with self.cond:
                self._node_ring(cfg)
                self.watching[watch] = None
            with contextlib.suppress(OSError):  # it died already: the watch writes its notice
                reply = {"ok": True, "pid": os.getpid(), "relay": True, "arrival": True}
                sock.sendall(json.dumps(reply).encode() + b"\n")
            logger.info("watching rank %d (pid %d)", cfg.rank, pid)
            watch.run_piped(sock.fileno(), rest)
        finally:
            watch.stop()  # its threads end with it, also when it failed
            with self.cond:  # no longer this node's rank
                self.watching.pop(watch, None)
            watch.close()

    # node liveness -----------------------------------------------------------------------
    def _node_ring(self, cfg: SidecarConfig) -> None:
        """The node's member of the node ring (under :attr:`cond`, once), beating on the
        node's shared connection; its first beat, inline, finds no rank yet: no store call."""
        if self.ring is None:
            self.ring = NodeRing(
                self._beats(cfg),
                self.keys.node_heartbeat,
                position=self._position,
                interval=cfg.heartbeat_interval,
                timeout=cfg.heartbeat_timeout,
                window=WINDOW,
                on_silent=self._silent,
            )
            self.ring.start()

    def _position(self) -> Position:
        """The node ring's position: the ranks of the live watches, and the newest round one
        of them announced, with its roster."""
        with self.cond:
            live = [w for w in self.watching if not w.done.is_set()]
        newest = max((w.position() for w in live), key=lambda p: p[0], default=(-1, ()))
        return tuple(sorted(w.rank for w in live)), newest[0], newest[1]

    def _silent(
        self, leader: int, ranks: list[int], silent: float, n: int, roster: tuple[int, ...]
    ) -> None:
        """The node of ``leader`` is silent: a death notice for each of its ranks, each on a
        connection of its own, through a live watch."""
        cause = f"its node silent: no node heartbeat for {silent:.1f} s (heartbeat_timeout)"
        logger.warning("node of rank %d is silent: ranks %s gone", leader, ranks)
        with self.cond:
            live = [w for w in self.watching if not w.done.is_set()]
        for r in ranks if live else ():
            live[0].notices.append(live[0].notice_thread(r, n, roster, cause))
