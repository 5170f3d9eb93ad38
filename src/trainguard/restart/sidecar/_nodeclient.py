"""A rank's handle of its node watcher (``TRAINGUARD_SIDECAR=node``, :mod:`._node`).

:class:`NodeSidecar` has the methods of :class:`~trainguard.restart.sidecar.Sidecar`, over the
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
import select
import socket
import subprocess

from trainguard import _subproc
from trainguard.errors import CoordinationError
from trainguard.restart.sidecar import _node
from trainguard.restart.sidecar._agent import AgentSidecar, check_listener
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._handle import handshake_reply, node_log_path

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
