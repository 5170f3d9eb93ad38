"""Many simulated ranks against one real store process, driven through the library's own code.

Used by ``bench/coord_scale.py`` and by ``tests/coord/test_scale_sim.py``. One process, one
thread per simulated rank (each with its own TCPStore client, as a rank has), against the store
process that the initial rank 0 starts (:class:`trainguard.coord.store.StoreProcess`: libuv
TCPStore, round stores opened as rounds go). What is exercised is the library's code itself:

- rounds: :meth:`trainguard.restart._session.Session.barrier` (records, arrival counter, the
  last arriver's layout, every rank reading its assignment), the round outcome with
  :meth:`Session.stop` and the monitor's wait (:func:`trainguard.coord.barrier.wait_forever`);
- death notices: :func:`trainguard.restart.sidecar._notice.write_notice`;
- liveness: :class:`trainguard.restart.sidecar._watch.Watch` objects (one per simulated rank,
  with its real store connections) whose :meth:`Watch.beat` a few driver threads call every
  interval; a silent group is a run of consecutive ranks whose beats stop.

Store traffic is counted by a proxy around each client (one operation per store call, bytes of
the keys and values sent and received).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from trainguard.coord import _sockets
from trainguard.coord.barrier import wait_forever
from trainguard.coord.keys import Keyspace
from trainguard.coord.store import StoreProcess, connect
from trainguard.restart import _records
from trainguard.restart._book import RoundBook
from trainguard.restart._launch import Launch
from trainguard.restart._session import Session
from trainguard.restart.config import WrapperConfig
from trainguard.restart.sidecar._config import SidecarConfig
from trainguard.restart.sidecar._notice import write_notice
from trainguard.restart.sidecar._watch import Watch
from trainguard.restart.state import RoundOutcome

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


class Sim:
    """One store process and the configuration shared by the simulated ranks."""

    def __init__(self, n: int, *, heartbeat_interval: float, heartbeat_timeout: float) -> None:
        self.n = n
        self.port = free_port()
        self.keys = Keyspace(JOB, 0)
        self.cfg = WrapperConfig(
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            soft_timeout=max(60.0, 3 * heartbeat_timeout),
            hard_timeout=max(120.0, 6 * heartbeat_timeout),
            barrier_timeout=300.0,
            store_timeout=300.0,
        )
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
        self.main = connect("127.0.0.1", self.port, timeout=60.0)

    def client(self) -> Any:
        return self.main.clone()

    def sidecar_config(self, rank: int) -> SidecarConfig:
        return SidecarConfig.build(
            self.cfg,
            rank=rank,
            world=self.n,
            keys=self.keys,
            addr=("127.0.0.1", self.port),
            log_dir=None,
        )

    def session(self, rank: int, store: Any) -> Session:
        launch = Launch(
            rank=rank,
            world_size=self.n,
            local_rank=rank % LOCAL,
            master_addr="127.0.0.1",
            master_port=self.port,
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

    def connections(self) -> int:
        """TCP connections from this process to the coordination store."""
        mine = _sockets.tcp_sockets(set(_sockets.socket_fds()))
        return sum(
            1 for s in mine if s.remote_port == self.port and s.state == _sockets.ESTABLISHED
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.main.set(self.keys.exit, b"done")
        self.main = None
        self.server.close(timeout=30.0)


def _spawn(target: Callable[..., None], args: tuple[Any, ...]) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def rounds(sim: Sim, reps: int, *, budget: float = 600.0) -> dict[str, Any]:
    """Up to ``reps`` restart rounds after a fault, then up to ``reps`` after a death notice
    (each kind stops repeating once it took ``budget`` seconds; at least one of each).

    Returns per repetition: fault/notice -> every rank saw the outcome, -> every rank read its
    assignment; the layout's bytes; store operations per rank per round; and whether every
    rank's assignment was consistent (the same layout, its own rank where the layout puts it).
    """
    n = sim.n
    total = 2 * reps + 1
    seen = [[0.0] * n for _ in range(total)]
    got = [[0.0] * n for _ in range(total)]
    assigned: list[dict[int, tuple[int, int, int]]] = [{} for _ in range(total)]
    counters = [[0, 0, 0] for _ in range(n)]
    errors: list[str] = []

    def rank(i: int) -> None:
        store = Counting(sim.client(), counters[i])
        session = sim.session(i, store)
        try:
            for k in range(total):
                if k > 0:
                    outcome = RoundOutcome.decode(wait_forever(store, sim.keys.stop(k - 1)))
                    seen[k][i] = time.monotonic()
                    if outcome.why == "end" or (outcome.type == "RankGone" and outcome.rank == i):
                        return  # the simulation is over, or this rank "died" (its notice)
                ready = session.barrier(k, leaving=None, fault=None, progress=True)
                got[k][i] = time.monotonic()
                assert ready is not None
                active = ready["active"]
                position = active.index(i) if i in active else -1
                assigned[k][i] = (position, len(active), hash(tuple(active)))
        except Exception as exc:  # reported, never left waiting
            errors.append(f"rank {i}: {type(exc).__name__}: {exc}")

    threads = [_spawn(rank, (i,)) for i in range(n)]
    out: dict[str, list[float]] = {"fault": [], "fault_aware": [], "notice": [], "notice_aware": []}
    ops_per_rank: list[float] = []
    layout_bytes: list[int] = []
    live = list(range(n))
    _wait_round(got[0], live, errors)  # round 0: the start, not timed
    k, spent = 1, {"fault": 0.0, "notice": 0.0}
    for kind in ("fault", "notice"):
        for rep in range(reps):
            if rep and spent[kind] > budget:
                break
            before = sum(c[0] for c in counters)
            t0 = time.monotonic()
            if kind == "fault":
                fault = RoundOutcome.fault(0, "simulated", "Sim")
                sim.main.compare_set(sim.keys.stop(k - 1), "", fault.encode())
            else:
                victim = live[-1 - 8 * rep % len(live)]
                config = sim.sidecar_config(victim)
                write_notice(sim.client(), config, victim, k - 1, tuple(live), "dead")
                live.remove(victim)
            _wait_round(got[k], live, errors)
            out[kind + "_aware"].append(max(seen[k][i] for i in live) - t0)
            out[kind].append(max(got[k][i] for i in live) - t0)
            spent[kind] += time.monotonic() - t0
            layout_bytes.append(len(bytes(sim.main.get(sim.keys.latest))))
            ops_per_rank.append((sum(c[0] for c in counters) - before) / len(live))
            k += 1
    sim.main.compare_set(sim.keys.stop(k - 1), "", RoundOutcome.end("over").encode())
    for thread in threads:
        thread.join(60.0)
    return {
        **out,
        "ops_per_rank": ops_per_rank,
        "layout_bytes": layout_bytes,
        "consistent": _consistent(assigned[:k]) and not errors,
        "roster": live,
        "last_round": k - 1,
        "errors": errors[:5],
    }


def _wait_round(got: list[float], ranks: Any, errors: list[str]) -> None:
    deadline = time.monotonic() + 600.0
    while not all(got[i] for i in ranks):
        if errors:
            raise RuntimeError(f"simulated ranks failed: {errors[:3]}")
        if time.monotonic() > deadline:
            raise RuntimeError("simulated round did not complete in 600 s")
        time.sleep(0.002)


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
    sweeps: int,
    drivers: int = 4,
    sample: int = 0,
) -> dict[str, Any]:
    """Heartbeats of every simulated rank (``Watch.beat`` each interval); the ranks of
    ``silent`` stop beating after the first sweeps. Returns the store operations and bytes of
    one interval (in total and per rank), the time one sweep of every beat took, the
    connections per rank, and the seconds from each silent rank's last beat to the first
    observer that declared it (minus heartbeat_timeout).

    ``sample`` > 0: only that many observers beat (traffic measured and scaled to N; no
    detection): for a protocol too costly to run whole at this N.
    """
    n = len(roster)
    count = sample or n
    counter = [0, 0, 0]
    before = sim.connections()
    watches = []
    for i in roster[:count]:
        watch = Watch(sim.sidecar_config(i), pid=os.getpid(), heartbeats=True)
        watch.round, watch.roster = round_, tuple(roster)
        watches.append(watch)
    held = (sim.connections() - before) / count
    for watch in watches:
        watch.beat_store = Counting(watch.beat_store, counter)
    interval = sim.cfg.heartbeat_interval
    last_beat: dict[int, float] = {}
    declared_at: dict[int, float] = {}
    sweep_times: list[float] = []
    per_sweep: list[tuple[int, ...]] = []
    lock = threading.Lock()

    def drive(part: list[Watch], quiet: bool) -> None:
        for watch in part:
            if quiet and watch.rank in silent:
                continue
            had = len(watch.declared)
            watch.beat()
            now = time.monotonic()
            if watch.rank in silent:
                last_beat[watch.rank] = now
            if len(watch.declared) != had:
                with lock:
                    for r in watch.declared:
                        declared_at.setdefault(r, now)

    parts = [watches[d::drivers] for d in range(drivers)]
    quiet_from = 3
    for s in range(sweeps):
        start = time.monotonic()
        ops_before = tuple(counter)
        workers = [_spawn(drive, (part, s >= quiet_from)) for part in parts]
        for worker in workers:
            worker.join()
        took = time.monotonic() - start
        sweep_times.append(took)
        per_sweep.append(tuple(c - b for c, b in zip(counter, ops_before, strict=True)))
        if (sample and s >= 1) or (not sample and all(r in declared_at for r in silent)):
            break  # (sampled: the second sweep is the one measured, the first made the keys)
        time.sleep(max(0.0, interval - took))
    for watch in watches:
        watch.done.set()
        for thread in watch.notices:
            thread.join(60.0)
        watch.close()
    ops, nbytes, nkeys = per_sweep[min(1, len(per_sweep) - 1)]  # a sweep with everyone alive
    timeout = sim.cfg.heartbeat_timeout
    found = {r: declared_at[r] - last_beat[r] - timeout for r in silent if r in declared_at}
    return {
        "ops_per_interval": ops * n / count,
        "bytes_per_interval": nbytes * n / count,
        "ops_per_rank": ops / count,
        "keys_per_interval": nkeys * n / count,
        "bytes_per_rank": nbytes / count,
        "sweep_s": sweep_times[min(1, len(sweep_times) - 1)] * n / count,
        "sidecar_connections_per_rank": held,
        "detect_rank_s": found.get(silent[0]) if not sample else None,
        "detect_group_s": max(found.values()) if len(found) == len(silent) else None,
        "declared_all": len(found) == len(silent),
        "sampled": bool(sample),
    }


def assignment_of(raw: bytes) -> dict[str, Any]:
    return _records.layout(raw)
