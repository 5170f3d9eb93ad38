"""256 simulated ranks on one real store process (bench/_coord_sim.py): the restart protocol
and the heartbeats at a size no multi-process test reaches.

Each simulated rank has its own store client and runs the library's own code (the monitor's
wait through its node watcher's relay, ``Session.arrive``/``Session.take``, ``write_notice``,
``RingWatch.step``), driven in turn by a few threads of this process; a silent node is eight
consecutive ranks whose heartbeats stop.
"""

from __future__ import annotations

import threading
import time

from bench import _coord_sim

from trainguard.coord.node_ring import WINDOW

N = 256
INTERVAL, TIMEOUT = 0.2, 1.0
SILENT = range(40, 48)


def test_256_ranks_agree_on_every_layout_and_a_silent_node_is_declared() -> None:
    threads_before = threading.active_count()
    sim = _coord_sim.Sim(N, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT, procs=0)
    try:
        rounds = _coord_sim.rounds(sim, 1)  # a fault, then a death notice
        assert rounds["errors"] == []
        assert rounds["consistent"]  # one layout per round; ranks 0..active-1 each given once
        assert len(rounds["roster"]) == N - 1  # the notice's rank is gone
        # compact layouts: a round in order with a rank gone is a few runs, not 256 ranks
        assert max(rounds["layout_bytes"]) < 400, rounds["layout_bytes"]
        # O(1) per rank per round: its line in the round's pool and its count (each rank
        # arriving by itself here); the outcome and the layout (a wait and a read each) once
        # per node of 8, through the node watcher's relay
        assert max(rounds["ops_per_rank"]) < 3 + 4 / 8 + 0.2, rounds["ops_per_rank"]
        live = _coord_sim.liveness(sim, rounds["roster"], rounds["last_round"], silent=SILENT)
    finally:
        sim.close()
    assert live["declared_all"], live  # every rank of the silent node was declared gone
    assert live["false"] == [], live  # and no rank that kept beating
    # declared at heartbeat_timeout after the first observer saw its last beat (observers look
    # at the deadline, not at their next beat): well under an interval late, plus the load
    assert 0.0 <= live["detect_group_s"] < INTERVAL + 0.5, live
    # O(nodes) liveness: two operations per node per interval (its beat, one read of the next
    # WINDOW nodes' keys), plus looks at a deadline when a loaded machine steps a node late
    nodes = N // 8
    assert live["ops_per_interval"] <= 5 * nodes, live
    assert live["keys_per_interval"] <= 2 * (WINDOW + 1) * nodes, live
    # one connection per node watcher (its member of the node ring): 32 nodes of 8
    assert live["members"] == 32 and live["sidecar_connections_per_rank"] == 1.0, live
    deadline = time.monotonic() + 10.0
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == threads_before  # no thread left behind
