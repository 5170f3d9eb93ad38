"""Node processes for the node watchers' node ring tests (:mod:`trainguard.coord.node_ring`):
module level so that the spawned children can import them."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from trainguard.coord import _wire
from trainguard.coord.keys import Keyspace
from trainguard.coord.node_ring import WINDOW, NodeRing


class Counting:
    """A store client that counts the requests made through it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.requests: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests[name] = self.requests.get(name, 0) + 1
            return call(*args, **kwargs)

        return counted


def node_job(port: int, job: str, per_node: int, nodes: int, run_s: float) -> dict[str, Any]:
    """Node ``RANK`` of ``nodes`` (ranks ``node * per_node`` on) beats and judges the others
    for ``run_s`` seconds; every silent node it finds goes to ``declared/<leader>``. Returns
    its requests and beats."""
    node = int(os.environ["RANK"])
    keys = Keyspace(job)
    store = Counting(_wire.connect("127.0.0.1", port, timeout=30.0))
    mine = tuple(range(node * per_node, (node + 1) * per_node))
    roster = tuple(range(nodes * per_node))
    declared = _wire.connect("127.0.0.1", port, timeout=30.0)

    def silent(leader: int, ranks: list[int], *_: Any) -> None:
        declared.set(f"{keys.prefix}declared/{node}/{leader}", json.dumps(ranks))

    ring = NodeRing(
        store,
        keys.node_heartbeat,
        position=lambda: (mine, 0, roster),
        interval=0.1,
        timeout=1.0,
        window=WINDOW,
        on_silent=silent,
    )
    ring.start()
    time.sleep(run_s)
    ring.close()
    return {"requests": dict(store.requests), "beats": ring.sent}


def keys_job(out_dir: str) -> dict[str, Any]:
    """Under the node watcher: round 0 ends with rank 0's exception; at round 1's barrier rank
    0 waits a few heartbeat intervals and writes the node's liveness key (under its leader,
    rank 0) to ``out_dir/keys.json``."""
    from tests.restart import _arrival_jobs, _faults

    rank = int(os.environ["RANK"])

    def hook(session: Any, n: int, phase: str) -> None:
        if n != 1 or rank != 0 or phase != "after":
            return
        time.sleep(3 * _faults.TIMEOUTS["heartbeat_interval"] + 0.5)
        store, keys = session.coord, session.keys
        seen = {
            "node": store.get(keys.node_heartbeat(0)).decode(),
        }
        with open(os.path.join(out_dir, "keys.json"), "w") as f:
            json.dump(seen, f)

    _arrival_jobs._wrap_arrive(hook)
    return _faults.fault_job(6, 0, 2, "raise", out_dir, _arrival_jobs.SLOW)
