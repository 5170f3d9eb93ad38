"""Node liveness under node arrival: the node watchers' node ring
(:class:`trainguard.coord.node_ring.NodeRing` without lost marks): each node beats one key for
its ranks and watches the nodes after it. Real node processes, a real
TCPStore, a real SIGSTOP; the test reads the store's keys and counts each node's requests, so
that it fails if the nodes beat a key per rank."""

from __future__ import annotations

import json
import secrets
import signal
import time
from datetime import timedelta

import torch.distributed as dist

from tests._dist import RankGroup, run_ranks
from tests.restart import _node_ring_jobs
from trainguard.coord.keys import Keyspace
from trainguard.coord.node_ring import WINDOW, NodeRing
from trainguard.coord.ring_judge import parse_value

PER_NODE, NODES, RUN_S = 4, 3, 5.0


def _declared(store: dist.TCPStore, keys: Keyspace, by: int, leader: int) -> list[int] | None:
    key = f"{keys.prefix}declared/{by}/{leader}"
    return json.loads(store.get(key)) if store.check([key]) else None


def test_a_silent_node_gets_all_its_ranks_declared_and_live_nodes_none() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    job = f"nodelive-{secrets.token_hex(4)}"
    keys = Keyspace(job)
    with RankGroup(
        _node_ring_jobs.node_job,
        NODES,
        args=(server.port, job, PER_NODE, NODES, RUN_S),
        timeout=60,
    ) as group:
        group.start()  # rank i of the group is node i
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not server.check([keys.node_heartbeat(4)]):
            time.sleep(0.05)
        time.sleep(0.5)  # node 1 beat a few times: its watchers' clocks run
        group.kill(1, signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() < deadline + RUN_S and not all(
            _declared(server, keys, by, 4) is not None for by in (0, 2)
        ):
            time.sleep(0.05)
        found = time.monotonic() - stopped
        group.kill(1, signal.SIGKILL)
        results = group.join()
    values = {r.rank: r.get() for r in results if r.rank != 1}
    # node 1's ranks, all of them, declared by each node that watches it (its ring window)
    assert _declared(server, keys, 0, 4) == [4, 5, 6, 7]
    assert _declared(server, keys, 2, 4) == [4, 5, 6, 7]
    assert found < 1.0 + 2.0, found
    # a live node is never declared
    for by in (0, 2):
        for leader in (0, 8):
            assert _declared(server, keys, by, leader) is None, (by, leader)
    # one key per node, none per rank: node 1's lists its ranks; the others said bye at the end
    assert parse_value(server.get(keys.node_heartbeat(4)))[0] == [4, 5, 6, 7]
    assert server.get(keys.node_heartbeat(0)) == b"bye"
    assert server.get(keys.node_heartbeat(8)) == b"bye"
    # 2 requests per node per interval (a set, a multi_get), whatever its ranks: the per-rank
    # ring made 2 per rank (8 per node here); the compare_sets make the read keys exist once
    for node, value in values.items():
        req = value["requests"]
        assert req.get("compare_set", 0) <= (NODES - 1) * PER_NODE, (node, req)
        assert req["set"] <= value["beats"] + 1, (node, req)  # the last is its bye
        assert req["multi_get"] <= value["beats"] + 3, (node, req)  # + looks when a clock ran out
        per_interval = (req["set"] + req["multi_get"]) / value["beats"]
        assert per_interval <= 2.1, (node, req, value["beats"])


def test_the_node_watcher_beats_once_for_its_node(tmp_path) -> None:
    """Real ranks, their node watcher, a real store: the node's key, under its leader, lists
    every rank, and its counter moves."""
    results = run_ranks(
        _node_ring_jobs.keys_job,
        3,
        args=(str(tmp_path),),
        timeout=120,
    )
    for r in results:
        r.get()
    seen = json.loads((tmp_path / "keys.json").read_text())
    ranks, counter = parse_value(seen["node"].encode())
    assert ranks == [0, 1, 2] and counter >= 2, seen


def test_the_node_key_moves_with_its_lowest_rank_and_a_silent_node_is_judged_once() -> None:
    """One real store, two nodes' rings stepped by hand on a fake clock: the node's key is
    under its lowest live rank (the old one says bye), a node that stops beating is declared
    with every rank it lists in the roster, once, after heartbeat_timeout."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    keys = Keyspace(f"nodering-{secrets.token_hex(4)}")
    now = [0.0]
    roster = (0, 1, 2, 3, 4)
    mine = {"a": (0, 1), "b": (2, 3, 4)}
    declared: list[tuple[int, list[int]]] = []
    rings = {
        name: NodeRing(
            server,
            keys.node_heartbeat,
            position=lambda name=name: (mine[name], 0, roster),
            interval=1.0,
            timeout=3.0,
            window=WINDOW,
            on_silent=lambda leader, ranks, *_: declared.append((leader, ranks)),
            clock=lambda: now[0],
        )
        for name in mine
    }
    for _ in range(3):  # both beat; a watches b's leader, 2
        for ring in rings.values():
            ring.beat_and_look()
        now[0] += 1.0
    assert rings["a"].window_of(0, roster) == [2, 3, 4]
    mine["b"] = (3, 4)  # rank 2 left node b: its key says bye, the node beats under 3
    rings["b"].beat_and_look()
    assert server.get(keys.node_heartbeat(2)) == b"bye"
    assert parse_value(server.get(keys.node_heartbeat(3))) == ([3, 4], 4)
    for _ in range(2):
        rings["a"].beat_and_look()  # a sees 2's bye (no notice) and b's beats under 3
        now[0] += 1.0
    assert declared == []
    for _ in range(5):  # b is silent from now on
        rings["a"].beat_and_look()
        now[0] += 1.0
    assert declared == [(3, [3, 4])]  # once, every rank of it in the roster
