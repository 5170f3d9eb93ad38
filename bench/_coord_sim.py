"""Many simulated ranks against one real store process, driven through the library's own code.

Used by ``bench/coord_scale.py`` and by ``tests/coord/test_scale_sim.py``.

What is real: the store process that the initial rank 0 starts
(:class:`trainguard.coord.store.StoreProcess`: libuv TCPStore, round stores opened as rounds
go), one TCPStore client (one connection) per simulated rank, and every store operation a rank
makes, made by the library's own code on that rank's client:

- rounds: the monitor's wait for the round's outcome (:meth:`Session.outcome`,
  :meth:`RoundOutcome.decode`), then :meth:`Session.arrive` and :meth:`Session.take` (the two
  halves of :meth:`Session.barrier`: record, arrival counter, the last arriver's layout, every
  rank reading and following its assignment). By default (``relay=True``, as under the node
  watcher) each node of 8 simulated ranks has a
  :class:`~trainguard.restart.sidecar._relay.Relay` with store connections of its own, and
  each rank a :class:`~trainguard.restart.sidecar._relay.RelayReader` over a real socket
  pair: the outcome and the layout are read at the store once per node and reach the ranks
  over the sockets. The watcher's ends of the sockets are read by one thread per worker (the
  node watcher has one per rank), which passes each ask to its node's relay. With
  ``arrival=True`` (node arrival) the ranks hand their records to their node's
  :class:`~trainguard.restart.sidecar._arrival.NodeArrival` over the same sockets, which
  arrives for them (one append and one add per node) and lays the round out when its add
  completes the barrier (the library's only protocol since issue 42). Without it each rank
  arrives by itself (its line in the round's pool, its count: what a rank whose helper died
  does); ``relay=False``: each rank also waits at the store itself;
- death notices: :func:`trainguard.restart.sidecar._notice.write_notice`;
- liveness: one :class:`trainguard.coord.node_ring.NodeRing` member per node of 8
  (:mod:`bench._coord_nodelive`, as the node watcher beats), stepped at the moments
  :meth:`RingWatch.wake` asks for, each node's beats at a random phase of the interval; a
  silent node is one whose beats stop, declared and noticed by the real code.

What is simulated: ranks are not processes. A few worker processes (``procs``) each run a few
threads (``threads``), and each thread drives its share of the ranks in turn (whole nodes: a
node's ranks on one thread of one worker): every rank's wait for the outcome (the first blocks
until it is set, the others find it set), then every rank's arrival, then every rank's wait
for and reading of its assignment. So a rank's
operation waits for the thread's other ranks' operations before it: the times measured are
an upper bound of what ranks on their own hosts would see (the store server's own work, which
is what grows with N, is all there). No training, no process groups, no abort.

Store traffic is counted by a proxy around each client (one operation per store call, bytes of
the keys and values sent and received). All times are ``time.monotonic()``, one clock for
every process of the machine.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from bench._coord_cpu import process_ns
from bench._coord_worker import (
    JOB,
    LOCAL,
    Counting,
    _config,
    _sidecar_config,
    free_port,
    worker_main,
)


def worker_bounds(n: int, parts: int) -> list[int]:
    """Where ``n`` ranks are cut into ``parts`` workers' shares (``bounds[i]:bounds[i + 1]``):
    whole nodes of :data:`LOCAL` each, as even as they go. A node split between two workers
    would be two node watchers (two arrivals, two relays' reads) where a real node has one."""
    nodes = -(-n // LOCAL)
    return [min(n, LOCAL * (nodes * i // parts)) for i in range(parts + 1)]


class Sim:
    """One store process, its simulated ranks spread over worker processes.

    ``procs`` = 0 runs the one worker as a thread of this process (no start-up cost: tests).
    """

    def __init__(
        self,
        n: int,
        *,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        procs: int | None = None,
        threads: int = 4,
        relay: bool = True,
        share: int | None = None,
        arrival: bool = False,
    ) -> None:
        from trainguard.coord.keys import Keyspace
        from trainguard.coord.store import StoreProcess, connect

        self.n = n
        self.port = free_port()
        self.keys = Keyspace(JOB, 0)
        self.interval, self.timeout = heartbeat_interval, heartbeat_timeout
        self.threads = threads
        self.server = StoreProcess(
            job=JOB,
            call=0,
            coord_host="127.0.0.1",
            coord_port=self.port,
            host_coord=True,
            advertise_host="127.0.0.1",
            world_size=n,
            timeout=300.0,
        ).start()
        self.main: Any = connect("127.0.0.1", self.port, timeout=60.0)
        # a process holds at most 20,000 descriptors here: beyond 4,096 ranks, a worker per
        # 6,144 ranks (a socket pair per rank for the relay) and the ranks of a node or more
        # on one store connection (the store process holds one per connection, and one or
        # two per node for the relays: at most 2,048 for the ranks)
        if procs is None:
            procs = max(1, min(4, n // 512)) if n <= 4096 else -(-n // 6144)
        self.procs = procs
        self.share = (1 if n <= 4096 else max(LOCAL, n // 2048)) if share is None else share
        self.relay = relay
        self.arrival = arrival and relay  # node arrival needs the node watchers
        parts = max(1, self.procs)
        bounds = worker_bounds(n, parts)
        self.workers: list[tuple[Connection, Any]] = []
        for i in range(parts):
            spec = {
                "port": self.port,
                "n": n,
                "ranks": list(range(bounds[i], bounds[i + 1])),
                "interval": heartbeat_interval,
                "timeout": heartbeat_timeout,
                "threads": threads,
                "relay": relay,
                "arrival": self.arrival,
                "share": self.share,
            }
            ours, theirs = multiprocessing.Pipe()
            if self.procs:
                proc: Any = multiprocessing.get_context("spawn").Process(
                    target=worker_main, args=(theirs, spec), daemon=True
                )
            else:
                proc = threading.Thread(target=worker_main, args=(theirs, spec), daemon=True)
            proc.start()
            self.workers.append((ours, proc))
        for conn, _ in self.workers:
            assert conn.recv() == "up"

    def server_ns(self) -> tuple[int, int]:
        """The store process's run time so far, all threads and its busiest, nanoseconds."""
        assert self.server.proc is not None
        return process_ns(self.server.proc.pid)

    def send(self, msg: Any) -> None:
        for conn, _ in self.workers:
            conn.send(msg)

    def recv_all(self) -> list[Any]:
        return [conn.recv() for conn, _ in self.workers]

    def sidecar_config(self, rank: int) -> Any:
        config = _sidecar_config(
            self.port, self.n, rank, _config(self.n, self.interval, self.timeout)
        )
        return config

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send(("exit",))
        for conn, proc in self.workers:
            proc.join(30.0)
            conn.close()
        with contextlib.suppress(Exception):
            self.main.set(self.keys.exit, b"done")
        self.main = None
        self.server.close(timeout=30.0)


# the driver's side ---------------------------------------------------------------------------
def rounds(sim: Sim, reps: int, *, budget: float = 600.0) -> dict[str, Any]:
    """Up to ``reps`` restart rounds after a fault, then up to ``reps`` after a death notice
    (each kind stops repeating once it took ``budget`` seconds; at least one of each).

    Returns per repetition: fault/notice -> every rank saw the outcome, -> every rank read its
    assignment; the layout's bytes; store operations per rank per round; and whether every
    rank's assignment was consistent (the same layout, its own rank where the layout puts it).
    """
    from trainguard.restart.sidecar._notice import write_notice
    from trainguard.restart.state import RoundOutcome

    n = sim.n
    threads = {(w, t) for w in range(len(sim.workers)) for t in range(sim.threads)}
    state = _Collect(sim, threads)
    sim.send(("rounds",))
    out: dict[str, list[float]] = {"fault": [], "fault_aware": [], "notice": [], "notice_aware": []}
    ops_per_rank: list[float] = []
    layout_bytes: list[int] = []
    live = list(range(n))
    state.round(0)  # round 0: the start, not timed
    cpu: list[dict[str, Any]] = []  # per timed round: CPU of the server, ranks, node helpers
    before = state.cpu()
    k, spent = 1, {"fault": 0.0, "notice": 0.0}
    for kind in ("fault", "notice"):
        for rep in range(reps):
            if rep and spent[kind] > budget:
                break
            t0 = time.monotonic()
            if kind == "fault":
                fault = RoundOutcome.fault(0, "simulated", "Sim")
                sim.main.compare_set(sim.keys.stop(k - 1), "", fault.encode())
            else:
                victim = live[-1 - 8 * rep % len(live)]
                config = sim.sidecar_config(victim)
                write_notice(sim.main.clone(), config, victim, k - 1, tuple(live), "dead")
                live.remove(victim)
            seen, got, ops = state.round(k)
            after = state.cpu()
            cpu.append(
                {
                    "kind": kind,
                    "ranks": len(live),
                    "server_busy_s": (after[0] - before[0]) / 1e9,
                    # the growth of the thread that had run longest by then: the store's
                    # libuv thread once it outran the main thread's start-up (from 4,096 ranks
                    # here; before that, 0)
                    "server_thread_s": (after[1] - before[1]) / 1e9,
                    "rank_cpu_s": (after[2] - before[2]) / 1e9,
                    "node_cpu_s": (after[3] - before[3]) / 1e9,
                    "last_arriver_s": state.last[k],
                    "requests": ops,
                    # the node helpers' requests by name and key ("wait rN/stop": 1 per node)
                    "node_requests_by_op": state.by_op.get(k, {}),
                }
            )
            before = after
            out[kind + "_aware"].append(seen - t0)
            out[kind].append(got - t0)
            spent[kind] += time.monotonic() - t0
            layout_bytes.append(len(bytes(sim.main.get(sim.keys.latest))))
            ops_per_rank.append(ops / len(live))
            k += 1
    sim.main.compare_set(sim.keys.stop(k - 1), "", RoundOutcome.end("over").encode())
    state.finish()
    return {
        **out,
        "ops_per_rank": ops_per_rank,
        "cpu": cpu,
        "layout_bytes": layout_bytes,
        "consistent": _consistent(state.assigned[:k]) and not state.errors,
        "roster": live,
        "last_round": k - 1,
        "errors": state.errors[:5],
    }


class _Collect:
    """The workers' reports of each round, gathered."""

    def __init__(self, sim: Sim, threads: set[tuple[int, int]]) -> None:
        self.sim = sim
        self.expect = set(threads)
        self.reports: dict[int, list[tuple[float, float, int]]] = {}
        self.assigned: list[dict[int, tuple[int, int, int]]] = []
        self.errors: list[str] = []
        self.done: set[tuple[int, int]] = set()
        self.last: dict[int, float] = {}  # round -> the most CPU one arrival took, s
        self.by_op: dict[int, dict[str, int]] = {}  # round -> the node helpers' requests by op
        self.cpus: list[tuple[int, int]] = []

    def cpu(self) -> tuple[int, int, int, int]:
        """Nanoseconds so far: the store process's (all threads, its busiest thread), the
        workers' threads driving ranks, the workers' node helper threads."""
        server = self.sim.server_ns()
        self.cpus = []
        self.sim.send(("cpu",))
        deadline = time.monotonic() + 600.0
        while len(self.cpus) < len(self.sim.workers):
            self._pump(deadline)
        ranks = sum(c[0] for c in self.cpus)
        return server[0], server[1], ranks, sum(c[1] for c in self.cpus)

    def _pump(self, deadline: float) -> None:
        conns = [c for c, _ in self.sim.workers]
        ready = wait(conns, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RuntimeError("simulated round did not complete in 600 s")
        for conn in ready:
            w = conns.index(conn)  # type: ignore[arg-type]
            msg = conn.recv()  # type: ignore[union-attr]
            if msg[0] == "round":
                _, k, _, seen, got, assigned, ops, last, by_op = msg
                self.reports.setdefault(k, []).append((seen, got, ops))
                into = self.by_op.setdefault(k, {})
                for op, count in by_op.items():
                    into[op] = into.get(op, 0) + count
                self.last[k] = max(last, self.last.get(k, 0.0))
                while len(self.assigned) <= k:
                    self.assigned.append({})
                self.assigned[k].update(assigned)
            elif msg[0] == "error":
                self.errors.append(msg[1])
            elif msg[0] == "cpu":
                self.cpus.append((msg[1], msg[2]))
            elif msg[0] == "thread-done":
                self.expect.discard((w, msg[1]))
                self.done.add((w, msg[1]))

    def round(self, k: int) -> tuple[float, float, int]:
        deadline = time.monotonic() + 600.0
        while len(self.reports.get(k, [])) < len(self.expect):
            if self.errors:
                raise RuntimeError(f"simulated ranks failed: {self.errors[:3]}")
            self._pump(deadline)
        got = self.reports[k]
        return max(s for s, _, _ in got), max(g for _, g, _ in got), sum(o for _, _, o in got)

    def finish(self) -> None:
        deadline = time.monotonic() + 120.0
        pending = len(self.sim.workers)
        while pending:
            conns = [c for c, _ in self.sim.workers]
            for conn in wait(conns, timeout=max(0.0, deadline - time.monotonic())):
                msg = conn.recv()  # type: ignore[union-attr]
                if msg[0] == "rounds-done":
                    pending -= 1
                elif msg[0] == "error":
                    self.errors.append(msg[1])
            if time.monotonic() > deadline:
                raise RuntimeError("simulated ranks did not finish")


def _consistent(assigned: list[dict[int, tuple[int, int, int]]]) -> bool:
    """In every round all ranks read the same layout, and the ranks handed out are exactly
    0..active-1, each once."""
    for per_rank in assigned:
        layouts = {(size, digest) for _, size, digest in per_rank.values()}
        given = sorted(r for r, _, _ in per_rank.values() if r >= 0)
        if len(layouts) != 1 or given != list(range(layouts.pop()[0])):
            return False
    return True


def liveness(
    sim: Sim,
    roster: list[int],
    round_: int,
    *,
    silent: range,
    measure: float = 2.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Heartbeats of every simulated rank of ``roster`` (a :class:`Watch` each, one connection
    per node); after a warm-up and ``measure`` intervals of everyone alive (the traffic is
    counted then), the ranks of ``silent`` stop beating. Returns the store operations and
    bytes of one interval (in total and per rank), the connections per rank, and the seconds
    from each silent rank's last beat to the first observer that declared it, minus
    heartbeat_timeout."""
    interval, timeout = sim.interval, sim.timeout
    sim.send(("live", {"roster": roster, "round": round_, "silent": list(silent), "seed": seed}))
    assert all(msg == ("built",) for msg in sim.recv_all())
    start = time.monotonic() + 0.2
    count = (start + 2 * interval, start + (2 + measure) * interval)
    quiet_at = count[1]
    until = quiet_at + timeout + 4 * interval + 1.0
    sim.send(("run", {"start": start, "count": count, "quiet_at": quiet_at, "until": until}))
    outs = [msg[1] for msg in sim.recv_all()]
    ranks = sum(o["ranks"] for o in outs)
    ops, nbytes, nkeys, beats = (sum(w[i] for o in outs for w in o["window"]) for i in range(4))
    last = {int(r): t for o in outs for r, t in o["last"].items()}
    declared: dict[int, float] = {}
    for o in outs:
        for r, t in o["declared"].items():
            declared[int(r)] = min(t, declared.get(int(r), t))
    found = {r: declared[r] - last[r] - timeout for r in silent if r in declared and r in last}
    return {
        "ops_per_interval": ops,
        "bytes_per_interval": nbytes,
        "ops_per_rank": ops / ranks,
        "members": ranks,  # a rank each, or under node arrival a node each
        "requests_per_beat": ops / beats if beats else None,
        "keys_per_interval": nkeys,
        "bytes_per_rank": nbytes / ranks,
        "sidecar_connections_per_rank": sum(o["conns"] for o in outs) / ranks,
        "detect_rank_s": found.get(silent[0]),
        "detect_group_s": max(found.values()) if len(found) == len(silent) else None,
        "detect_s": sorted(found.values()),
        "declared_all": len(found) == len(silent),
        "driver_lag_s": max(o["lag"] for o in outs),
        "false": sorted(r for r in declared if r not in silent),
    }


__all__ = ["Counting", "Sim", "free_port", "liveness", "rounds", "worker_main"]
