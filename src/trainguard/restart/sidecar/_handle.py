"""The training process's handle of its sidecar process.

:class:`Sidecar` starts it with ``python -m trainguard.restart.sidecar`` (a fresh interpreter
that does not import the user's ``__main__``, see :mod:`trainguard._subproc`), sends its
configuration as the first line on its stdin, waits for its handshake line, feeds it lines on
its stdin (``{"round"}`` after each barrier, ``{"hb"}`` from the watchdog thread, ``{"bye"}`` at
the end) and reaps it. Its log is :func:`log_path`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import subprocess
from pathlib import Path
from typing import IO, Any

from trainguard import _private, _subproc
from trainguard.errors import CoordinationError
from trainguard.restart.sidecar._config import SidecarConfig

logger = logging.getLogger(__name__)


def log_path(config: SidecarConfig) -> Path:
    """The sidecar's log: ``<events dir>/sidecar-<rank>.log``, or without an events directory
    ``sidecar-<job>-<call>-<rank>.log`` in this user's private directory
    (:func:`trainguard._private.private_dir`), where no other user can plant a file. It is
    opened without following links; when it cannot be opened the sidecar logs to the other
    place, then to stderr."""
    if config.log_dir:
        return Path(config.log_dir) / f"sidecar-{config.rank}.log"
    return private_log(config)


def private_log(config: SidecarConfig) -> Path:
    """The log's place in this user's private directory."""
    return _private.private_dir() / f"sidecar-{config.job}-{config.call}-{config.rank}.log"


def node_log_path(config: SidecarConfig) -> Path:
    """The node watcher's log (``TRAINGUARD_SIDECAR=node``): ``sidecar-node-<host>.log`` in
    the events directory, else ``sidecar-node-<job>-<call>.log`` in the private directory."""
    if config.log_dir:
        return Path(config.log_dir) / f"sidecar-node-{socket.gethostname()}.log"
    return _private.private_dir() / f"sidecar-node-{config.job}-{config.call}.log"


def handshake_reply(line: bytes) -> dict[str, Any]:
    """A handshake line (the sidecar's or the agent's), parsed: ``{"ok": True, ...}`` or
    ``{"ok": False, "error": ...}``, also for a missing or unreadable line."""
    try:
        reply = json.loads(line) if line else {"ok": False, "error": "no handshake"}
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        return {"ok": False, "error": f"unreadable handshake {line!r}"}
    return reply


class Sidecar:
    """Training-process side: start, send lines, notice the sidecar's death, stop."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        self.error: str | None = None

    def start(self) -> Sidecar:
        self.proc = _subproc.start_module(
            "trainguard.restart.sidecar", self.config.to_json(), keep_stdin=True
        )
        self._stdin = self.proc.stdin
        return self

    def handshake(self, timeout: float) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        self.proc.stdout.close()
        reply = handshake_reply(line)
        if not reply.get("ok"):
            self.stop(0.0)
            raise CoordinationError(
                f"the sidecar process could not start: {reply.get('error')}; see "
                f"{log_path(self.config)}"
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def loss(self) -> str:
        """Why :meth:`alive` is False, for the watchdog's report."""
        code = self.proc.returncode if self.proc is not None else None
        return f"its sidecar process died (exit code {code})"

    def send(self, message: dict[str, Any]) -> bool:
        """One line to the sidecar (from any thread); False if it is gone."""
        if self._stdin is None:
            return False
        try:
            self._stdin.write(json.dumps(message).encode() + b"\n")
            self._stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Say goodbye and wait for the exit (killed past ``timeout``); no zombie is left."""
        if self.proc is None:
            return
        self.send({"bye": 1})
        with contextlib.suppress(OSError):
            if self._stdin is not None:
                self._stdin.close()
        self._stdin = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("sidecar did not exit within %.1f s; killing it", timeout)
            self.proc.kill()
            self.proc.wait()
        self.proc = None
