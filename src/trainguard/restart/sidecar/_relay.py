"""The node watcher's relay: each round's outcome and layout read once per node, not per rank.

A rank's monitor waits for its round's outcome and its main thread for the next round's layout.
Each doing so at the store costs the store one wake-up and one read per rank, and each rank a
store connection kept for those waits. The ranks ask their helper (the node watcher, or the
launcher's agent) instead, over the Unix socket they already hold (the rank's side:
:class:`RelayReader`), and the watcher's one :class:`Relay` reads each key once for all of
them:

1. A rank sends ``{"relay": "stop" | "ready", "n": n}``: it wants round ``n``'s outcome or
   layout.
2. The first such request for a key hands it to a reader thread of the relay, which waits for
   it at the store on a connection of its own and reads it; the requests that come meanwhile
   are queued. A reader that is done takes the next key; a new one (and its connection) is
   made only when every reader is waiting: two per node in practice (the outcome of round
   ``n`` and the layout of round ``n+1`` overlap).
3. The value is sent to every rank that asked, one line each: ``<kind> <n> =<value>`` (the
   value is one line of JSON, as the library writes it), or ``<kind> <n> !<why>`` when the
   store failed. A rank asking later gets the kept value at once (the last few rounds' values
   are kept).

The relay writes nothing to the store, so the round protocol is the same as without it
(:mod:`trainguard.restart._book`); only who reads changes. Times: a rank learns the outcome
one store round trip plus one local message after it is set, as it did from its own wait.

Both sides of the protocol live here: :class:`Relay` runs in the watcher (a process that never
imports torch), :class:`RelayReader` in each rank. A rank's reader sends the asks and reads the
replies. Two threads of the rank wait on it (the monitor for an outcome, the main thread for a
layout) and the watchdog polls it for the watcher's loss, with no thread of its own: whoever waits reads the socket for everyone (one
reader at a time), files each reply under its key and wakes the others. The connection closing
(the watcher ended) fails every wait and makes :meth:`RelayReader.alive` False.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard.coord.barrier import wait_forever
from trainguard.coord.keys import Keyspace
from trainguard.coord.store import StoreLike
from trainguard.errors import CoordinationError

__all__ = ["KINDS", "WHAT", "Relay", "RelayReader"]

logger = logging.getLogger("trainguard.restart.sidecar")

#: what a rank may ask for -> the key of round n that holds it
KINDS: dict[str, Callable[[Keyspace, int], str]] = {
    "stop": Keyspace.stop,
    "ready": Keyspace.ready,
}
_KEEP = 4  # rounds of values kept for late askers, per kind
#: what each kind holds, for messages
WHAT = {"stop": "outcome", "ready": "layout"}

Send = Callable[[bytes], object]


class _Entry:
    def __init__(self) -> None:
        self.line: bytes | None = None  # the reply, once read
        self.waiting: list[Send] = []


class Relay:
    """The reads of one wrapped call's round keys for the ranks of one node.

    Args:
        keys: the call's keyspace.
        connect: makes a new store connection (each reader thread makes its own).
    """

    def __init__(self, keys: Keyspace, connect: Callable[[], StoreLike]) -> None:
        self.keys = keys
        self._connect = connect
        self._cond = threading.Condition()
        self._entries: dict[tuple[str, int], _Entry] = {}
        self._queue: list[tuple[str, int, _Entry]] = []  # keys no reader waits for yet
        self._idle = 0  # reader threads waiting for a key to wait for
        self._readers: list[threading.Thread] = []
        self._stores: set[StoreLike] = set()  # the readers' connections
        self._closed = False
        self.reads = 0  # store reads made (one per key), for tests and benchmarks

    def ask(self, kind: str, n: int, send: Send) -> None:
        """One rank asks for round ``n``'s ``kind`` (a key of :data:`KINDS`); ``send`` gets
        the reply line (from this call or from a reader thread). Unknown kinds and a closed
        relay are ignored (the rank's own timeout ends its wait)."""
        if kind not in KINDS:
            logger.warning("a rank asked the relay for %r, which it does not relay", kind)
            return
        with self._cond:
            if self._closed:
                return
            entry = self._entries.get((kind, n))
            if entry is None:
                entry = self._entries[(kind, n)] = _Entry()
                entry.waiting.append(send)
                self._forget_old(kind, n)
                self._queue.append((kind, n, entry))
                if self._idle:  # an idle reader takes it: no longer counted idle
                    self._idle -= 1
                    self._cond.notify()
                else:  # every reader waits at the store: one more (a few per node at most)
                    thread = threading.Thread(target=self._reader, name="tg-relay", daemon=True)
                    self._readers.append(thread)
                    thread.start()
                return
            line = entry.line
            if line is None:
                entry.waiting.append(send)
                return
        send(line)

    def value(self, kind: str, n: int) -> bytes | None:
        """Round ``n``'s ``kind`` as read already (no store request); None when it was not
        read (or could not be)."""
        with self._cond:
            entry = self._entries.get((kind, n))
            line = entry.line if entry is not None else None
        if line is None:
            return None
        _, sep, value = line.partition(b" =")
        return value.rstrip(b"\n") if sep else None

    def hook(self, sock: socket.socket) -> Callable[[dict[str, Any]], None]:
        """What a helper's :attr:`Watch.on_relay <trainguard.restart.sidecar._watch.Watch.
        on_relay>` calls with each ask of the rank connected on ``sock``: the ask goes to this
        relay, its reply is written on ``sock`` (one line at a time, from any thread)."""
        lock = threading.Lock()

        def send(line: bytes) -> None:
            with lock:
                sock.sendall(line)

        return lambda msg: self.ask(str(msg["relay"]), int(msg["n"]), send)

    def close(self, timeout: float = 5.0) -> None:
        """Stop: waits under way are interrupted (their ranks get nothing more), connections
        closed, threads joined (up to ``timeout`` each)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            stores = list(self._stores)
            readers = list(self._readers)
        for store in stores:
            _interrupt(store)
        for thread in readers:
            thread.join(timeout)

    # the reader threads --------------------------------------------------------------------
    def _forget_old(self, kind: str, n: int) -> None:
        """Drop the values of ``kind`` older than the last :data:`_KEEP` rounds (lock held)."""
        for key in [k for k in self._entries if k[0] == kind and k[1] <= n - _KEEP]:
            if self._entries[key].line is not None:
                del self._entries[key]

    def _reader(self) -> None:
        """Take the next key nobody waits for, wait for it and read it, pass it on; again.
        A reader counts itself idle when it is done with a key; :meth:`ask` takes it off the
        count when it queues a key for it (so two keys queued at once never wait for the same
        reader while the other waits at the store)."""
        store = None
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._stores.discard(store)
                    break
                kind, n, entry = self._queue.pop(0)
            store, line = self._read(store, kind, n)
            with self._cond:
                self.reads += 1
                entry.line = line
                waiting, entry.waiting = entry.waiting, []
                self._idle += 1
                closed = self._closed
            if closed:
                break
            logger.info("relayed round %d's %s to %d rank(s)", n, WHAT[kind], len(waiting))
            for send in waiting:
                with contextlib.suppress(Exception):  # a rank gone meanwhile: its watch ends
                    send(line)
        if store is not None:
            _close(store)

    def _read(self, store: StoreLike | None, kind: str, n: int) -> tuple[StoreLike | None, bytes]:
        """Round ``n``'s ``kind`` waited for and read on ``store`` (connected first when
        None): the connection to keep (None after a failure) and the reply line."""
        try:
            if store is None:
                store = self._connect()
                with self._cond:
                    self._stores.add(store)
                    if self._closed:
                        _interrupt(store)
            value = wait_forever(store, KINDS[kind](self.keys, n))
            if b"\n" in value:
                raise ValueError("its value is not one line of JSON")
            line = b"%s %d =%s\n" % (kind.encode(), n, value)
        except Exception as exc:
            with self._cond:
                self._stores.discard(store)
                closed = self._closed
            if not closed:
                logger.warning("the relay's wait for round %d's %s failed: %s", n, kind, exc)
            if store is not None:
                _close(store)
            store = None
            why = f"{type(exc).__name__}: {exc}".replace("\n", " ")
            line = b"%s %d !%s\n" % (kind.encode(), n, why.encode())
        return store, line


def _interrupt(store: StoreLike) -> None:
    """Wake a wait under way on ``store`` and close it (the pure-Python client's
    :meth:`~trainguard.coord._wire.WireStore.interrupt`; torch's client has no such call and
    is dropped)."""
    interrupt = getattr(store, "interrupt", None)
    if interrupt is not None:
        with contextlib.suppress(Exception):
            interrupt()


def _close(store: StoreLike) -> None:
    """Close ``store`` now (its owner's thread, no call under way) rather than when it is
    collected: a descriptor must not outlive the relay."""
    close = getattr(store, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()


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
