"""The rank side of the helper that watches this process: one handle, two transports.

A training process that crashes, hangs holding the GIL or loses its node cannot report it, so
each wrapped call is watched by a helper process beside it: under ``trainguard launch`` the
agent that started this worker (:class:`~trainguard.restart.sidecar.SidecarService`), else
this node's watcher, shared by the node's ranks (:mod:`trainguard.restart.sidecar._node`, a
fresh interpreter started by the node's first rank). Both speak one connection protocol over a
Unix socket in Linux's abstract namespace; what differs between them is data
(:class:`Transport`): the address, who must listen there, whether the rank may start the
helper, and what to tell the user when it refuses.

Protocol of :class:`HelperHandle` (the wrapped call's thread, in this order):

1. :meth:`~HelperHandle.start` connects (the node watcher's transport: under the node's lock
   file, and it starts the watcher first when none listens; the watcher detaches, so it
   outlives this rank), checks who listens (:func:`check_listener`: a process of this user,
   and for the agent this process's parent or another ancestor) and only then sends the
   :class:`~trainguard.restart.sidecar.SidecarConfig` as one JSON line (it holds the job
   secret; the helper checks the connecting pid and uid with ``SO_PEERCRED`` in turn);
2. :meth:`~HelperHandle.handshake` reads the helper's one JSON reply line: ``{"ok": true,
   "pid": ..., "relay": true, "arrival": true}`` (the helper relays each round's outcome and
   layout, :mod:`trainguard.restart.sidecar._relay`, and arrives at the barriers for this
   rank, :mod:`trainguard.restart.sidecar._arrival`), or a refusal, raised with its fix;
3. :meth:`~HelperHandle.send` writes the rank's lines (round, hb, bye, its barrier records
   and its asks of the relay), from any thread;
4. :meth:`~HelperHandle.alive` is True while the connection is open: when the helper dies,
   the watchdog sees it and this rank leaves the job (it must not run unwatched);
5. :meth:`~HelperHandle.stop` says goodbye and waits until the helper closed the connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import select
import socket
import struct
import subprocess
import threading
import time
from typing import Any

from trainguard import _env, _procfs, _subproc
from trainguard.coord.keys import Keyspace
from trainguard.errors import CoordinationError
from trainguard.restart.config import WrapperConfig
from trainguard.restart.sidecar import _node as node
from trainguard.restart.sidecar._config import SidecarConfig, handshake_reply
from trainguard.restart.sidecar._relay import RelayReader

__all__ = ["HelperHandle", "Transport", "check_listener", "start_for", "start_helper"]

logger = logging.getLogger(__name__)

_REAP_S = 10.0  # seconds for a started node watcher to hand over to its detached child


@dataclasses.dataclass(frozen=True)
class Transport:
    """Where a rank's helper listens, and what that implies.

    Attributes:
        what: the helper, for messages ("the launcher's agent").
        address: its abstract socket name (without the leading NUL).
        ancestor: the listener must be this process's parent or another ancestor.
        spawn: with nobody listening, start the node watcher (under the node's lock file).
        fix: what a refused rank can do, for the error.
    """

    what: str
    address: str
    ancestor: bool
    spawn: bool
    fix: str

    @classmethod
    def agent(cls, address: str) -> Transport:
        """The launcher's agent at ``address`` (``TRAINGUARD_AGENT``)."""
        return cls(
            what="the launcher's agent",
            address=address,
            ancestor=True,
            spawn=False,
            fix="start it with `trainguard launch`, or unset TRAINGUARD_AGENT to have it "
            "watched by this node's watcher",
        )

    @classmethod
    def node_watcher(cls, config: SidecarConfig) -> Transport:
        """This node's watcher of ``config``'s wrapped call."""
        return cls(
            what="this node's watcher",
            address=node.address(config.keys),
            ancestor=False,
            spawn=True,
            fix=f"see {node.log_path(config)} for why; the watcher needs the coordination store "
            f"at {config.host}:{config.port} to answer from this host, and the ranks of one "
            "host the same user and job (or run the job under `trainguard launch`, whose agent "
            "watches its workers)",
        )


def check_listener(sock: socket.socket, what: str, *, ancestor: bool) -> None:
    """Check the process that listens at the other end of the connected Unix socket ``sock``
    (``SO_PEERCRED``: the process that called ``listen``) before anything is sent to it: it
    must run as this user and, with ``ancestor``, be this process's parent (the agent that
    started it), or another of its ancestors. Anyone may bind an abstract socket name first,
    and the configuration sent next holds the job secret.

    Raises :class:`~trainguard.errors.CoordinationError` naming ``what`` listens there."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise CoordinationError(
            f"the process listening as {what} (pid {pid}) runs as user {uid}, not as this "
            f"process's user {os.getuid()}: another user holds its socket name; nothing was "
            "sent to it"
        )
    if ancestor and pid not in _lineage():
        raise CoordinationError(
            f"the process listening as {what} (pid {pid}) is not this process's parent (pid "
            f"{os.getppid()}) nor an ancestor of it: only the agent that started this process "
            "may watch it; nothing was sent to it"
        )


def _lineage() -> list[int]:
    """This process's pid, its parent's, and so on up to the first process."""
    pids = [os.getpid(), os.getppid()]
    while pids[-1] > 1 and len(pids) < 4096:
        parent = _procfs.parent_of(pids[-1])
        if parent is None:
            break
        pids.append(parent)
    return pids


class HelperHandle:
    """The training process's side of its helper; see the module docstring.

    Args:
        config: what the helper is told about this process's wrapped call.
        transport: which helper, and how to reach it.
    """

    def __init__(self, config: SidecarConfig, transport: Transport) -> None:
        self.config = config
        self.transport = transport
        self.address = transport.address
        self.sock: socket.socket | None = None
        self.error: str | None = None
        self.watcher_pid: int | None = None  # the watching process's, from its handshake
        #: the helper's relay of round outcomes and layouts (None: it has none)
        self.relay: RelayReader | None = None
        #: the helper arrives at the barriers for this rank (:mod:`.sidecar._arrival`)
        self.arrival = False
        self._lock = threading.Lock()  # one line at a time, from any thread
        self._closed = False

    # 1. start -----------------------------------------------------------------------------
    def start(self) -> HelperHandle:
        """Connect and send the configuration (starting the node watcher when it is this
        transport's to start and none listens); a failure is kept for :meth:`handshake`."""
        cfg = self.config
        try:
            if not self.transport.spawn:
                self._connect(missing_ok=False)
                return self
            with node.locked(node.lock_path(cfg.keys), cfg.store_timeout):
                if not self._connect(missing_ok=True):
                    self._spawn()
                    if not self._connect(missing_ok=True):
                        raise CoordinationError("it started but does not accept connections")
        except (OSError, TimeoutError, CoordinationError) as exc:
            where = f" at {self.address!r}" if not self.transport.spawn else ""
            self.error = f"cannot reach it{where}: {exc}"
        return self

    def _connect(self, *, missing_ok: bool) -> bool:
        """Connect, check the listener, send the configuration; False when nobody listens
        (only with ``missing_ok``)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect("\0" + self.address)
        except ConnectionRefusedError:
            sock.close()
            if missing_ok:
                return False
            raise
        except OSError:
            sock.close()
            raise
        try:
            check_listener(sock, self.transport.what, ancestor=self.transport.ancestor)
            sock.sendall(json.dumps(self.config.to_json()).encode() + b"\n")
        except (OSError, CoordinationError):
            sock.close()
            raise
        self.sock = sock
        return True

    def _spawn(self) -> None:
        """Start the node watcher and wait for its handshake (it listens by then)."""
        proc = _subproc.start_module(
            "trainguard.restart.sidecar", self.config.to_json(), keep_stdin=False, new_session=True
        )
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], self.config.store_timeout)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        try:  # the process exits once its detached child runs the watcher
            proc.wait(_REAP_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        reply = handshake_reply(line)
        if not reply.get("ok"):
            raise CoordinationError(f"it could not start: {reply.get('error')}")

    # 2. handshake -------------------------------------------------------------------------
    def handshake(self, timeout: float) -> None:
        """Read the helper's reply (up to ``timeout`` seconds); raise its refusal, or the
        failure of :meth:`start`, as a :class:`~trainguard.errors.CoordinationError` naming
        the fix."""
        if self.sock is None:
            reply: dict[str, Any] = {"ok": False, "error": self.error}
        else:
            reply = handshake_reply(self._read_line(timeout))
        self.watcher_pid = reply.get("pid")
        if not reply.get("ok"):
            self.stop(0.0)
            raise CoordinationError(self.refusal(reply.get("error")))
        if reply.get("relay") and self.sock is not None:  # see _relay
            self.relay = RelayReader(self.sock, self.send)
            self.arrival = bool(reply.get("arrival"))

    def refusal(self, error: object) -> str:
        """The message of the error :meth:`handshake` raises when it is not watched."""
        return f"{self.transport.what} does not watch this process: {error}; {self.transport.fix}"

    def _read_line(self, timeout: float) -> bytes:
        assert self.sock is not None
        data = b""
        deadline = time.monotonic() + timeout
        while b"\n" not in data:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = self.sock.recv(4096)
            if not chunk:
                break
            data += chunk
        return data.partition(b"\n")[0]

    # 3.-5. lines, liveness, goodbye -------------------------------------------------------
    def alive(self) -> bool:
        """The connection is open (a helper without a relay never writes after the
        handshake: a readable socket means it closed; one with a relay writes its replies,
        which :attr:`relay` reads)."""
        sock = self.sock
        if sock is None or self._closed:
            return False
        if self.relay is not None:
            self._closed = not self.relay.alive()
            return not self._closed
        try:
            ready, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):  # closed by stop() meanwhile
            ready = [sock]
        if ready:
            self._closed = True
        return not self._closed

    def loss(self) -> str:
        """Why :meth:`alive` is False, for the watchdog's report."""
        return f"its connection to {self.transport.what} closed (the helper process ended)"

    def send(self, message: dict[str, Any]) -> bool:
        """One line to the helper (from any thread); False if the connection is gone."""
        with self._lock:
            if self.sock is None:
                return False
            try:
                self.sock.sendall(json.dumps(message).encode() + b"\n")
                return True
            except OSError:
                self._closed = True
                return False

    def stop(self, timeout: float = 10.0) -> None:
        """Say goodbye and wait up to ``timeout`` for the helper to close the connection (it
        has then taken the goodbye: the process may exit)."""
        if self.sock is None:
            return
        self.send({"bye": 1})
        with self._lock:
            sock, self.sock = self.sock, None
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                ready, _, _ = select.select([sock], [], [], deadline - time.monotonic())
                if not ready or not sock.recv(4096):
                    break
        sock.close()
        self._closed = True
        if self.relay is not None:
            self.relay.close()


def start_helper(config: SidecarConfig) -> HelperHandle:
    """Start the helper that watches this process (its handshake is the caller's, who holds
    the handle to stop it should the handshake fail): the launcher's agent under
    ``trainguard launch`` (``TRAINGUARD_AGENT``), else this node's watcher."""
    agent = _env.settings().agent
    transport = Transport.agent(agent) if agent is not None else Transport.node_watcher(config)
    return HelperHandle(config, transport).start()


def start_for(
    cfg: WrapperConfig,
    keys: Keyspace,
    addr: tuple[str, int],
    *,
    rank: int,
    world: int,
    log_dir: str | os.PathLike[str] | None,
) -> HelperHandle:
    """The helper that watches initial rank ``rank``'s wrapped call (``cfg``; its keyspace
    ``keys`` in the coordination store at ``addr``), started: its configuration
    (:meth:`SidecarConfig.build`), then :func:`start_helper`."""
    config = SidecarConfig.build(cfg, rank=rank, world=world, keys=keys, addr=addr, log_dir=log_dir)
    return start_helper(config)
