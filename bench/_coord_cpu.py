"""CPU time per restart round, read from ``/proc``, and the cluster round time modelled from it.

Used by ``bench/_coord_sim.py`` (what the store process and the simulated ranks' threads spent)
and ``bench/coord_scale.py`` (the model). All CPU times come from
``/proc/<pid>/task/<tid>/schedstat`` (the first field: nanoseconds the thread ran), which has
nanosecond resolution where ``/proc/<pid>/stat``'s utime+stime counts 10 ms ticks.

The model (issue 34): on a cluster each rank and each node has its own CPU; what all of them
share is the store server's thread and the network. So one restart round takes about

    per-rank work + the last arriver's extra work + per-node helper work
    + the store server's busy time for the round + round trips x RTT

where per-rank work is the simulated ranks' threads' CPU for the round divided by the ranks
(the library's own code: the monitor's read of the outcome, ``Session.arrive``/``take``, the
relay client, the next round's tidy), the last arriver's extra work the largest CPU one rank
spent in ``Session.arrive`` (it reads every record and lays the round out), per-node helper
work the relays' and the watcher sockets' threads' CPU divided by the nodes, the server's busy
time all of the store process's CPU between the fault and every rank back. Round trips on the
path of a round (relay): the outcome (the relay's wait and read: 2), the rank's record and
count (2), the last arriver's check, read of the records and publication (3), the layout (the
relay's wait and read: 2): 9. Direct (no relay) the same count: each rank waits and reads itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

#: round trips on a restart round's path (see the module's docstring)
ROUND_TRIPS = 9


def thread_ns(pid: int, tid: int) -> int:
    """Nanoseconds thread ``tid`` of process ``pid`` has run (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def process_ns(pid: int) -> tuple[int, int]:
    """All of process ``pid``'s threads' run time and its busiest thread's, in nanoseconds
    (the threads alive now: a thread that ended took its time with it)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0, 0
    times = [thread_ns(pid, t) for t in tids]
    return sum(times), max(times, default=0)


def threads_ns(tids: Iterable[int]) -> int:
    """Run time of these threads of this process, nanoseconds."""
    pid = os.getpid()
    return sum(thread_ns(pid, t) for t in tids)


def modelled(
    round_cpu: dict[str, float], *, ranks: int, nodes: int, rtt: float, round_trips: int
) -> dict[str, float]:
    """One round's terms of the model and their sum, from what a round measured
    (``round_cpu``: ``server_busy_s``, ``rank_cpu_s``, ``node_cpu_s``, ``last_arriver_s``,
    ``requests``)."""
    per_rank = round_cpu["rank_cpu_s"] / ranks
    per_node = round_cpu["node_cpu_s"] / nodes if nodes else 0.0
    terms = {
        "rank_s": per_rank,
        "last_arriver_s": round_cpu["last_arriver_s"],
        "node_s": per_node,
        "server_busy_s": round_cpu["server_busy_s"],
        "network_s": round_trips * rtt,
    }
    terms["modelled_round_s"] = sum(terms.values())
    return terms


def notice_aware(
    server_busy_s: float, requests: int, *, waiters: int, node_s: float, rtt: float
) -> float:
    """Death notice -> every node aware, modelled: the notice's write and each waiter's wake-up
    and read of the outcome at the server (``waiters``: one per node with the relay, one per
    rank without), at the server's measured time per request, then the node's relaying
    (``node_s``, its whole round's work: an upper bound) and 3 round trips (the notice's write,
    the wake-up, the read)."""
    per_request = server_busy_s / requests if requests else 0.0
    return (1 + 2 * waiters) * per_request + node_s + 3 * rtt
