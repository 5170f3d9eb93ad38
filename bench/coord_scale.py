"""Coordination at scale: N simulated ranks against one real store process (issue 16).

For each N: restart rounds after a fault and after a death notice (fault -> every rank saw the
outcome -> barrier -> layout -> every rank read its assignment), the layout's bytes and store
operations per rank per round, then liveness: store operations and bytes per heartbeat interval
(in total and per rank), the connections a rank's sidecar holds, and the time to declare a
silent rank and a silent node (8 consecutive ranks) beyond ``heartbeat_timeout``. Then the
growth between sizes and the issue's targets (measured at the largest N), met or not.

What the job shares (issue 34), per restart round: the store server's busy time (the store
process's own CPU from ``/proc``, fault -> every rank back) and requests per rank; the CPU
of the simulated ranks' threads per rank and of the node helpers' threads per node (the
library's code); and the cluster round time modelled from them (:mod:`bench._coord_cpu`:
rank + last arriver + node + server busy + round trips x ``--rtt``) beside the simulated one.
Beyond 4,096 ranks (16,384, 65,536) the ranks of a node share a store connection (they take
turns anyway; one process holds at most 20,000 descriptors here), a worker process drives
6,144 ranks, and liveness is not measured (``--live-max``: 2 cores cannot step that many
heartbeats a second). Under node arrival liveness is one member per node (the node watcher
beats for its ranks, :mod:`bench._coord_nodelive`), measured up to ``--live-max`` nodes.

What is real and what is simulated: see ``bench/_coord_sim.py``. In short: the store process
is the library's, started as the initial rank 0 starts it; every simulated rank has its own
store client and runs the library's own code (the monitor's wait, ``Session.arrive`` /
``Session.take``, ``write_notice``, ``RingWatch.step``); the ranks are not processes but take
turns on a few threads of a few worker processes, so the round times are an upper bound.

Rows, in the same command: ``arrival`` (the library's protocol: the node watcher arrives for
its ranks, one append and one add per node per round, the records pooled in one key;
``--no-arrival`` skips it), ``this`` (each rank arriving by itself in the same pool, as a rank
whose helper died does, its waits through the node's relay; up to ``--relay-max``) and
``direct`` (each rank also waiting at the store itself; ``--no-baseline`` skips it). Before
issue 42 the second and third were the per-key protocol with and without the relay; their
numbers at that commit are in ``bench/results/coord_scale_65536.json``. Liveness is the node
ring in every row (one member per node).

Run: ``.venv/bin/python bench/coord_scale.py [--sizes 256 1024 4096 16384 65536] [--reps 5]
[--rtt 50e-6] [--no-arrival] [--relay-max 16384] [--results NAME]``. Writes
``bench/results/coord_scale.json`` (``NAME.json``). The relay rows (each rank arriving itself)
run up to ``--relay-max`` ranks (16,384): at 65,536 their 8,192 nodes' relays beside the
ranks' own connections need more than the 20,000 descriptors the store process may hold here.
The node arrival row runs at 65,536: its ranks make no store request of their own in a round
(32 share an idle connection), and each of the 8,192 simulated nodes holds what a real
watcher holds (a relay connection per key it waits for, one for its arrivals).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import _coord_shared  # noqa: E402
from bench._common import print_table, summarize, write_results  # noqa: E402
from bench._coord_shared import ROUND_TRIPS, RTT  # noqa: E402
from bench._coord_worker import LOCAL  # noqa: E402

SILENT = range(8, 16)  # node 1: eight consecutive ranks go silent


def measure(
    n: int,
    reps: int,
    interval: float,
    timeout: float,
    budget: float,
    *,
    relay: bool = True,
    arrival: bool = False,
    live: bool = True,
    rtt: float = RTT,
    round_trips: int = ROUND_TRIPS,
    procs: int | None = None,
) -> dict[str, Any]:
    """One size, in this process and its workers (whatever ``trainguard`` is on the path).
    ``relay``: the ranks learn outcomes and layouts through their node watcher's relay (the
    default), else each at the store (the baseline); ``arrival``: node arrival (with the
    relay); ``live``: measure liveness too; ``rtt``
    and ``round_trips``: the network's part of the modelled cluster round (see
    :mod:`bench._coord_cpu`); ``procs``: worker processes (0: one worker thread here)."""
    from bench import _coord_sim

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the store's waits time out often
    load = os.getloadavg()[0]
    sim = _coord_sim.Sim(
        n,
        heartbeat_interval=interval,
        heartbeat_timeout=timeout,
        relay=relay,
        procs=procs,
        arrival=arrival,
    )
    try:
        start = time.monotonic()
        rounds = _coord_sim.rounds(sim, reps, budget=budget)
        out: dict[str, Any] = {
            "n": n,
            "interval_s": interval,
            "procs": sim.procs,
            "load_before": load,
            "round_s": summarize(rounds["fault"]),
            "fault_aware_s": summarize(rounds["fault_aware"]),
            "notice_round_s": summarize(rounds["notice"]),
            "notice_aware_s": summarize(rounds["notice_aware"]),
            "layout_bytes": max(rounds["layout_bytes"]),
            "round_ops_per_rank": max(rounds["ops_per_rank"]),
            "consistent": rounds["consistent"],
            "errors": rounds["errors"],
            "rounds_wall_s": time.monotonic() - start,
        }
        out["relay"] = relay
        out["node_arrival"] = sim.arrival
        out.update(
            _coord_shared.shared(n, rounds["cpu"], rounds["ops_per_rank"], relay, rtt, round_trips)
        )
        out["ranks_per_connection"] = sim.share
        roster, last = rounds["roster"], rounds["last_round"]
        if live:
            out["liveness"] = _coord_sim.liveness(sim, roster, last, silent=SILENT)
            nodes = -(-len(roster) // LOCAL)
            # each member beats once an interval: its requests per beat are per interval,
            # measured exactly (the window's own count scales by its length, +-1 request).
            # Under node arrival a member is a node (a node whose ranks two worker processes
            # drive is two members here: the simulation's split, not the watcher's)
            hb = out["liveness"]
            per_node = 1 if arrival else hb["members"] / nodes
            out["liveness_requests_per_node"] = (
                hb["ops_per_interval"] / nodes
                if hb["requests_per_beat"] is None
                else hb["requests_per_beat"] * per_node
            )
        out["load_after"] = os.getloadavg()[0]
        return out
    finally:
        sim.close()


def _row(label: str, m: dict[str, Any]) -> list[Any]:
    live: dict[str, Any] = m.get("liveness") or dict.fromkeys(LIVE_KEYS)
    return [
        m["n"],
        label,
        m["round_s"]["p50"],
        m["round_s"]["p95"],
        m["round_s"]["max"],
        m["notice_aware_s"]["p50"],
        m["notice_round_s"]["p50"],
        m["layout_bytes"],
        m["round_ops_per_rank"],
        live["ops_per_interval"],
        live["keys_per_interval"],
        live["bytes_per_rank"],
        live["sidecar_connections_per_rank"],
        "-" if live["detect_rank_s"] is None else live["detect_rank_s"],
        "-" if live["detect_group_s"] is None else live["detect_group_s"],
        m["consistent"] and not live["false"] and valid(m),
        f"{m.get('load_before', 0):.1f}/{m.get('load_after', 0):.1f}",
    ]


LIVE_KEYS = [
    "ops_per_interval",
    "keys_per_interval",
    "bytes_per_rank",
    "sidecar_connections_per_rank",
    "detect_rank_s",
    "detect_group_s",
    "false",
]

HEADERS = [
    "N",
    "code",
    "round p50 s",
    "p95",
    "max",
    "notice->aware p50",
    "notice round p50",
    "layout B",
    "round ops/rank",
    "hb ops/interval",
    "hb keys/interval",
    "hb B/rank",
    "sidecar conns/rank",
    "rank +s",
    "node +s",
    "ok",
    "load",
]


def connections(world: int = 2) -> dict[str, Any]:
    """The store connections of ``world`` real ranks on the library's path, counted inside the
    function (:mod:`bench._coord_conns`): per rank, its process's and its sidecar's."""
    from tests._dist import run_ranks

    from bench import _coord_conns

    results = run_ranks(_coord_conns.count_connections, world, args=(1.0,), timeout=180)
    values = [r.get() for r in results]
    per_rank = [v["process"] + v["sidecar"] for v in values]
    return {"ranks": values, "per_rank": max(per_rank)}


def valid(m: dict[str, Any]) -> bool:
    """Whether the simulation kept up with its heartbeats at this size: every watch stepped
    within a quarter interval of when it asked (else beats come late, observers judge ranks
    whose driver lagged, and the traffic per interval is what the lag allowed)."""
    live = m.get("liveness") or {}
    return bool(live.get("driver_lag_s", 0.0) <= 0.25 * m["interval_s"])


def targets(current: list[dict[str, Any]], conns: dict[str, Any]) -> list[list[Any]]:
    """The issue's table: each target, the value measured at the largest N, met or not."""
    big = current[-1]
    n = big["n"]
    live = dict(big["liveness"])
    if not valid(big):  # the simulation fell behind its own heartbeats: no liveness numbers
        live.update(ops_per_interval=None, detect_rank_s=None, detect_group_s=None)
    detect = [live["detect_rank_s"], live["detect_group_s"]]
    rows: list[tuple[str, str, float | None, float]] = [
        (f"restart round p50, N={n}", "<= 0.5 s", big["round_s"]["p50"], 0.5),
        (
            f"death notice -> every rank aware p50, N={n}",
            "<= 0.1 s",
            big["notice_aware_s"]["p50"],
            0.1,
        ),
        (f"liveness store ops per interval, N={n}", f"<= {2 * n}", live["ops_per_interval"], 2 * n),
    ]
    prev = [m for m in current if m["n"] * 4 == n]
    if prev:
        growth = big["round_s"]["p50"] / prev[0]["round_s"]["p50"]
        rows.append((f"round time growth {prev[0]['n']} -> {n}", "<= 5x", growth, 5.0))
    worst = None if None in detect else max(d for d in detect if d is not None)
    rows.append(("silent rank / node: declared after heartbeat_timeout +", "<= 0.2 s", worst, 0.2))
    rows.append(
        ("store connections per rank (2 real ranks, counted)", "<= 2", conns["per_rank"], 2)
    )
    return [
        [name, text, "-" if v is None else v, "-" if v is None else ("yes" if v <= limit else "NO")]
        for name, text, v, limit in rows
    ]


