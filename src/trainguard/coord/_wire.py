"""A TCPStore client in pure Python: the c10d wire protocol over a socket, no torch import.

Helper processes (the sidecar, the node watcher) only talk to the coordination store; importing
torch for that costs each of them ~200 MB of memory and a second or two of CPU. :class:`WireStore`
has the methods of ``torch.distributed.TCPStore`` that the library's coordination code calls
(``set``, ``get``, ``add``, ``check``, ``wait``, ``compare_set``, ``multi_get``, ``multi_set``,
``append``, ``delete_key``, ``num_keys``, ``clone``; it is a
:class:`~trainguard.coord.store.StoreLike`) and the same semantics, against a real TCPStore server
(libuv or classic backend). A process that called :func:`activate` gets it from
:func:`trainguard.coord.store.connect`.

The protocol (torch 2.x, little-endian): on connecting, the client sends a validation query
(a query byte and a 32-bit magic number) and a ping (a 32-bit nonce the server echoes). Each
query is then one query byte followed by its arguments; a key or value is a 64-bit length
followed by its bytes, a count or an ``add`` delta a 64-bit integer. Every key carries the
client's prefix ``/`` (so keys written here and through torch are the same keys). ``get`` is a
wait then a get, as in torch; a wait that runs out of time is cancelled on the same connection
(the server acknowledges the cancel, or the wait's own answer came first and is skipped).

One request at a time per connection (a lock), like torch's client: use :meth:`WireStore.clone`
for a connection of its own. The server is not trusted to be sane:

- a value it announces longer than :data:`MAX_VALUE` (64 MiB; the library's values are a few
  KiB, a round layout of thousands of ranks a few hundred bytes) is refused before anything
  is read, and a value is read in pieces, so memory follows the bytes that arrived;
- each call has one deadline, the store timeout from its start (a wait's, from the moment its
  keys were set): a reply that trickles in a byte at a time fails at that deadline, not once
  per byte;
- a call that fails in any way but a wait that ran out of time (:class:`StoreTimeoutError`,
  cancelled cleanly) leaves the connection unusable (its stream position is lost): it is
  closed, and every later call raises :class:`CoordinationError` saying why.
"""

from __future__ import annotations

import contextlib
import enum
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta

from trainguard.errors import CoordinationError, StoreTimeoutError

__all__ = ["WireStore", "activate", "active", "connect"]

MAGIC = 0x3C85F7CE  # the validation number of torch's TCPStore protocol
_PREFIX = b"/"  # torch's TCPStore client puts this before every key
_HANDSHAKE_S = 10.0  # the longest the server may take to answer the validation ping
_HANDSHAKE_MIN_S = 3.0  # the least it gets, whatever the call timeout: loaded servers answer late
_READY = 0  # CHECK's answer when every key is set (1: not ready)
_STOP_WAITING = 0  # WAIT's answer when every key is set
_WAIT_CANCELED = 1  # CANCEL_WAIT's answer
#: the longest value a reply may announce (bytes): a longer one poisons the connection
MAX_VALUE = 64 << 20
_PIECE = 1 << 20  # the most one ``recv`` asks for

Value = str | bytes | bytearray | memoryview
WaitTime = float | timedelta | None


class _Query(enum.IntEnum):
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13


_active = False


def activate() -> None:
    """Make :func:`trainguard.coord.store.connect` return a :class:`WireStore` in this process.

    Called once by the entry point of a helper process that never imports torch; a process that
    imports torch keeps torch's client (its process groups and the abort path know its
    sockets)."""
    global _active
    _active = True


def active() -> bool:
    """Whether :func:`activate` was called in this process."""
    return _active


def connect(host: str, port: int, *, timeout: float) -> WireStore:
    """A :class:`WireStore` of ``host:port``; retries until the server is up or ``timeout``."""
    return WireStore(host, port, timeout=timeout)


def _seconds(value: WaitTime, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, timedelta):
        return value.total_seconds()
    return float(value)


