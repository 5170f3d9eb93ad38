"""The node watchers of bench/_coord_sim.py's simulated ranks: a real relay per node.

:class:`Nodes` gives each node of simulated ranks the library's
:class:`~trainguard.restart.sidecar._relay.Relay` and each rank a real socket pair to it;
:class:`NoNodes` stands for no relay (each rank waits at the store itself).
"""

from __future__ import annotations

import socket
import threading
from typing import Any


class NoNodes:
    """No relays: each simulated rank waits at the store itself (``TRAINGUARD_SIDECAR=process``:
    a sidecar process per rank has no relay)."""

    def ops(self) -> int:
        return 0

    def tids(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


class Nodes:
    """The node watchers' relays of a worker's simulated ranks (:mod:`trainguard.restart.
    sidecar._relay`): one :class:`Relay` per node of :data:`LOCAL` ranks, with store
    connections of its own (counted), and per rank a real socket pair: the rank's
    :class:`RelayReader` on one end (:attr:`Session.relay`), the watcher's end read by one
    dispatcher thread for all of the worker's nodes (the node watcher has a thread per rank),
    which passes each ask to its node's relay."""

    def __init__(self, worker: Any, sessions: list[Any]) -> None:
        import json
        import selectors

        from bench._coord_worker import LOCAL, Counting
        from trainguard.coord.store import connect
        from trainguard.restart.sidecar._relay import Relay
        from trainguard.restart.sidecar._relayclient import RelayReader

        self.counters: list[list[int]] = []
        port = worker.spec["port"]

        def connect_counted() -> Any:
            counter = [0, 0, 0]
            self.counters.append(counter)
            return Counting(connect("127.0.0.1", port, timeout=300.0), counter)

        self.relays: dict[int, Any] = {}
        self.selector = selectors.DefaultSelector()
        self.socks: list[socket.socket] = []
        for session in sessions:
            node = session.irank // LOCAL
            relay = self.relays.get(node)
            if relay is None:
                relay = self.relays[node] = Relay(worker.keys, connect_counted)
            ours, theirs = socket.socketpair()
            self.socks += [ours, theirs]
            send_lock = threading.Lock()

            def send(
                msg: dict[str, Any], sock: socket.socket = ours, lock: Any = send_lock
            ) -> bool:
                with lock:
                    sock.sendall(json.dumps(msg).encode() + b"\n")
                return True

            session.relay = RelayReader(ours, send)
            self.selector.register(theirs, selectors.EVENT_READ, (relay, [b""], threading.Lock()))
        self.stop_r, self.stop_w = socket.socketpair()
        self.selector.register(self.stop_r, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._dispatch, name="sim-watchers", daemon=True)
        self.thread.start()

    def _dispatch(self) -> None:
        import json

        while True:
            for key, _ in self.selector.select():
                if key.data is None:
                    return
                relay, buffer, lock = key.data
                sock = key.fileobj
                chunk = sock.recv(65536)  # type: ignore[union-attr]
                buffer[0] += chunk
                *lines, buffer[0] = buffer[0].split(b"\n")
                for line in lines:
                    msg = json.loads(line)

                    def reply(data: bytes, sock: Any = sock, lock: Any = lock) -> None:
                        with lock:
                            sock.sendall(data)

                    relay.ask(str(msg["relay"]), int(msg["n"]), reply)

    def ops(self) -> int:
        """Store operations of the relays so far."""
        return sum(c[0] for c in list(self.counters))

    def tids(self) -> list[int]:
        """The helpers' threads: the dispatcher and every relay's readers."""
        threads = [self.thread]
        for relay in list(self.relays.values()):
            threads += list(relay._readers)
        return [t.native_id for t in threads if t.native_id is not None]

    def close(self) -> None:
        self.stop_w.send(b"x")
        self.thread.join(30.0)
        for relay in self.relays.values():
            relay.close()
        self.selector.close()
        for sock in [*self.socks, self.stop_r, self.stop_w]:
            sock.close()
