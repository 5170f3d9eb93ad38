"""The pure-Python TCPStore client against real torch TCPStore servers (libuv and classic)."""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from trainguard.coord import _wire, timed_out, wait_all
from trainguard.coord._wire import WireStore
from trainguard.errors import CoordinationError, StoreTimeoutError


def test_values_cross_between_torch_and_wire_clients(server: Any) -> None:
    wire = WireStore("127.0.0.1", server.port, timeout=30)
    wire.set("from_wire", "a")
    server.set("from_torch", b"\x00b\xff")
    assert bytes(server.get("from_wire")) == b"a"
    assert wire.get("from_torch") == b"\x00b\xff"
    server.set("empty", b"")
    assert wire.get("empty") == b""
    assert wire.check(["from_wire", "from_torch", "empty"])
    assert not wire.check(["from_wire", "never"])
    # add: the counter is shared, and readable by either
    assert wire.add("n", 5) == 5
    assert server.add("n", 2) == 7
    assert wire.add("n", -10) == -3
    assert wire.get("n") == b"-3"
    # multi_set / multi_get
    wire.multi_set(["m1", "m2"], ["x", b"y"])
    assert [bytes(v) for v in server.multi_get(["m1", "m2"])] == [b"x", b"y"]
    assert wire.multi_get(["m2", "from_torch"]) == [b"y", b"\x00b\xff"]
    # compare_set: torch's semantics
    assert wire.compare_set("cs", "", "first") == b"first"  # unset, expected empty: set
    assert wire.compare_set("cs", "", "second") == b"first"  # set: no change
    assert wire.compare_set("cs", "first", b"third") == b"third"
    assert bytes(server.get("cs")) == b"third"
    assert wire.compare_set("unset", "zz", "v") == b"zz"  # unset, expected not empty
    assert not server.check(["unset"])
    # delete_key, num_keys
    before = wire.num_keys()
    assert before == server.num_keys()
    assert wire.delete_key("cs")
    assert not wire.delete_key("cs")
    assert not server.check(["cs"])
    assert wire.num_keys() == before - 1
    clone = wire.clone()
    assert clone.get("m1") == b"x"
    clone.close()
    with pytest.raises(CoordinationError, match="unusable"):
        clone.get("m1")
    wire.close()


def test_wait_wakes_on_a_set_and_times_out_cleanly(server: Any) -> None:
    wire = WireStore("127.0.0.1", server.port, timeout=30)
    woke: list[float] = []

    def waiter() -> None:
        mine = wire.clone()
        mine.wait(["w1", "w2"], timedelta(seconds=20))
        woke.append(time.monotonic())
        mine.close()

    thread = threading.Thread(target=waiter)
    thread.start()
    server.set("w1", "1")
    time.sleep(0.2)
    assert not woke  # one of two keys: still waiting
    set_at = time.monotonic()
    server.set("w2", "2")
    thread.join(20)
    assert woke and woke[0] - set_at < 5.0
    # a timeout raises the error timed_out() recognizes, and the connection stays usable
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        wire.wait(["never"], 0.3)
    assert 0.25 <= time.monotonic() - start < 5.0
    assert timed_out(info.value)
    assert not wait_all(wire, ["never"], 0.1)
    assert wire.add("after", 1) == 1
    # get of a key never set waits the store timeout, then times out
    short = WireStore("127.0.0.1", server.port, timeout=0.3)
    with pytest.raises(StoreTimeoutError):
        short.get("never")
    assert short.check(["w1"])
    short.close()
    wire.close()


