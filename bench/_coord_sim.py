"""Many simulated ranks against one real store process, driven through the library's own code.

Used by ``bench/coord_scale.py`` and by ``tests/coord/test_scale_sim.py``.

What is real: the store process that the initial rank 0 starts
(:class:`trainguard.coord.store.StoreProcess`: libuv TCPStore, round stores opened as rounds
go), one TCPStore client (one connection) per simulated rank, and every store operation a rank
makes, made by the library's own code on that rank's client:

- rounds: the monitor's wait for the round's outcome (:func:`trainguard.coord.barrier.
  wait_forever`, :meth:`RoundOutcome.decode`), then :meth:`Session.arrive` and
  :meth:`Session.take` (the two halves of :meth:`Session.barrier`: record, arrival counter,
  the last arriver's layout, every rank reading and following its assignment);
- death notices: :func:`trainguard.restart.sidecar._notice.write_notice`;
- liveness: one :class:`trainguard.restart.sidecar._watch.Watch` per simulated rank (its own
  connection, as a sidecar's), stepped by :meth:`Watch.step` at the moments
  :meth:`Watch.wake` asks for, each rank's beats at a random phase of the interval (as ranks
  started at unrelated moments beat); a silent node is a run of consecutive ranks whose
  beats stop, declared and noticed by the real code.

What is simulated: ranks are not processes. A few worker processes (``procs``) each run a few
threads (``threads``), and each thread drives its share of the ranks in turn: every rank's
wait for the outcome (the first blocks until it is set, the others find it set), then every
rank's arrival, then every rank's wait for and reading of its assignment. So a rank's
operation waits for the thread's other ranks' operations before it: the times measured are
an upper bound of what ranks on their own hosts would see (the store server's own work, which
is what grows with N, is all there). No training, no process groups, no abort.

Store traffic is counted by a proxy around each client (one operation per store call, bytes of
the keys and values sent and received). All times are ``time.monotonic()``, one clock for
every process of the machine.
"""

from __future__ import annotations

import contextlib
import heapq
import multiprocessing
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from typing import Any

JOB = "sim"
LOCAL = 8  # simulated ranks per node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _size(value: Any) -> int:
    if isinstance(value, bytes | bytearray | str):
        return len(value)
    if isinstance(value, list | tuple):
        return sum(_size(v) for v in value)
    return 8


class Counting:
    """A store client that counts its calls (operations) and the bytes of keys and values."""

    def __init__(self, store: Any, counter: list[int]) -> None:
        self._store = store
        self._counter = counter  # [operations, bytes, keys]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr) or name == "clone":
            return attr

        def counted(*args: Any) -> Any:
            out = attr(*args)
            self._counter[0] += 1
            self._counter[2] += len(args[0]) if args and isinstance(args[0], list) else 1
            self._counter[1] += _size(args) + (_size(out) if name != "wait" else 0)
            return out

        return counted


