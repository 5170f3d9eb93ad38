"""The agents' heartbeat: their node ring (:func:`trainguard.launch.heartbeat.node_ring`, a
:class:`~trainguard.coord.node_ring.NodeRing` with lost marks): one heartbeat per node, ring
watching, O(nodes) store traffic.

Unit tests drive :meth:`NodeRing.beat_and_look` with a fake clock against a real TCPStore; the
process tests run one heartbeat per real process and SIGKILL some of them.
"""

from __future__ import annotations

import collections
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests._dist import RankGroup
from trainguard.coord.node_ring import NodeRing
from trainguard.coord.store import connect
from trainguard.errors import ConfigError, CoordinationError
from trainguard.launch._keys import node_key, ranks_key
from trainguard.launch.heartbeat import node_ranks, node_ring, publish_ranks

INTERVAL = 0.5
TIMEOUT = 2.0
# ticks from a node's last beat until its watcher declares it: the timeout, counted from the
# watcher's first read of that beat (its next tick)
DETECT = int(TIMEOUT / INTERVAL) + 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Counting:
    """A measuring harness around a real store: counts each operation and the keys it reads."""

    def __init__(self, store: Any, counts: collections.Counter[str] | None = None) -> None:
        self.store = store
        self.counts: collections.Counter[str] = collections.Counter() if counts is None else counts

    def clone(self) -> Counting:
        # One connection for every heartbeat: the fake-clock tests beat from one thread. (A
        # TCPStore server now and then takes 5 s to accept a new connection after others
        # closed; no clone, no wait.)
        return self

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.counts["ops"] += 1
            self.counts[name] += 1
            if name == "multi_get":
                self.counts["keys_read"] += len(args[0])
            return op(*args)

        return counted


@pytest.fixture(scope="module")
def shared_server() -> Any:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, use_libuv=True, timeout=timedelta(seconds=30)
    )


@pytest.fixture
def server(shared_server: Any) -> Any:
    return shared_server


@pytest.fixture
def run() -> str:
    """A run id of this test's own: its keys in the module's store are its own."""
    return f"hb-{uuid.uuid4().hex[:8]}"


class Ring:
    """``n`` heartbeats on one fake clock; ``tick`` advances it and beats the running ones."""

    def __init__(self, store: Any, run: str, n: int, **kwargs: Any) -> None:
        self.run = run
        self.clock = FakeClock()
        self.lost: list[tuple[int, int]] = []  # (watcher, lost node)
        self.back: list[tuple[int, int]] = []
        self.evicted: list[int] = []
        store = store if isinstance(store, Counting) else Counting(store)
        self.hbs = [self.make(store, node, n, **kwargs) for node in range(n)]
        self.running = set(range(n))

    def make(self, store: Any, node: int, n: int, **kwargs: Any) -> NodeRing:
        return node_ring(
            store,
            run_id=self.run,
            generation=0,
            node=node,
            nodes=n,
            interval=INTERVAL,
            timeout=TIMEOUT,
            on_lost=lambda lost: self.lost.append((node, lost)),
            on_back=lambda back: self.back.append((node, back)),
            on_evicted=lambda: self.evicted.append(node),
            clock=self.clock,
            **kwargs,
        )

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            self.clock.now += INTERVAL
            for node in sorted(self.running):
                self.hbs[node].beat_and_look()


def test_validation_names_the_fix(server: Any, run: str) -> None:
    def make(**kw: Any) -> NodeRing:
        args: dict[str, Any] = dict(run_id=run, generation=0, node=0, nodes=2, on_lost=print)
        return node_ring(server, **{**args, **kw})

    with pytest.raises(ConfigError, match="raise timeout"):
        make(interval=1, timeout=2)
    with pytest.raises(ConfigError, match="positive"):
        make(interval=0)
    with pytest.raises(ConfigError, match="group rank"):
        make(node=2)
    with pytest.raises(ConfigError, match="run id"):
        make(run_id="")
    hb = make(interval=timedelta(milliseconds=100), timeout=timedelta(seconds=1))
    assert (hb.interval, hb.timeout) == (0.1, 1.0)


def test_a_silent_node_is_reported_once_by_its_watcher(server: Any, run: str) -> None:
    ring = Ring(server, run, 3)
    ring.tick(4)
    assert [hb.target for hb in ring.hbs] == [1, 2, 0]
    ring.running.discard(1)
    ring.tick(DETECT - 1)
    assert ring.lost == []  # not before the timeout
    ring.tick(1)
    assert ring.lost == [(0, 1)]
    assert ring.hbs[0].target == 2  # it watches the next live node now
    ring.tick(20)
    assert ring.lost == [(0, 1)]  # once
    assert server.get(node_key(run, 0, 1)).startswith(b"lost/0/")


