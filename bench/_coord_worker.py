"""The worker side of bench/_coord_sim.py: simulated ranks taking turns on a few threads.

A worker (a process of its own, or a thread for ``procs=0``) gets its share of the ranks and
commands from :class:`bench._coord_sim.Sim` on a pipe: ``rounds`` (each rank's client runs
the library's round code, see :meth:`_Worker.rounds`), ``live`` then ``run`` (a
:class:`~trainguard.restart.sidecar._watch.Watch` per rank, stepped when it asks), ``exit``.
Also what both sides share: the job token, the configuration, the counting proxy.
"""

from __future__ import annotations

import heapq
import random
import re
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.restart._records import RoundLayout

from bench import _coord_nodelive
from bench._coord_nodes import Nodes, NoNodes

JOB = "sim"
LOCAL = 8  # simulated ranks per node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_TEXT = (bytes, bytearray, str)


def _size(value: Any) -> int:
    """Bytes of a store call's keys and values (8 for a number), counted without recursing
    into each key of a long list (the simulator's own cost must stay small beside the
    library's)."""
    if isinstance(value, _TEXT):
        return len(value)
    if isinstance(value, list | tuple):
        total = 0
        for item in value:
            total += len(item) if isinstance(item, _TEXT) else _size(item)
        return total
    return 8


def kind(prefix: str, args: tuple[Any, ...]) -> str:
    """What a store call's (first) key is, without its keyspace's ``prefix`` and with its
    numbers as ``N``: ``rN/ready``, ``rN/pool``, ``pg/N``, ``latest``."""
    key = args[0] if args else ""
    if isinstance(key, list | tuple):
        key = key[0] if key else ""
    key = key.decode() if isinstance(key, bytes) else str(key)
    return re.sub(r"\d+", "N", key.removeprefix(prefix))


class Counting:
    """A store client that counts its calls (operations) and the bytes of keys and values;
    with ``by_op`` also each call by name and key (:func:`kind`; the node helpers' calls,
    a few per node per round, for the breakdown of what a round costs the store)."""

    def __init__(
        self, store: Any, counter: list[int], by_op: dict[str, int] | None = None, prefix: str = ""
    ) -> None:
        self._store = store
        self._counter = counter  # [operations, bytes, keys]
        self._by_op = by_op
        self._prefix = prefix

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr) or name == "clone":
            return attr

        counter, by_op, prefix = self._counter, self._by_op, self._prefix
        waits = name == "wait"

        def counted(*args: Any) -> Any:
            out = attr(*args)
            counter[0] += 1
            counter[2] += len(args[0]) if args and isinstance(args[0], list) else 1
            counter[1] += _size(args) + (0 if waits else _size(out))
            if by_op is not None:
                op = f"{name} {kind(prefix, args)}"
                by_op[op] = by_op.get(op, 0) + 1
            return out

        setattr(self, name, counted)  # made once per client and name, not once per call
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


def _sidecar_config(port: int, n: int, rank: int, cfg: Any) -> Any:
    from trainguard.coord.keys import Keyspace
    from trainguard.restart.sidecar._config import SidecarConfig

    return SidecarConfig.build(
        cfg, rank=rank, world=n, keys=Keyspace(JOB, 0), addr=("127.0.0.1", port), log_dir=None
    )


class _Assignments:
    """Each simulated rank's assignment as read from its own copy of the layout, for the
    consistency check of :func:`bench._coord_sim._consistent`, at O(1) per rank after the
    first (the simulator's own bookkeeping must not grow with N per rank: no real rank does
    it). The first layout a thread reads is indexed in full; every later rank's copy must
    put that rank where the index says (``active[position] == r``), have the same length,
    ends, store address and departures; one rank in 16 compares its whole copy."""

    def __init__(self) -> None:
        self.first: Sequence[int] | None = None
        self.where: dict[int, int] = {}
        self.shape: tuple[Any, ...] = ()
        self.digest = 0
        self.count = 0

    def of(self, r: int, ready: RoundLayout) -> tuple[int, int, int]:
        active = ready.active
        shape = (len(active), active[:1], active[-1:], ready.pg, sorted(ready.gone))
        if self.first is None:
            self.first, self.shape = active, shape
            self.where = {a: i for i, a in enumerate(active)}
            self.digest = hash(tuple(active))
        self.count += 1
        same = shape == self.shape and (self.count % 16 or active == self.first)
        position = self.where.get(r, -1)
        if position >= 0 and active[position] != r:
            same = False
        return position, len(active), self.digest if same else -1


