"""The training process's handles of a helper that watches it over a Unix socket: the
launcher's agent (:class:`AgentSidecar`) or this node's watcher (:class:`NodeSidecar`, which
speaks the same connection protocol and inherits the agent handle's methods).

**The agent** (``trainguard launch``). Under ``trainguard launch`` no sidecar process is started: the agent that started this worker
(its parent) watches it (:class:`~trainguard.restart.sidecar.agent_service.SidecarService`).
The agent's address is ``TRAINGUARD_AGENT``: the name of a Unix socket in Linux's abstract
namespace.

:class:`AgentSidecar` has the methods of :class:`~trainguard.restart.sidecar.Sidecar`:

1. :meth:`~AgentSidecar.start` connects, checks who listens (:func:`check_listener`: a
   process of this user and this process's parent, the agent, or another ancestor) and only
   then sends the :class:`SidecarConfig` as one JSON line (the agent checks the connecting
   process's pid and uid with ``SO_PEERCRED`` in turn);
2. :meth:`~AgentSidecar.handshake` reads the agent's one JSON reply line;
3. :meth:`~AgentSidecar.send` writes the same lines a sidecar gets on its stdin (round, hb,
   bye), from any thread;
4. :meth:`~AgentSidecar.alive` is True while the connection is open: when the agent dies, the
   watchdog sees it and this rank leaves the job (it must not run unwatched);
5. :meth:`~AgentSidecar.stop` says goodbye and waits until the agent closed the connection.

**The node watcher** (``TRAINGUARD_SIDECAR=node``, :mod:`._node`). :class:`NodeSidecar` has the methods of :class:`~trainguard.restart.sidecar.Sidecar`, over the
same connection protocol as the launcher's agent (:class:`AgentSidecar`, whose methods it
inherits). :meth:`NodeSidecar.start`, under the node's lock file: connect to the watcher of
this wrapped call on this host, or, when there is none, start it (``python -m
trainguard.restart.sidecar`` with ``"node": true``: it detaches, so it outlives this rank) and
connect; then check that the watcher runs as this user (``SO_PEERCRED``: anyone may bind the
socket's name first) and send this rank's configuration. The watcher closes the connection
when this rank said goodbye or died; a connection that closes before (the watcher died) is
this rank's loss of its sidecar.
"""

from __future__ import annotations

import contextlib
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
from trainguard.errors import CoordinationError
from trainguard.restart.sidecar import _node
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._handle import handshake_reply, node_log_path
from trainguard.restart.sidecar._relay import RelayReader

logger = logging.getLogger(__name__)


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


def agent_address() -> str | None:
    """The agent's socket name from ``TRAINGUARD_AGENT`` (None: not under the launcher)."""
    return _env.settings().agent


class AgentSidecar:
    """Training-process side of the agent's watch; see the module docstring.

    Args:
        config: what a sidecar would be told.
        address: the agent's abstract socket name (``TRAINGUARD_AGENT``, without the NUL).
    """

    proc: Any = None  # no process of its own (the watchdog reads a sidecar's exit code here)

    def __init__(self, config: SidecarConfig, address: str) -> None:
        self.config = config
        self.address = address
        self.sock: socket.socket | None = None
        self.error: str | None = None
        self.watcher_pid: int | None = None  # the watching process's, from its handshake
        #: the node watcher's relay of round outcomes and layouts (None: the helper has none)
        self.relay: RelayReader | None = None
        #: the helper arrives at the barriers for this rank (node arrival, :mod:`._arrival`)
        self.arrival = False
        self._lock = threading.Lock()  # one line at a time, from any thread
        self._closed = False

    def start(self) -> AgentSidecar:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect("\0" + self.address)
            check_listener(sock, "the launcher's agent", ancestor=True)
            sock.sendall(json.dumps(self.config.to_json()).encode() + b"\n")
        except OSError as exc:
            sock.close()
            self.error = f"cannot reach it at {self.address!r}: {exc}"
            return self
        except CoordinationError as exc:
            sock.close()
            self.error = str(exc)
            return self
        self.sock = sock
        return self

    def handshake(self, timeout: float) -> None:
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
        return (
            f"the launcher's agent does not watch this process: {error}; start it with "
            "`trainguard launch` (or unset TRAINGUARD_AGENT to run it with a sidecar process of "
            "its own)"
        )

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

    def alive(self) -> bool:
        """The connection is open (a helper without a relay never writes after the
        handshake: a readable socket means it closed; one with a relay, the node watcher or
        the launcher's agent, writes its replies, which :attr:`relay` reads)."""
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
        return "its connection to the launcher's agent closed (the agent ended)"

    def send(self, message: dict[str, Any]) -> bool:
        """One line to the agent (from any thread); False if the connection is gone."""
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
        """Say goodbye and wait up to ``timeout`` for the agent to close the connection (it has
        then taken the goodbye: the process may exit)."""
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


_REAP_S = 10.0  # seconds for the started process to hand over to its detached child


class NodeSidecar(AgentSidecar):
    """Training-process side of the node watcher; see the module docstring."""

    def __init__(self, config: SidecarConfig) -> None:
        super().__init__(config, _node.address(config.keys))

    def start(self) -> NodeSidecar:
        cfg = self.config
        try:
            with _node.locked(_node.lock_path(cfg.keys), cfg.store_timeout):
                if not self._connect():
                    self._spawn()
                    if not self._connect():
                        raise CoordinationError("it started but does not accept connections")
        except (OSError, TimeoutError, CoordinationError) as exc:
            self.error = f"this node's watcher: {exc}; see {node_log_path(cfg)}"
        return self

    def _connect(self) -> bool:
        """Connect and send the configuration; False when no watcher listens."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect("\0" + self.address)
        except ConnectionRefusedError:
            sock.close()
            return False
        try:
            check_listener(sock, "this node's watcher", ancestor=False)
            sock.sendall(json.dumps(self.config.to_json()).encode() + b"\n")
        except (OSError, CoordinationError):
            sock.close()
            raise
        self.sock = sock
        return True

    def _spawn(self) -> None:
        """Start the watcher and wait for its handshake (it listens by then)."""
        config = {**self.config.to_json(), "node": True}
        proc = _subproc.start_module(
            "trainguard.restart.sidecar", config, keep_stdin=False, new_session=True
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

    def refusal(self, error: object) -> str:
        return (
            f"this node's watcher does not watch this process: {error}; see "
            f"{node_log_path(self.config)} (or set TRAINGUARD_SIDECAR=process to run a sidecar "
            "process per rank)"
        )

    def loss(self) -> str:
        return "its connection to this node's watcher process closed (the watcher ended)"