def report(
    current: list[dict[str, Any]],
    base: list[dict[str, Any]],
    conns: dict[str, Any],
    arrival: list[dict[str, Any]] | None = None,
) -> None:
    rows, shared_rows = [], []
    arrival = arrival or []
    kinds = (("relay", current), ("arrival", arrival), ("direct", base))
    for n in sorted({m["n"] for _, ms in kinds for m in ms}):
        for label, ms in kinds:
            rows += [_row(label, m) for m in ms if m["n"] == n]
            shared_rows += [_coord_shared.row(label, m) for m in ms if m["n"] == n]
    print_table(
        "Coordination at scale (simulated ranks, one store process; round = fault -> every rank "
        "has its assignment; rank/node +s = declared after heartbeat_timeout +s; load = 1-min "
        "load average before/after; ok = consistent layouts, no live rank declared, and the "
        "simulation kept up with its heartbeats)",
        HEADERS,
        rows,
    )
    growth = []
    for label, ms in (("relay", current), ("arrival", arrival), ("direct", base)):
        for a, b in itertools.pairwise(ms):
            la, lb = a.get("liveness"), b.get("liveness")
            growth.append(
                [
                    f"{a['n']} -> {b['n']}",
                    label,
                    b["n"] / a["n"],
                    b["round_s"]["p50"] / a["round_s"]["p50"],
                    b["notice_aware_s"]["p50"] / a["notice_aware_s"]["p50"],
                    lb["ops_per_interval"] / la["ops_per_interval"] if la and lb else "-",
                    b["layout_bytes"] / a["layout_bytes"],
                ]
            )
    if growth:
        headers = ["N", "code", "N x", "round time x", "aware x", "hb ops x", "layout x"]
        print_table("Growth between sizes", headers, growth)
    live = [m for m in current if "liveness" in m]
    if live:
        print_table(
            "Targets (issue 16)", ["measure", "target", "measured", "met"], targets(live, conns)
        )
    print_table(
        "What the job shares, per restart round (CPU from /proc: the store process's threads, "
        "the simulated ranks' threads per rank, the node helpers' threads per node; modelled "
        "round = rank + last arriver + node + server busy + round trips x RTT; p50 over the "
        "rounds; load = 1-min load average before/after on this machine's "
        f"{os.cpu_count()} CPUs)",
        _coord_shared.HEADERS,
        shared_rows,
    )
    if current:
        print_table(
            "Targets (issue 34, relay)",
            ["measure", "target", "measured", "met"],
            _coord_shared.targets(current),
        )
    if arrival:
        print_table(
            "Targets (issue 34, node arrival)",
            ["measure", "target", "measured", "met"],
            _coord_shared.targets(arrival),
        )
        ops = sorted({op for a in arrival for op in a["node_requests_by_op"]})
        print_table(
            "Node arrival: the node helpers' store requests per node per round, by operation "
            "and key (p50 over the rounds; the ranks make none of their own)",
            ["operation key", *(str(a["n"]) for a in arrival)],
            [[op, *(a["node_requests_by_op"].get(op, 0.0) for a in arrival)] for op in ops]
            + [["all (p50 per round)", *(a["requests_per_node"]["p50"] for a in arrival)]],
        )
        print_table(
            "Targets (issue 42, item 5, node arrival)",
            ["measure", "target", "measured", "met"],
            _coord_shared.targets_42(arrival),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat_interval, s")
    parser.add_argument("--timeout", type=float, default=3.0, help="heartbeat_timeout, s")
    parser.add_argument(
        "--budget", type=float, default=60.0, help="s per kind of round and size, then stop"
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the baseline rows (each rank waits for outcomes and layouts at the store)",
    )
    parser.add_argument(
        "--results",
        default="coord_scale",
        help="write bench/results/<this>.json (a partial run need not replace the full one)",
    )
    parser.add_argument(
        "--no-arrival",
        action="store_true",
        help="skip the node arrival rows (the node watcher arrives for its ranks)",
    )
    parser.add_argument(
        "--relay-max",
        type=int,
        default=16384,
        help="the relay rows (each rank arrives itself) up to this size (0: none); beyond "
        "16,384 ranks they need more connections than the store process may hold here",
    )
    parser.add_argument(
        "--rtt", type=float, default=RTT, help="s, one network round trip, for the model"
    )
    parser.add_argument(
        "--round-trips", type=int, default=ROUND_TRIPS, help="on a round's path, for the model"
    )
    parser.add_argument(
        "--live-max",
        type=int,
        default=4096,
        help="measure liveness up to this size (2 cores cannot beat for more ranks each second); "
        "node arrival's up to this many nodes",
    )
    args = parser.parse_args()
    current, base, arrival = [], [], []
    model = {"rtt": args.rtt, "round_trips": args.round_trips}
    for n in args.sizes:
        live = n <= args.live_max
        if n <= args.relay_max:
            m = measure(n, args.reps, args.interval, args.timeout, args.budget, live=live, **model)
            print(f"N={n}: round p50 {m['round_s']['p50']:.3f} s ...", file=sys.stderr, flush=True)
            current.append(m)
        # the other protocols, side by side in the same run: each rank at the store itself
        # (no relay), and the node arriving for its ranks (node liveness: one ring member per
        # node, so 8 times the ranks for the same steps)
        others = []
        if not args.no_baseline:
            others.append(("direct", base, {"relay": False, "live": False}))
        if not args.no_arrival:
            others.append(
                ("arrival", arrival, {"arrival": True, "live": n // LOCAL <= args.live_max})
            )
        for name, into, how in others:
            o = measure(n, args.reps, args.interval, args.timeout, args.budget, **how, **model)
            print(f"N={n} {name}: round p50 {o['round_s']['p50']:.3f} s", file=sys.stderr)
            into.append(o)
    conns = connections()
    live = [m for m in current if "liveness" in m]
    report(current, base, conns, arrival)
    write_results(
        args.results,
        {
            "command": " ".join(["bench/coord_scale.py", *sys.argv[1:]]),
            "interval_s": args.interval,
            "heartbeat_timeout_s": args.timeout,
            "this": current,
            "baseline_direct": base,
            "node_arrival": arrival,
            "connections": conns,
            "targets": targets(live, conns) if live else [],
            "rtt_s": args.rtt,
            "round_trips": args.round_trips,
            "targets_shared": _coord_shared.targets(current) if current else [],
            "targets_shared_node_arrival": _coord_shared.targets(arrival) if arrival else [],
            "targets_node_arrival_round": _coord_shared.targets_42(arrival) if arrival else [],
        },
    )


if __name__ == "__main__":
    main()