def _blob(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _Request:
    """One query's bytes."""

    def __init__(self, query: _Query) -> None:
        self.data = bytearray((query,))

    def blob(self, value: Value) -> _Request:
        raw = _blob(value)
        self.data += struct.pack("<Q", len(raw))
        self.data += raw
        return self

    def key(self, key: str) -> _Request:
        return self.blob(_PREFIX + key.encode())

    def keys(self, keys: Sequence[str]) -> _Request:
        self.data += struct.pack("<Q", len(keys))
        for key in keys:
            self.key(key)
        return self

    def int64(self, value: int) -> _Request:
        self.data += struct.pack("<q", value)
        return self


class WireStore:
    """A client connection to a TCPStore server; see the module docstring.

    Args:
        host, port: the server.
        timeout: seconds, for connecting (retried while refused) and as the default of every
            operation (``wait`` and ``get`` wait this long for their keys).
    """

    def __init__(self, host: str, port: int, *, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.host = host
        self.port = port
        self.timeout = timedelta(seconds=timeout)
        self._timeout = float(timeout)
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._deadline = 0.0  # the call under way must be over by then (time.monotonic)
        self._sock = self._open()

    # connection ---------------------------------------------------------------------------
    def _open(self) -> socket.socket:
        deadline = time.monotonic() + self._timeout
        pause = 0.01
        while True:
            try:
                sock = socket.create_connection(
                    (self.host, self.port), timeout=max(0.01, deadline - time.monotonic())
                )
                break
            except OSError as exc:  # refused (not up yet), unreachable, timed out
                if time.monotonic() + pause >= deadline:
                    raise CoordinationError(
                        f"could not connect to the coordination store at {self.host}:"
                        f"{self.port} within {self._timeout:g} s ({exc}); check "
                        "MASTER_ADDR/MASTER_PORT or TRAINGUARD_STORE_ADDR"
                    ) from exc
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._validate(sock)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(self._timeout)
        return sock

    def _validate(self, sock: socket.socket) -> None:
        nonce = os.getpid() & 0xFFFFFFFF
        budget = min(_HANDSHAKE_S, max(self._timeout, _HANDSHAKE_MIN_S))
        sock.settimeout(budget)
        hello = bytes((_Query.VALIDATE,)) + struct.pack("<I", MAGIC)
        hello += bytes((_Query.PING,)) + struct.pack("<I", nonce)
        why = None
        try:
            sock.sendall(hello)
            echo = _recv_exact(sock, 4, time.monotonic() + budget)
            if struct.unpack("<I", echo)[0] != nonce:
                why = f"it answered the ping with {echo.hex()}"
        except TimeoutError:
            why = "no answer to the validation ping"
        except (OSError, EOFError) as exc:
            why = f"it closed the connection ({exc or 'end of stream'})"
        if why is not None:
            raise CoordinationError(
                f"the server at {self.host}:{self.port} rejected trainguard's TCPStore client "
                f"({why}): it is not a torch TCPStore server, or one whose wire protocol differs "
                f"from torch 2.x's (validation magic {MAGIC:#x}); point the job at the store "
                "that trainguard started, or use the same torch version on every host"
            )

    def clone(self) -> WireStore:
        """A new connection to the same server (torch's ``TCPStore.clone``)."""
        return WireStore(self.host, self.port, timeout=self._timeout)

    def close(self) -> None:
        """Close the connection (idempotent); later calls raise :class:`CoordinationError`."""
        with self._lock:
            self._broken = self._broken or "closed"
            self._sock.close()

    def interrupt(self) -> None:
        """Close the connection from another thread, without waiting for a call under way
        (a ``wait`` holds the lock until its keys are set): that call raises
        :class:`CoordinationError` at once, and so does every later one."""
        self._broken = self._broken or "interrupted"
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()

    def __repr__(self) -> str:
        return f"WireStore({self.host}:{self.port})"

    # the operations -----------------------------------------------------------------------
    def set(self, key: str, value: Value) -> None:
        self._call(_Request(_Query.SET).key(key).blob(value), None)

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store timeout for it to be set."""
        with self._using():
            self._wait_locked([key], self._timeout)
            self._send(_Request(_Query.GET).key(key))
            return self._recv_blob()

    def add(self, key: str, amount: int) -> int:
        reply = self._call(_Request(_Query.ADD).key(key).int64(int(amount)), 8)
        return int(struct.unpack("<q", reply)[0])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set ``key`` to ``desired`` if its value is ``expected`` (or it is unset and
        ``expected`` is empty); returns the value it then has (or ``expected`` when it is unset
        and ``expected`` is not empty), as torch's does."""
        request = _Request(_Query.COMPARE_SET).key(key).blob(expected).blob(desired)
        with self._using():
            self._send(request)
            return self._recv_blob()

    def check(self, keys: Sequence[str]) -> bool:
        reply = self._call(_Request(_Query.CHECK).keys(keys), 1)
        return reply[0] == _READY

    def wait(self, keys: Sequence[str], timeout: WaitTime = None) -> None:
        """Until every key of ``keys`` is set; :class:`StoreTimeoutError` after ``timeout``
        (seconds or a timedelta; default the store timeout)."""
        with self._using():
            self._wait_locked(keys, _seconds(timeout, self._timeout))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to the store timeout for all of them."""
        with self._using():
            self._wait_locked(keys, self._timeout)
            self._send(_Request(_Query.MULTI_GET).keys(keys))
            return [self._recv_blob() for _ in keys]

    def multi_set(self, keys: Sequence[str], values: Iterable[Value]) -> None:
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        request = _Request(_Query.MULTI_SET)
        request.data += struct.pack("<Q", len(keys))
        for key, value in zip(keys, values, strict=True):
            request.key(key).blob(value)
        self._call(request, None)

    def append(self, key: str, value: Value) -> None:
        """Add ``value`` at the end of ``key``'s value (setting it when unset); no answer."""
        self._call(_Request(_Query.APPEND).key(key).blob(value), None)

    def delete_key(self, key: str) -> bool:
        reply = self._call(_Request(_Query.DELETE_KEY).key(key), 8)
        return bool(struct.unpack("<q", reply)[0] == 1)

    def num_keys(self) -> int:
        reply = self._call(_Request(_Query.GETNUMKEYS), 8)
        return int(struct.unpack("<q", reply)[0])

    # plumbing (the lock held) -------------------------------------------------------------
    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """One call: the lock, a usable connection, the call's deadline; whatever goes wrong
        in it but a clean wait timeout leaves the connection unusable."""
        with self._lock:
            if self._broken is not None:
                raise CoordinationError(f"{self!r}: the connection is unusable ({self._broken})")
            self._deadline = time.monotonic() + self._timeout
            try:
                yield
            except StoreTimeoutError:
                raise  # cancelled in step: the connection stays usable
            except BaseException as exc:
                if self._broken is None:  # not yet failed by _fail: an unforeseen error
                    self._fail(f"a call failed ({type(exc).__name__}: {exc})")
                raise

    def _call(self, request: _Request, reply: int | None) -> bytes:
        with self._using():
            self._send(request)
            return b"" if reply is None else self._recv(reply)

    def _wait_locked(self, keys: Sequence[str], timeout: float) -> None:
        self._send(_Request(_Query.WAIT).keys(keys))
        try:
            ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        except (OSError, ValueError) as exc:
            raise self._fail(f"the connection failed ({exc})") from exc
        self._deadline = time.monotonic() + self._timeout  # the rest of the call from here
        if ready:
            self._expect(_STOP_WAITING, "WAIT")
            return
        self._send(_Request(_Query.CANCEL_WAIT))
        if self._recv(1)[0] != _WAIT_CANCELED:  # the keys came first: its cancel follows
            self._expect(_WAIT_CANCELED, "CANCEL_WAIT")
        names = ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")
        raise StoreTimeoutError(f"wait timeout after {timeout:g} s, keys: {names}")

    def _expect(self, answer: int, query: str) -> None:
        got = self._recv(1)[0]
        if got != answer:
            raise self._fail(f"the server answered {query} with {got}, expected {answer}")

    def _send(self, request: _Request) -> None:
        if self._broken is not None:
            raise CoordinationError(f"{self!r}: the connection is unusable ({self._broken})")
        try:
            self._sock.settimeout(max(0.001, self._deadline - time.monotonic()))
            self._sock.sendall(request.data)
        except OSError as exc:
            raise self._fail(f"sending failed ({exc})") from exc

    def _recv(self, n: int) -> bytes:
        try:
            return _recv_exact(self._sock, n, self._deadline)
        except TimeoutError as exc:
            raise self._fail(f"no whole reply within {self._timeout:g} s") from exc
        except (OSError, EOFError) as exc:
            raise self._fail(
                f"the server closed the connection ({exc or 'end of stream'})"
            ) from exc

    def _recv_blob(self) -> bytes:
        (size,) = struct.unpack("<Q", self._recv(8))
        if size > MAX_VALUE:
            raise self._fail(
                f"the server announced a value of {size} bytes, more than MAX_VALUE "
                f"({MAX_VALUE} bytes): it is not a sane TCPStore server, or another program "
                "writes huge values into this job's store"
            )
        return self._recv(size) if size else b""

    def _fail(self, why: str) -> CoordinationError:
        """The connection is lost or out of step: close it, the error to raise."""
        self._broken = why
        self._sock.close()
        return CoordinationError(f"{self!r}: {why}")


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, read in pieces of at most :data:`_PIECE`; ``TimeoutError`` once
    ``deadline`` (``time.monotonic``) passed, however the bytes trickle in."""
    data = bytearray()
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(data), _PIECE))
        if not chunk:
            raise EOFError("end of stream")
        data += chunk
    return bytes(data)