def _config(n: int, interval: float, timeout: float) -> Any:
    from trainguard.restart.config import WrapperConfig

    return WrapperConfig(
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        soft_timeout=max(60.0, 3 * timeout),
        hard_timeout=max(120.0, 6 * timeout),
        barrier_timeout=300.0,
        store_timeout=300.0,
    )


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
        self.procs = max(1, min(4, n // 512)) if procs is None else procs
        parts = max(1, self.procs)
        bounds = [n * i // parts for i in range(parts + 1)]
        self.workers: list[tuple[Connection, Any]] = []
        for i in range(parts):
            spec = {
                "port": self.port,
                "n": n,
                "ranks": list(range(bounds[i], bounds[i + 1])),
                "interval": heartbeat_interval,
                "timeout": heartbeat_timeout,
                "threads": threads,
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

    def send(self, msg: Any) -> None:
        for conn, _ in self.workers:
            conn.send(msg)

    def recv_all(self) -> list[Any]:
        return [conn.recv() for conn, _ in self.workers]

    def sidecar_config(self, rank: int) -> Any:
        return _sidecar_config(
            self.port, self.n, rank, _config(self.n, self.interval, self.timeout)
        )

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


def _sidecar_config(port: int, n: int, rank: int, cfg: Any) -> Any:
    from trainguard.coord.keys import Keyspace
    from trainguard.restart.sidecar._config import SidecarConfig

    return SidecarConfig.build(
        cfg, rank=rank, world=n, keys=Keyspace(JOB, 0), addr=("127.0.0.1", port), log_dir=None
    )


# the worker (a process, or a thread for procs=0) ------------------------------------------
class _Worker:
    def __init__(self, conn: Connection, spec: dict[str, Any]) -> None:
        from trainguard.coord.keys import Keyspace

        self.conn = conn
        self.spec = spec
        self.n = spec["n"]
        self.ranks: list[int] = spec["ranks"]
        self.cfg = _config(self.n, spec["interval"], spec["timeout"])
        self.keys = Keyspace(JOB, 0)
        self.send_lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def conn_recv(self) -> Any:
        return self.conn.recv()

    def session(self, rank: int, store: Any) -> Any:
        from trainguard.restart._book import RoundBook
        from trainguard.restart._launch import Launch
        from trainguard.restart._session import Session

        launch = Launch(
            rank=rank,
            world_size=self.n,
            local_rank=rank % LOCAL,
            master_addr="127.0.0.1",
            master_port=self.spec["port"],
            agent_store=False,
            job=JOB,
        )
        session = Session(launch, 0, self.cfg)
        session.host = f"node{rank // LOCAL}"
        session.book = RoundBook(
            store,
            self.keys,
            self.n,
            self.cfg.policies,
            store_timeout=self.cfg.store_timeout,
            writer=rank,
        )
        return session

    def clients(self, count: int) -> list[Any]:
        """``count`` new store clients, connected by 64 threads at once (a connect can wait
        on a reverse name lookup; that wait is this machine's resolver, not the store's)."""
        from trainguard.coord.store import connect

        def one(_: int) -> Any:
            return connect("127.0.0.1", self.spec["port"], timeout=300.0)

        with ThreadPoolExecutor(64) as pool:
            return list(pool.map(one, range(count)))

    # rounds -------------------------------------------------------------------------------
    def rounds(self) -> None:
        clients = self.clients(len(self.ranks))
        k = self.spec["threads"]
        counters = [[0, 0, 0] for _ in range(k)]
        members = [
            (r, self.session(r, Counting(c, counters[i % k])))
            for i, (r, c) in enumerate(zip(self.ranks, clients, strict=True))
        ]
        threads = [
            threading.Thread(target=self._rounds_thread, args=(members[t::k], counters[t], t))
            for t in range(k)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.send(("rounds-done",))

    def _rounds_thread(self, members: list[Any], counter: list[int], t: int) -> None:
        from trainguard.coord.barrier import wait_forever
        from trainguard.restart.state import RoundOutcome

        k = 0
        try:
            while members:
                seen, before = 0.0, counter[0]
                if k > 0:
                    alive = []
                    for r, session in members:
                        raw = wait_forever(session.book.store, self.keys.stop(k - 1))
                        outcome = RoundOutcome.decode(raw)
                        seen = time.monotonic()
                        if outcome.why == "end":
                            continue
                        if outcome.type == "RankGone" and outcome.rank == r:
                            continue  # this rank "died" (the notice)
                        alive.append((r, session))
                    if not alive:
                        break
                    members = alive
                raws = []
                for _, session in members:
                    start = time.monotonic()
                    raws.append((start, session.arrive(k, leaving=None, fault=None, progress=True)))
                assigned = {}
                for (r, session), (start, raw) in zip(members, raws, strict=True):
                    ready = session.take(k, raw, start)
                    active = ready["active"]
                    position = active.index(r) if r in active else -1
                    assigned[r] = (position, len(active), hash(tuple(active)))
                got = time.monotonic()
                self.send(("round", k, t, seen, got, assigned, counter[0] - before))
                k += 1
        except Exception as exc:  # reported, never left waiting
            self.send(("error", f"{type(exc).__name__}: {exc}"))
        self.send(("thread-done", t, [r for r, _ in members]))

    # liveness -----------------------------------------------------------------------------
    def liveness(self, params: dict[str, Any]) -> None:
        """Build a watch per rank of the roster, say so, run them from the time the next
        message gives."""
        from trainguard.coord import _sockets
        from trainguard.restart.sidecar._watch import Watch

        roster = tuple(params["roster"])
        mine = [r for r in self.ranks if r in roster]
        port = self.spec["port"]

        def held() -> int:
            socks = _sockets.tcp_sockets(set(_sockets.socket_fds()))
            return sum(
                1 for s in socks if s.remote_port == port and s.state == _sockets.ESTABLISHED
            )

        before = held()
        watches = []
        for r, client in zip(mine, self.clients(len(mine)), strict=True):
            config = _sidecar_config(port, self.n, r, self.cfg)
            watch = Watch(config, pid=os.getpid(), store=client)
            watch.round, watch.roster = params["round"], roster
            watches.append(watch)
        conns = held() - before

        def warm(watch: Any) -> None:  # each sidecar makes its observed counters once, at start
            watch.ensure(watch.observed(params["round"], roster))

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(warm, watches))
        self.send(("built",))
        params.update(self.conn_recv()[1])
        k = self.spec["threads"]
        counters = [[0, 0, 0] for _ in range(k)]
        for i, watch in enumerate(watches):
            watch.beat_store = Counting(watch.beat_store, counters[i % k])
        out: dict[str, Any] = {"conns": conns, "ranks": len(watches), "last": {}, "declared": {}}
        out["lag"] = 0.0  # the latest a watch was stepped after it asked, seconds
        out["window"] = [[0.0, 0.0, 0.0] for _ in range(k)]
        drivers = [
            threading.Thread(
                target=self._drive, args=(watches[t::k], counters[t], out["window"][t], params, out)
            )
            for t in range(k)
        ]
        for driver in drivers:
            driver.start()
        for driver in drivers:
            driver.join()
        for watch in watches:
            watch.done.set()
        for watch in watches:
            for thread in watch.notices:
                thread.join(60.0)
            watch.close()
        self.send(("live", out))

    def _drive(
        self,
        watches: list[Any],
        counter: list[int],
        window: list[float],
        params: dict[str, Any],
        out: dict[str, Any],
    ) -> None:
        """Step each watch when it asks (:meth:`Watch.wake`), each beating at its own phase;
        the silent ranks stop at ``quiet_at``. Counts the operations of ``count``."""
        silent = set(params["silent"])
        interval = self.cfg.heartbeat_interval
        start = params["start"]
        rng = random.Random(params["seed"] + (watches[0].rank if watches else 0))
        heap = []
        for i in range(len(watches)):
            beat_at = start + rng.uniform(0.0, interval)
            heap.append((beat_at, i, beat_at))
        heapq.heapify(heap)
        count_from, count_to = params["count"]
        counted = False
        while heap:
            wake, i, next_beat = heapq.heappop(heap)
            now = time.monotonic()
            if wake > params["until"]:
                break
            if wake > now:
                time.sleep(wake - now)
                now = time.monotonic()
            out["lag"] = max(out["lag"], now - wake)
            if not counted and now >= count_from:
                counted, snapshot, began = True, list(counter), now
            if counted and count_to and now >= count_to:
                # per heartbeat interval of this driver's own clock (a late driver's window
                # is longer than asked for)
                per = interval / (now - began)
                window[:] = [(c - s) * per for c, s in zip(counter, snapshot, strict=True)]
                count_to = 0.0
            watch = watches[i]
            if watch.rank in silent and now >= params["quiet_at"] and now >= next_beat:
                continue  # this rank is silent from now on
            had = len(watch.declared)
            beats = now >= next_beat
            next_beat = watch.step(next_beat)
            done = time.monotonic()
            if beats and watch.rank in silent:
                out["last"][watch.rank] = done
            if len(watch.declared) != had:
                for r in watch.declared:
                    out["declared"].setdefault(r, done)
            heapq.heappush(heap, (watch.wake(next_beat), i, next_beat))


def worker_main(conn: Connection, spec: dict[str, Any]) -> None:
    """A worker's life: commands from :class:`Sim` until ``exit``."""
    import logging

    logging.getLogger("trainguard").setLevel(logging.ERROR)
    threading.stack_size(512 * 1024)
    worker = _Worker(conn, spec)
    conn.send("up")
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            break
        if msg[0] == "rounds":
            threading.Thread(target=worker.rounds, daemon=True).start()
        elif msg[0] == "live":
            worker.liveness(msg[1])
    conn.close()


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

    def _pump(self, deadline: float) -> None:
        conns = [c for c, _ in self.sim.workers]
        ready = wait(conns, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RuntimeError("simulated round did not complete in 600 s")
        for conn in ready:
            w = conns.index(conn)  # type: ignore[arg-type]
            msg = conn.recv()  # type: ignore[union-attr]
            if msg[0] == "round":
                _, k, _, seen, got, assigned, ops = msg
                self.reports.setdefault(k, []).append((seen, got, ops))
                while len(self.assigned) <= k:
                    self.assigned.append({})
                self.assigned[k].update(assigned)
            elif msg[0] == "error":
                self.errors.append(msg[1])
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
    """Heartbeats of every simulated rank of ``roster`` (a :class:`Watch` each, with its own
    connection); after a warm-up and ``measure`` intervals of everyone alive (the traffic is
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
    ops, nbytes, nkeys = (sum(w[i] for o in outs for w in o["window"]) for i in range(3))
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