def by_node(ranks: Sequence[int], threads: int) -> list[list[int]]:
    """``ranks`` split among ``threads`` driving threads, a node's (:data:`LOCAL` consecutive
    ranks) all on one thread, the nodes dealt out in turn. A node watcher arrives for its
    ranks once all of them sent their records (:mod:`trainguard.restart.sidecar._arrival`);
    a node whose ranks several threads drove in turn would wait for the slowest thread, and
    past its bound (1 s, reached at 65,536 ranks here) arrive twice: requests of the
    simulation's split, not of the watcher."""
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r // LOCAL, []).append(r)
    order = list(nodes.values())
    return [[r for node in order[t::threads] for r in node] for t in range(threads)]


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
        self.rank_tids: list[int] = []  # the threads that drive the ranks' rounds
        self.nodes: Any = NoNodes()

    def cpu(self) -> tuple[int, int]:
        """Nanoseconds run so far by the threads driving the ranks and by the node helpers'
        threads (the watcher sockets' dispatcher and the relays' readers)."""
        from bench._coord_cpu import threads_ns

        return threads_ns(self.rank_tids), threads_ns(self.nodes.tids())

    def send(self, msg: Any) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def conn_recv(self) -> Any:
        return self.conn.recv()

    def session(self, rank: int, store: Any) -> Any:
        from trainguard.restart._book import RoundBook
        from trainguard.restart._environment import Launch
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
        # without a relay the waits go on this rank's one (counted) client: the simulator
        # holds one connection per rank (a real rank's monitor has one more of its own)
        session.watch_store = store
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
        k = self.spec["threads"]
        share = self.spec.get("share", 1)
        # a node's ranks on one thread (see :func:`by_node`); ranks of one thread share a
        # connection ``share`` at a time: they take turns, so a connection never has two calls
        # under way (what the store sees per request is the same)
        per_thread = by_node(self.ranks, k)
        clients = iter(self.clients(sum(-(-len(mine) // share) for mine in per_thread)))
        counters = [[0, 0, 0] for _ in range(k)]
        members: list[list[tuple[int, Any]]] = [[] for _ in range(k)]
        for t, mine in enumerate(per_thread):
            client = None
            for j, r in enumerate(mine):
                if j % share == 0:
                    client = Counting(next(clients), counters[t])
                members[t].append((r, self.session(r, client)))
        sessions = [s for mine in members for _, s in mine]
        arrival = bool(self.spec.get("arrival"))
        nodes = Nodes(self, sessions, arrival=arrival) if self.spec["relay"] else NoNodes()
        self.nodes = nodes
        threads = [
            threading.Thread(target=self._rounds_thread, args=(members[t], counters[t], t, nodes))
            for t in range(k)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        nodes.close()
        self.send(("rounds-done",))

    def _rounds_thread(self, members: list[Any], counter: list[int], t: int, nodes: Any) -> None:
        from trainguard.restart.state import RoundOutcome

        k = 0
        self.rank_tids.append(threading.get_native_id())
        chores: list[Any] = []  # a rank's store work off its restart's path (its worker thread)
        for _, session in members:
            session.later = chores.append
        before = counter[0]
        try:
            while members:
                seen = 0.0
                relayed = nodes.ops() if t == 0 else 0
                by_op = nodes.by_op() if t == 0 else {}
                if k > 0:
                    alive = []
                    for r, session in members:
                        outcome = RoundOutcome.decode(session.outcome(k - 1))
                        seen = time.monotonic()
                        if outcome.why == "end":
                            continue
                        if outcome.type == "RankGone" and outcome.rank == r:
                            nodes.gone(session)
                            continue  # this rank "died" (the notice)
                        alive.append((r, session))
                    if not alive:
                        break
                    members = alive
                raws = []
                last = 0.0  # the most CPU one arrival took (the last arriver lays the round out)
                for _, session in members:
                    start, cpu = time.monotonic(), time.thread_time()
                    raws.append((start, session.arrive(k, leaving=None, fault=None, progress=True)))
                    last = max(last, time.thread_time() - cpu)
                assigned = {}
                check = _Assignments()
                for (r, session), (start, raw) in zip(members, raws, strict=True):
                    ready = session.take(k, raw, start)
                    nodes.entered(session, k)
                    assigned[r] = check.of(r, ready)
                got = time.monotonic()
                ops = counter[0] - before + (nodes.ops() - relayed if t == 0 else 0)
                before = counter[0]
                for _, session in members:  # each monitor watches the round from its start
                    if session.relay is not None:
                        session.relay.ask("stop", k)
                for chore in chores:  # counted in the next round's operations
                    chore()
                chores.clear()
                # reported once this thread is idle (a rank's chores are done long before
                # the next fault: a round trains for minutes), its times taken before them
                if t == 0:  # node arrival: the node that laid the round out did its work
                    last = max(last, nodes.laid(k))
                if t == 0:  # the node helpers' requests of this round, by name and key
                    after = nodes.by_op()
                    by_op = {op: c - by_op.get(op, 0) for op, c in after.items()}
                self.send(("round", k, t, seen, got, assigned, ops, last, by_op))
                k += 1
        except Exception as exc:  # reported, never left waiting
            self.send(("error", f"{type(exc).__name__}: {exc}"))
        self.send(("thread-done", t, [r for r, _ in members]))

    # liveness -----------------------------------------------------------------------------
    def liveness(self, params: dict[str, Any]) -> None:
        """Build a watch per rank of the roster, say so, run them from the time the next
        message gives."""
        from trainguard.coord import _sockets

        roster = tuple(params["roster"])
        mine = [r for r in self.ranks if r in roster]
        port = self.spec["port"]

        def held() -> int:
            socks = _sockets.tcp_sockets(set(_sockets.socket_fds()))
            return sum(
                1 for s in socks if s.remote_port == port and s.state == _sockets.ESTABLISHED
            )

        before = held()
        nodes = sorted({r // LOCAL for r in mine})  # a node watcher's ranks share one connection
        beats = dict(zip(nodes, self.clients(len(nodes)), strict=True))
        # the node beats for its ranks (bench/_coord_nodelive.py): the only liveness ring
        watches = _coord_nodelive.members(
            self.cfg, self.keys, mine, LOCAL, params["round"], roster, beats
        )
        conns = held() - before

        def warm(watch: Any) -> None:  # each node makes its observed keys once, at start
            watch.warm()

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(warm, watches))
        self.send(("built",))
        params.update(self.conn_recv()[1])
        k = self.spec["threads"]
        counters = [[0, 0, 0, 0] for _ in range(k)]  # operations, bytes, keys; beats
        for i, watch in enumerate(watches):
            watch.ring.store = Counting(watch.ring.store, counters[i % k])
        out: dict[str, Any] = {"conns": conns, "ranks": len(watches), "last": {}, "declared": {}}
        out["lag"] = 0.0  # the latest a watch was stepped after it asked, seconds
        out["window"] = [[0.0, 0.0, 0.0, 0.0] for _ in range(k)]
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
        """Step each watch's ring when it asks (:meth:`RingWatch.wake`), each beating at its
        own phase; the silent ranks stop at ``quiet_at``. Counts the operations of ``count``."""
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
            had = len(watch.ring.gone)
            beats = now >= next_beat
            next_beat = watch.ring.step(next_beat)
            counter[3] += beats
            done = time.monotonic()
            if beats and watch.rank in silent:
                for r in getattr(watch, "ranks", (watch.rank,)):  # a node: each of its ranks
                    out["last"][r] = done
            if len(watch.ring.gone) != had:
                for r in watch.ring.gone:
                    out["declared"].setdefault(r, done)
            heapq.heappush(heap, (watch.ring.wake(next_beat), i, next_beat))


def worker_main(conn: Connection, spec: dict[str, Any]) -> None:
    """A worker's life: commands from :class:`Sim` until ``exit``."""
    import logging

    # Quiet and small-stacked while it runs; restored after, since a test runs a worker inside
    # its own process (a trainguard logger left at ERROR hid later tests' log lines).
    lib = logging.getLogger("trainguard")
    level = lib.level
    lib.setLevel(logging.ERROR)
    stack = threading.stack_size(512 * 1024)
    try:
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
            elif msg[0] == "cpu":
                worker.send(("cpu", *worker.cpu()))
        conn.close()
    finally:
        lib.setLevel(level)
        threading.stack_size(stack)