def test_two_adjacent_nodes_are_both_found_within_the_timeout(server: Any, run: str) -> None:
    ring = Ring(server, run, 4)
    ring.tick(3)
    ring.running -= {1, 2}
    ring.tick(DETECT)
    assert sorted(ring.lost) == [(0, 1), (0, 2)]  # the backup's clock was kept
    ring.tick(20)
    assert sorted(ring.lost) == [(0, 1), (0, 2)]
    assert ring.hbs[0].target == 3 and ring.hbs[3].target == 0


def test_a_node_that_said_bye_is_never_reported(server: Any, run: str) -> None:
    ring = Ring(server, run, 3)
    ring.tick(2)
    ring.running.discard(1)
    ring.hbs[1].close()
    ring.tick(30)
    assert ring.lost == []
    assert server.get(node_key(run, 0, 1)) == b"bye"
    assert ring.hbs[0].target == 2


def test_clocks_start_afresh_when_this_process_saw_nothing(server: Any, run: str) -> None:
    ring = Ring(server, run, 3)
    ring.tick(2)
    ring.running.discard(1)
    # node 0 itself gets no CPU for three timeouts: node 1's silence then says nothing yet
    ring.clock.now += 3 * TIMEOUT
    ring.hbs[0].beat_and_look()
    assert ring.lost == []
    ring.tick(DETECT)
    assert ring.lost == [(0, 1)]  # a real loss is still found, one timeout later


def test_a_slow_node_declared_lost_stops_and_a_replacement_comes_back(
    server: Any, run: str
) -> None:
    ring = Ring(server, run, 3)
    ring.tick(2)
    ring.running.discard(1)
    ring.tick(DETECT)
    assert ring.lost == [(0, 1)]
    ring.hbs[1].beat_and_look()  # it was only slow: it finds the mark and stops, the mark stays
    assert ring.hbs[1].evicted and ring.evicted == [1]
    assert server.get(node_key(run, 0, 1)).startswith(b"lost/")
    # a replacement takes group rank 1: its watcher sees it live again, and lost again
    ring.hbs[1] = ring.make(Counting(server), 1, 3)
    ring.running.add(1)
    ring.tick(2)  # node 0 beats before node 1 in a tick: it reads the new beat one tick later
    assert ring.back == [(0, 1)] and ring.hbs[0].target == 1
    ring.running.discard(1)
    ring.tick(DETECT)
    assert ring.lost == [(0, 1), (0, 1)]


def test_a_node_that_beats_before_the_mark_is_not_declared(server: Any, run: str) -> None:
    ring = Ring(server, run, 2)

    class Racing(Counting):  # node 1 beats between node 0's read and its mark, when armed
        armed = False

        def clone(self) -> Racing:
            return self

        def multi_get(self, keys: list[str]) -> Any:
            values = self.store.multi_get(keys)
            if self.armed:
                ring.hbs[1].beat_and_look()
            return values

    racing = Racing(server)
    ring.hbs[0] = ring.make(racing, 0, 2)
    ring.tick(2)
    ring.running.discard(1)
    ring.tick(DETECT - 1)
    racing.armed = True
    ring.tick(1)  # node 0 finds node 1 silent for the timeout, but its mark comes too late
    assert ring.lost == [] and ring.hbs[0].target == 1
    racing.armed = False
    ring.tick(DETECT)
    assert ring.lost == [(0, 1)]


def test_store_traffic_is_two_operations_per_node_per_interval(server: Any, run: str) -> None:
    n = 12
    store = Counting(server)
    ring = Ring(store, run, n)
    ring.tick(3)  # first beats also make sure the successors' keys exist
    store.counts.clear()
    ring.tick(10)
    assert store.counts["ops"] == 10 * 2 * n
    assert store.counts["keys_read"] == 10 * 2 * n  # target and backup
    ring.running -= {3, 4, 9}
    ring.tick(DETECT)
    assert sorted(lost for _, lost in ring.lost) == [3, 4, 9]
    ring.tick(1)  # watchers whose window grew make sure of the new keys once
    store.counts.clear()
    ring.tick(10)
    live = n - 3
    assert store.counts["ops"] == 10 * 2 * live, store.counts
    # each gone node is read by at most the two live nodes before it
    assert store.counts["keys_read"] <= 10 * (2 * live + 2 * 3)


