"""The pure-Python TCPStore client against real torch TCPStore servers (libuv and classic)."""

from __future__ import annotations

import socket
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


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def server(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A real TCPStore server (hosted by this process) of either backend."""
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        use_libuv=request.param,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )
    yield store
    del store


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
