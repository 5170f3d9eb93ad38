"""The node watcher's relay (:mod:`trainguard.restart.sidecar._relay`) and a rank's reader of
it (:class:`RelayReader`, in the same module): each round key read once per node at a real TCPStore, passed to every
rank that asked over a real socket, errors and the watcher's loss reaching every waiting rank."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from trainguard.coord import _wire
from trainguard.coord.keys import Keyspace
from trainguard.errors import CoordinationError
from trainguard.restart.sidecar._relay import Relay, RelayReader

KEYS = Keyspace("relay-test", 0)


class _Server:
    """A TCPStore server in a process of its own (its descriptors are not this process's,
    whose descriptors a later test counts) and a client that sets keys."""

    def __init__(self) -> None:
        code = (
            "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, "
            "is_master=True); print(s.port, flush=True); time.sleep(600)"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.proc.stdout.close()
        self.client = _wire.connect("127.0.0.1", self.port, timeout=30.0)

    def set(self, key: str, value: bytes) -> None:
        self.client.set(key, value)

    def close(self) -> None:
        self.client.close()
        self.proc.kill()
        self.proc.wait()


@pytest.fixture()
def server() -> Iterator[_Server]:
    srv = _Server()
    yield srv
    srv.close()


class _Node:
    """A relay and ``k`` ranks' readers, each over a socket pair; the watcher's ends are read
    by one thread that passes each ask to the relay (the node watcher's threads do)."""

    def __init__(self, relay: Relay, k: int) -> None:
        self.relay = relay
        self.pairs = [socket.socketpair() for _ in range(k)]
        self.readers = [RelayReader(ours, self._sender(ours)) for ours, _ in self.pairs]
        self.asks: list[tuple[str, int]] = []

    def _sender(self, sock: socket.socket) -> Any:
        lock = threading.Lock()

        def send(msg: dict[str, Any]) -> bool:
            self.asks.append((msg["relay"], msg["n"]))
            theirs = next(t for o, t in self.pairs if o is sock)

            def reply(line: bytes) -> None:
                with lock:
                    theirs.sendall(line)

            self.relay.ask(msg["relay"], msg["n"], reply)
            return True

        return send

    def close(self) -> None:
        for ours, theirs in self.pairs:
            ours.close()
            theirs.close()


@pytest.fixture()
def make_node(server: _Server) -> Iterator[Callable[..., _Node]]:
    """``make_node(k, connect=None)``: a relay (over pure-Python connections to ``server``
    unless ``connect`` says how) and ``k`` ranks' readers; every relay and socket closed at
    the test's end, pass or fail (a reader thread left waiting would be another test's leak)."""
    made: list[_Node] = []

    def wire() -> Any:
        return _wire.connect("127.0.0.1", server.port, timeout=30.0)

    def make(k: int, connect: Callable[[], Any] | None = None) -> _Node:
        node = _Node(Relay(KEYS, connect or wire), k)
        made.append(node)
        return node

    yield make
    for node in made:
        node.relay.close()
        node.close()


def test_each_key_is_read_once_for_every_rank_of_the_node(
    server: _Server, make_node: Callable[..., _Node]
) -> None:
    node = make_node(8)
    relay = node.relay
    got: dict[int, bytes | None] = {}

    def rank(i: int) -> None:
        got[i] = node.readers[i].wait("stop", 0, 30.0)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while len(node.asks) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == {}  # nobody got anything before the outcome was set
    server.set(KEYS.stop(0), b'{"why":"fault"}')
    for thread in threads:
        thread.join(30)
    assert got == {i: b'{"why":"fault"}' for i in range(8)}
    assert relay.reads == 1  # one store read served the eight ranks
    # a layout published before anyone asked, asked for early (ask) and then waited for
    server.set(KEYS.ready(1), b'{"round":1,"active":[[0,7]]}')
    for reader in node.readers:
        reader.ask("ready", 1)
    assert all(r.wait("ready", 1, 30.0) == b'{"round":1,"active":[[0,7]]}' for r in node.readers)
    assert relay.reads == 2
    assert node.asks.count(("ready", 1)) == 8  # asking again (wait after ask) sends nothing
    # a late asker of a kept value gets it without another store read
    assert node.readers[0].wait("stop", 0, 30.0) == b'{"why":"fault"}'
    assert relay.reads == 2


def test_a_wait_runs_out_and_the_watcher_s_loss_fails_every_wait(
    server: _Server, make_node: Callable[..., _Node]
) -> None:
    node = make_node(2)
    start = time.monotonic()
    assert node.readers[0].wait("ready", 5, 0.3) is None
    assert 0.25 <= time.monotonic() - start < 5.0
    assert node.readers[0].alive() and node.readers[1].alive()
    errors: list[BaseException] = []

    def wait_forever() -> None:
        try:
            node.readers[1].wait("stop", 5, None)
        except CoordinationError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait_forever)
    waiter.start()
    time.sleep(0.2)
    for _, theirs in node.pairs:  # the watcher ends: its ends of the connections close
        theirs.close()
    waiter.join(10)
    assert not waiter.is_alive()
    assert len(errors) == 1 and "watcher closed" in str(errors[0]), errors
    assert not node.readers[0].alive()
    with pytest.raises(CoordinationError, match="watcher closed"):
        node.readers[0].wait("ready", 6, 5.0)