def test_a_lost_server_and_a_rejecting_server_are_clear_errors(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a server that speaks another version of the protocol: a validation number it rejects
    monkeypatch.setattr(_wire, "MAGIC", 0x12345678)
    monkeypatch.setattr(_wire, "_HANDSHAKE_S", 1.0)
    with pytest.raises(CoordinationError, match="rejected trainguard's TCPStore client"):
        WireStore("127.0.0.1", server.port, timeout=30)
    monkeypatch.undo()
    # no server at all: refused until the timeout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(CoordinationError, match="could not connect"):
        WireStore("127.0.0.1", port, timeout=0.5)
    assert time.monotonic() - start < 5.0
    # the server drops the connection (an add to a value that is no number): later calls fail
    wire = WireStore("127.0.0.1", server.port, timeout=5)
    server.set("text", "abc")  # no reply to a set: read it back, so that it is in first
    assert wire.get("text") == b"abc"
    with pytest.raises(CoordinationError, match="closed the connection"):
        wire.add("text", 1)
    with pytest.raises(CoordinationError, match="unusable"):
        wire.check(["text"])
    with pytest.raises(ValueError, match="timeout"):
        WireStore("127.0.0.1", server.port, timeout=0)


def test_importing_the_client_and_the_sidecar_imports_no_torch() -> None:
    code = (
        "import sys, trainguard.coord._wire, trainguard.coord.store, trainguard.coord.barrier\n"
        "import trainguard.restart.sidecar._watch\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@contextlib.contextmanager
def _hostile_server(reply: bytes, *, pace: float = 0.0) -> Iterator[int]:
    """A server that speaks bytes: it passes the client's validation, then answers the first
    request with ``reply`` (one byte every ``pace`` seconds when ``pace``), then holds the
    connection open until the client closes it. Yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    stop = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            hello = b""
            while len(hello) < 10:  # VALIDATE + magic, PING + nonce
                hello += conn.recv(10 - len(hello))
            conn.sendall(hello[6:10])  # the nonce back
            conn.recv(4096)  # the request
            for i in range(len(reply)) if pace else [None]:
                if stop.wait(pace):
                    return
                conn.sendall(reply if i is None else reply[i : i + 1])
            conn.settimeout(0.1)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    if not conn.recv(4096):  # the client closed it
                        return

    def serve_quietly() -> None:
        with contextlib.suppress(OSError):  # the client reset it: unread bytes at its close
            serve()

    thread = threading.Thread(target=serve_quietly)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(10)
        listener.close()


@pytest.mark.parametrize("length", [1 << 63, 1 << 36])
def test_a_hostile_length_is_refused_and_poisons_the_connection(length: int) -> None:
    # 2^63 overflowed recv(), 2^36 asked for 64 GiB; the bytes after it are never read as a reply
    leftover = struct.pack("<Q", 3) + b"abc"
    with _hostile_server(struct.pack("<Q", length) + leftover) as port:
        wire = WireStore("127.0.0.1", port, timeout=5)
        with pytest.raises(CoordinationError, match="more than MAX_VALUE"):
            wire.compare_set("k", "", "v")
        with pytest.raises(CoordinationError, match=r"unusable.*more than MAX_VALUE"):
            wire.compare_set("k", "", "v")
        wire.close()


def test_a_trickling_reply_fails_at_the_calls_deadline() -> None:
    # 8 bytes, one every 0.4 s: each recv is quick, the call is not
    with _hostile_server(struct.pack("<q", 1), pace=0.4) as port:
        wire = WireStore("127.0.0.1", port, timeout=1.0)
        start = time.monotonic()
        with pytest.raises(CoordinationError, match="no whole reply within 1 s"):
            wire.add("k", 1)
        assert time.monotonic() - start < 2.0
        with pytest.raises(CoordinationError, match="unusable"):
            wire.add("k", 1)
        wire.close()


@contextlib.contextmanager
def _late_proxy(port: int, delay: float) -> Iterator[int]:
    """A TCP relay to ``127.0.0.1:port`` that holds the server's first answer back ``delay``
    seconds, as a server on a loaded host answers late. Yields the relay's port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket, hold: float) -> None:
        src.settimeout(0.1)
        held = False
        while not stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            if not held:
                held = True
                if stop.wait(hold):
                    return
            try:
                dst.sendall(data)
            except OSError:
                return

    def serve() -> None:
        with contextlib.suppress(OSError):
            client, _ = listener.accept()
            upstream = socket.create_connection(("127.0.0.1", port))
            with client, upstream:
                back = threading.Thread(target=pump, args=(upstream, client, delay))
                back.start()
                pump(client, upstream, 0.0)
                stop.set()
                back.join(10)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        thread.join(10)


def test_a_late_validation_answer_is_not_a_rejection(server: Any) -> None:
    # the validation ping answered 1 s late (a loaded store host) by a client whose per-call
    # timeout is 0.3 s: it connects, and the short timeout still holds for its calls
    with _late_proxy(server.port, 1.0) as port:
        start = time.monotonic()
        short = WireStore("127.0.0.1", port, timeout=0.3)
        assert time.monotonic() - start >= 0.9
        server.set("late", "v")
        assert short.get("late") == b"v"
        begun = time.monotonic()
        with pytest.raises(StoreTimeoutError):
            short.wait(["never-set"], 0.3)
        assert time.monotonic() - begun < 5.0
        short.close()
