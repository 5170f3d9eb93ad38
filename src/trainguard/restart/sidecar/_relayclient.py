"""A rank's side of its node watcher's relay (:mod:`._relay`): round outcomes and layouts read
once per node and passed on over the rank's Unix socket to the watcher.

:class:`RelayReader` sends the asks and reads the replies. Two threads of the rank wait on it
(the monitor for an outcome, the main thread for a layout) and the watchdog polls it for the
watcher's loss, with no thread of its own: whoever waits reads the socket for everyone (one
reader at a time), files each reply under its key and wakes the others. The connection closing
(the watcher ended) fails every wait and makes :meth:`RelayReader.alive` False.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard.errors import CoordinationError
from trainguard.restart.sidecar._relay import WHAT

__all__ = ["RelayReader"]

_CHUNK = 65536
_KEEP = 4  # rounds of asks remembered (an ask is sent once)


class RelayReader:
    """Asks and replies over one rank's connection to its node watcher.

    Args:
        sock: the connection (its handshake already read).
        send: writes one message (a dict, as a JSON line) to the watcher; False when the
            connection is gone (the handle's ``send``, which serializes writers).
    """

    def __init__(self, sock: socket.socket, send: Callable[[dict[str, Any]], bool]) -> None:
        self._sock = sock
        self._send = send
        self._cond = threading.Condition()
        self._reading = False  # a thread reads the socket now
        self._closed = False
        self._buffer = b""
        self._replies: dict[tuple[str, int], bytes] = {}
        self._asked: set[tuple[str, int]] = set()

    def ask(self, kind: str, n: int) -> None:
        """Ask for round ``n``'s ``kind`` (``"stop"``: its outcome, ``"ready"``: its layout)
        without waiting: the relay starts waiting for it at the store, and its reply waits
        here for :meth:`wait`. Asking again before the reply was taken is a no-op."""
        with self._cond:
            if (kind, n) in self._asked:
                return
            self._asked.add((kind, n))
            self._asked -= {k for k in self._asked if k[1] < n - _KEEP}
        if not self._send({"relay": kind, "n": n}):
            self.close()

    def wait(self, kind: str, n: int, timeout: float | None) -> bytes | None:
        """Round ``n``'s ``kind``, asked for (:meth:`ask`) if it was not: its value, or None
        after ``timeout`` seconds (None: no limit).

        Raises :class:`CoordinationError` when the watcher could not read it or the
        connection closed."""
        self.ask(kind, n)
        deadline = None if timeout is None else time.monotonic() + timeout
        key = (kind, n)
        while True:
            with self._cond:
                while True:
                    reply = self._replies.pop(key, None)
                    if reply is not None:
                        self._asked.discard(key)  # taken: a later wait asks again
                        return _value(kind, n, reply)
                    if self._closed:
                        raise CoordinationError(
                            f"the connection to this node's watcher closed while waiting for "
                            f"round {n}'s {WHAT[kind]}"
                        )
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return None
                    if not self._reading:
                        self._reading = True
                        break
                    self._cond.wait(left)
            self._read(left)

    def alive(self) -> bool:
        """False once the connection closed (looks without waiting)."""
        with self._cond:
            if self._closed or self._reading:  # a reader sees the close itself
                return not self._closed
            self._reading = True
        self._read(0.0)
        with self._cond:
            return not self._closed

    def close(self) -> None:
        """Fail every wait (the connection is gone); the socket is the handle's to close."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _read(self, timeout: float | None) -> None:
        """One read of the socket, by the thread that set ``_reading``."""
        chunk: bytes | None = None
        try:
            try:  # a reply is usually there already: one system call, not two
                chunk = self._sock.recv(_CHUNK, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if timeout != 0.0 and _readable(self._sock, timeout):
                    chunk = self._sock.recv(_CHUNK)
        except (OSError, ValueError):  # closed under us (the handle stopped)
            chunk = b""
        with self._cond:
            self._reading = False
            if chunk == b"":
                self._closed = True
            elif chunk:
                self._file(chunk)
            self._cond.notify_all()

    def _file(self, chunk: bytes) -> None:
        """File the complete lines of ``chunk`` under their keys (lock held)."""
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                kind, n, reply = line.split(b" ", 2)
                self._replies[(kind.decode(), int(n))] = reply
            except ValueError:
                continue  # not a relay reply: nothing else is sent after the handshake


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    """Whether ``sock`` has data or was closed by the peer within ``timeout`` seconds (None:
    no limit). ``poll``, not ``select``: a training process may hold more than 1,024 files."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    if sock.fileno() < 0:
        raise OSError("the socket is closed")
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))


def _value(kind: str, n: int, reply: bytes) -> bytes:
    """The value of a reply (``=value``), or the error of one that says why it has none."""
    if reply[:1] == b"=":
        return reply[1:]
    why = reply[1:].decode(errors="replace")
    raise CoordinationError(f"this node's watcher could not read round {n}'s {WHAT[kind]}: {why}")