def test_a_store_the_relay_cannot_reach_is_an_error_on_every_rank(
    make_node: Callable[..., _Node],
) -> None:
    def refuse() -> Any:
        raise CoordinationError("could not connect to the coordination store (test)")

    node = make_node(2, refuse)
    for reader in node.readers:
        with pytest.raises(CoordinationError, match=r"could not read round 3's layout.*test"):
            reader.wait("ready", 3, 10.0)


def test_close_interrupts_a_wait_under_way_and_leaves_no_thread(
    server: _Server, make_node: Callable[..., _Node]
) -> None:
    before = threading.active_count()
    node = make_node(1)
    relay = node.relay
    node.readers[0].ask("stop", 9)  # never set
    time.sleep(0.3)
    assert threading.active_count() == before + 1  # its reader waits at the store
    start = time.monotonic()
    relay.close()
    assert time.monotonic() - start < 3.0
    assert threading.active_count() == before
    relay.ask("stop", 10, lambda line: None)  # closed: ignored, no new thread
    assert threading.active_count() == before
    node.close()


def test_readers_are_reused_and_only_made_while_every_reader_waits(
    server: _Server, make_node: Callable[..., _Node]
) -> None:
    connections = []

    def connect() -> Any:
        store = _wire.connect("127.0.0.1", server.port, timeout=30.0)
        connections.append(store)
        return store

    node = make_node(4, connect)
    relay = node.relay
    for n in range(5):  # the usual order: a round's layout, then its outcome
        server.set(KEYS.ready(n), b"{}")
        assert all(r.wait("ready", n, 30.0) == b"{}" for r in node.readers)
        server.set(KEYS.stop(n), b"{}")
        assert all(r.wait("stop", n, 30.0) == b"{}" for r in node.readers)
    assert relay.reads == 10
    assert len(connections) == 1  # one reader, one connection, for ten keys in turn
    for reader in node.readers:  # two keys outstanding at once: a second reader
        reader.ask("stop", 7)
    server.set(KEYS.ready(7), b"{}")
    assert node.readers[0].wait("ready", 7, 30.0) == b"{}"
    # the second reader may have taken either key (whichever it found queued first), and it
    # may still be connecting: look once both keys are served
    server.set(KEYS.stop(7), b"{}")
    assert all(r.wait("stop", 7, 30.0) == b"{}" for r in node.readers)
    assert relay.reads == 12
    assert len(connections) == 2