def test_ranks_of_a_node(server: Any, run: str) -> None:
    assert node_ranks(server, run, 0, 1) is None
    publish_ranks(server, run, 0, 1, [2, 3])
    assert node_ranks(server, run, 0, 1) == [2, 3]
    server.set(ranks_key(run, 0, 2), b"[1, true]")
    with pytest.raises(CoordinationError, match="run id"):
        node_ranks(server, run, 0, 2)


# real processes ------------------------------------------------------------------------
PROC_INTERVAL = 0.2
PROC_TIMEOUT = 1.5


def _node_main(port: int, run: str, nodes: int, out: str) -> list[int]:
    """One "node" (RANK from RankGroup): a heartbeat in its own process, until ordered off."""
    node = int(os.environ["RANK"])
    store = connect("127.0.0.1", port, timeout=30)

    def on_lost(lost: int) -> None:
        with open(os.path.join(out, f"lost-{node}"), "a") as f:
            f.write(f"{lost} {time.time()}\n")

    hb = node_ring(
        store,
        run_id=run,
        generation=0,
        node=node,
        nodes=nodes,
        interval=PROC_INTERVAL,
        timeout=PROC_TIMEOUT,
        on_lost=on_lost,
    )
    store.add(f"{run}/ready", 1)  # start together, as agents do right after their rendezvous
    while int(store.add(f"{run}/ready", 0)) < nodes:
        time.sleep(0.01)
    hb.start()
    store.set(f"{run}/started/{node}", "1")
    store.wait([f"{run}/order/{node}"], timedelta(seconds=60))
    hb.close(bye=True)
    return hb.declared


def _reports(out: Path) -> list[tuple[int, int, float]]:
    """(watcher, lost node, when) of every on_lost call, sorted."""
    found = []
    for path in out.glob("lost-*"):
        watcher = int(path.name.split("-")[1])
        for line in path.read_text().splitlines():
            lost, when = line.split()
            found.append((watcher, int(lost), float(when)))
    return sorted(found)


def _start_nodes(server: Any, run: str, nodes: int, out: Path) -> RankGroup:
    kwargs = {"port": server.port, "run": run, "nodes": nodes, "out": str(out)}
    group = RankGroup(_node_main, nodes, kwargs=kwargs, timeout=90)
    group.start()
    group.wait_until(
        lambda: all(server.check([f"{run}/started/{n}"]) for n in range(nodes)), timeout=60
    )
    time.sleep(3 * PROC_INTERVAL)  # a few beats seen by everyone
    return group


def _kill(group: RankGroup, nodes: list[int], out: Path) -> tuple[float, list[Any]]:
    """SIGKILL ``nodes``; wait for as many reports and one timeout more (for extra ones)."""
    killed_at = time.time()
    for n in nodes:
        group.kill(n)
    group.wait_until(lambda: len(_reports(out)) >= len(nodes), timeout=2 * PROC_TIMEOUT + 10)
    time.sleep(PROC_TIMEOUT + 0.5)
    return killed_at, _reports(out)


def test_processes_a_sigkilled_node_is_reported_once_and_a_bye_never(
    server: Any, run: str, tmp_path: Path
) -> None:
    with _start_nodes(server, run, 3, tmp_path) as group:
        killed_at, reports = _kill(group, [1], tmp_path)
        assert [(w, lost) for w, lost, _ in reports] == [(0, 1)], reports  # once, by node 0
        took = reports[0][2] - killed_at
        assert PROC_TIMEOUT - PROC_INTERVAL - 0.1 <= took <= PROC_TIMEOUT + 1.0, took
        # node 2 ends normally: node 0 (its watcher now) never reports it
        server.set(f"{run}/order/2", "bye")
        group.wait_until(lambda: server.get(node_key(run, 0, 2)) == b"bye", timeout=10)
        time.sleep(PROC_TIMEOUT + 1)
        assert len(_reports(tmp_path)) == 1
        server.set(f"{run}/order/0", "stop")
        results = group.join()
    assert results[0].get() == [1] and results[2].get() == []


def test_processes_two_adjacent_nodes_killed_are_both_reported(
    server: Any, run: str, tmp_path: Path
) -> None:
    with _start_nodes(server, run, 3, tmp_path) as group:
        killed_at, reports = _kill(group, [1, 2], tmp_path)
        assert [(w, lost) for w, lost, _ in reports] == [(0, 1), (0, 2)], reports
        # the second one too within the timeout: node 0 kept the clock of its backup
        assert max(when for _, _, when in reports) - killed_at <= PROC_TIMEOUT + 1.0
        server.set(f"{run}/order/0", "stop")
        results = group.join()
    assert results[0].get() == [1, 2]
