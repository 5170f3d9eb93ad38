"""The node watchers of bench/_coord_sim.py's simulated ranks: a real relay per node.

:class:`Nodes` gives each node of simulated ranks the library's
:class:`~trainguard.restart.sidecar._relay.Relay` and each rank a real socket pair to it;
:class:`NoNodes` stands for no relay (each rank waits at the store itself). With ``arrival``
(node arrival, ``TRAINGUARD_NODE_ARRIVAL=1``) each node also has the library's
:class:`~trainguard.restart.sidecar._arrival.NodeArrival`, which gets the ranks' records over
the same sockets and arrives for them; a :class:`_SimWatch` per rank stands for the node
watcher's watch of it (the round it entered and its roster, its end).
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

    def by_op(self) -> dict[str, int]:
        return {}

    def entered(self, session: Any, k: int) -> None:
        pass

    def gone(self, session: Any) -> None:
        pass

    def laid(self, k: int) -> float:
        return 0.0

    def tids(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


class _SimWatch:
    """What :class:`NodeArrival` reads of a node watcher's watch of one simulated rank."""

    def __init__(self, session: Any, cfg: Any) -> None:
        self.session = session
        self.rank = session.irank
        self.cfg = cfg
        self.round = -1  # the round the rank entered last (its "round" line)
        self.on_arrive: Any = None
        self.on_end: Any = None

    def position(self) -> tuple[int, Any]:
        return self.round, self.session.book.roster


class Nodes:
    """The node watchers' relays of a worker's simulated ranks (:mod:`trainguard.restart.
    sidecar._relay`): one :class:`Relay` per node of :data:`LOCAL` ranks, with store
    connections of its own (counted), and per rank a real socket pair: the rank's
    :class:`RelayReader` on one end (:attr:`Session.relay`), the watcher's end read by one
    dispatcher thread for all of the worker's nodes (the node watcher has a thread per rank),
    which passes each ask to its node's relay."""

    def __init__(self, worker: Any, sessions: list[Any], *, arrival: bool = False) -> None:
        import json
        import selectors

        from bench._coord_worker import LOCAL, Counting, _sidecar_config
        from trainguard.coord.store import connect
        from trainguard.restart.sidecar._arrival import NodeArrival
        from trainguard.restart.sidecar._relay import Relay, RelayReader

        self.counters: list[list[int]] = []
        self.by_ops: list[dict[str, int]] = []  # per connection: its calls by name and key
        port = worker.spec["port"]

        def connect_counted() -> Any:
            counter, by_op = [0, 0, 0], {}
            self.counters.append(counter)
            self.by_ops.append(by_op)
            store = connect("127.0.0.1", port, timeout=300.0)
            return Counting(store, counter, by_op, worker.keys.prefix)

        self.relays: dict[int, Any] = {}
        self.arrivals: dict[int, Any] = {}
        self.watches: dict[int, _SimWatch] = {}
        cfg = _sidecar_config(port, worker.n, 0, worker.cfg) if arrival else None
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
            watch = None
            if arrival:
                node_arrival = self.arrivals.get(node)
                if node_arrival is None:
                    node_arrival = self.arrivals[node] = NodeArrival(
                        connect_counted, lambda n, relay=relay: relay.value("ready", n)
                    )
                watch = self.watches[session.irank] = _SimWatch(session, cfg)
                node_arrival.watch(watch)
                session.node = _Handle(send)
            data = (relay, [b""], threading.Lock(), watch)
            self.selector.register(theirs, selectors.EVENT_READ, data)
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
                relay, buffer, lock, watch = key.data
                sock = key.fileobj
                chunk = sock.recv(65536)  # type: ignore[union-attr]
                buffer[0] += chunk
                *lines, buffer[0] = buffer[0].split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    if "arrive" in msg:
                        watch.on_arrive(msg)
                        continue

                    def reply(data: bytes, sock: Any = sock, lock: Any = lock) -> None:
                        with lock:
                            sock.sendall(data)

                    relay.ask(str(msg["relay"]), int(msg["n"]), reply)

    def ops(self) -> int:
        """Store operations of the relays so far."""
        return sum(c[0] for c in list(self.counters))

    def by_op(self) -> dict[str, int]:
        """Store operations of the relays and node arrivals so far, by name and key."""
        total: dict[str, int] = {}
        for ops in list(self.by_ops):
            for op, count in list(ops.items()):
                total[op] = total.get(op, 0) + count
        return total

    def entered(self, session: Any, k: int) -> None:
        """The rank of ``session`` entered round ``k`` (its "round" line to its watcher)."""
        watch = self.watches.get(session.irank)
        if watch is not None:
            watch.round = k

    def gone(self, session: Any) -> None:
        """The rank of ``session`` died (its watch ends)."""
        watch = self.watches.get(session.irank)
        if watch is not None and watch.on_end is not None:
            watch.on_end()

    def laid(self, k: int) -> float:
        """CPU seconds of the node flush that laid round ``k`` out here (0: none here)."""
        return max((a.laid.get(k, 0.0) for a in list(self.arrivals.values())), default=0.0)

    def tids(self) -> list[int]:
        """The helpers' threads: the dispatcher, every relay's readers, every node arrival's
        flushing thread."""
        threads = [self.thread]
        for relay in list(self.relays.values()):
            threads += list(relay._readers)
        for node_arrival in list(self.arrivals.values()):
            if node_arrival._thread is not None:
                threads.append(node_arrival._thread)
        return [t.native_id for t in threads if t.native_id is not None]

    def close(self) -> None:
        self.stop_w.send(b"x")
        self.thread.join(30.0)
        for node_arrival in self.arrivals.values():
            node_arrival.close()
        for relay in self.relays.values():
            relay.close()
        self.selector.close()
        for sock in [*self.socks, self.stop_r, self.stop_w]:
            sock.close()


class _Handle:
    """A simulated rank's handle of its node watcher, as :meth:`Session.arrive` uses it."""

    def __init__(self, send: Any) -> None:
        self.send = send
