"""Coordination at scale: N simulated ranks against one real store process (issue 16).

For each N: restart rounds after a fault and after a death notice (fault -> every rank saw the
outcome -> barrier -> layout -> every rank read its assignment), the layout's bytes and store
operations per rank per round, then liveness: store operations and bytes per heartbeat interval
(in total and per rank), the connections a rank's sidecar holds, and the time to declare a
silent rank and a silent node (8 consecutive ranks) beyond ``heartbeat_timeout``. The
simulation (``bench/_coord_sim.py``) drives the library's own code: ``Session.barrier``,
``write_notice``, ``Watch.beat``, the store process the initial rank 0 starts.

Liveness is first measured on a sample of 8 observers (traffic scaled to N); the whole job
beats (and detection is timed) only when one interval's beats of every rank fit in the
interval on this machine, else the detection columns say "-".

The baseline (``--baseline``, a git revision, default the commit before issue 16) runs the same
simulation with that revision's ``src/`` in a child process; both columns print side by side.

Run: ``.venv/bin/python bench/coord_scale.py [--sizes 256 1024 4096] [--reps 5]
[--baseline 2737cfd | --no-baseline]``. Writes ``bench/results/coord_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import print_table, summarize, write_results  # noqa: E402

BASELINE = "2737cfd"
SILENT = range(8, 16)  # node 1: eight consecutive ranks go silent


def measure(n: int, reps: int, interval: float, timeout: float, budget: float) -> dict[str, Any]:
    """One size, in this process and its workers (whatever ``trainguard`` is on the path)."""
    from bench import _coord_sim

    load = os.getloadavg()[0]
    sim = _coord_sim.Sim(n, heartbeat_interval=interval, heartbeat_timeout=timeout)
    try:
        start = time.monotonic()
        rounds = _coord_sim.rounds(sim, reps, budget=budget)
        out: dict[str, Any] = {
            "n": n,
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
        roster, last = rounds["roster"], rounds["last_round"]
        out["liveness"] = _coord_sim.liveness(sim, roster, last, silent=SILENT)
        out["load_after"] = os.getloadavg()[0]
        return out
    finally:
        sim.close()


def run_baseline(rev: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same measurements with revision ``rev``'s library, in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        out = Path(tmp) / "out.json"
        env = {**os.environ, "PYTHONPATH": f"{tmp}/src{os.pathsep}{ROOT}"}
        cmd = [sys.executable, __file__, "--child", str(out), "--no-baseline", "--sizes"]
        cmd += [str(n) for n in args.sizes]
        cmd += ["--reps", str(args.reps), "--interval", str(args.interval)]
        cmd += ["--timeout", str(args.timeout), "--budget", str(args.budget)]
        subprocess.run(cmd, env=env, check=True)
        result: list[dict[str, Any]] = json.loads(out.read_text())
        return result


def _row(label: str, m: dict[str, Any]) -> list[Any]:
    live = m["liveness"]
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
        live["sweep_s"],
        live["sidecar_connections_per_rank"],
        "-" if live["detect_rank_s"] is None else live["detect_rank_s"],
        "-" if live["detect_group_s"] is None else live["detect_group_s"],
        m["consistent"],
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
    "hb sweep s",
    "sidecar conns/rank",
    "rank +s",
    "node +s",
    "ok",
]


def report(current: list[dict[str, Any]], baseline: list[dict[str, Any]] | None) -> None:
    rows = []
    for i, m in enumerate(current):
        if baseline is not None:
            rows.append(_row("baseline", baseline[i]))
        rows.append(_row("this", m))
    print_table(
        "Coordination at scale (simulated ranks, one store process; round = fault -> every rank "
        "has its assignment; rank/node +s = declared after heartbeat_timeout +s)",
        HEADERS,
        rows,
    )
    growth = []
    for label, ms in (("baseline", baseline), ("this", current)):
        for a, b in zip(ms or [], (ms or [])[1:], strict=False):
            growth.append(
                [
                    f"{a['n']} -> {b['n']}",
                    label,
                    b["round_s"]["p50"] / a["round_s"]["p50"],
                    b["liveness"]["keys_per_interval"] / a["liveness"]["keys_per_interval"],
                    b["layout_bytes"] / a["layout_bytes"],
                ]
            )
    if growth:
        headers = ["N", "code", "round time x", "hb keys x", "layout x"]
        print_table("Growth between sizes", headers, growth)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--interval", type=float, default=1.0, help="heartbeat_interval, s")
    parser.add_argument("--timeout", type=float, default=3.0, help="heartbeat_timeout, s")
    parser.add_argument(
        "--budget", type=float, default=60.0, help="s per kind of round and size, then stop"
    )
    parser.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    current = []
    for n in args.sizes:
        m = measure(n, args.reps, args.interval, args.timeout, args.budget)
        print(f"N={n}: round p50 {m['round_s']['p50']:.3f} s ...", file=sys.stderr, flush=True)
        current.append(m)
    if args.child:
        Path(args.child).write_text(json.dumps(current))
        return
    baseline = None if args.no_baseline else run_baseline(args.baseline, args)
    report(current, baseline)
    path = write_results(
        "coord_scale",
        {
            "command": " ".join(["bench/coord_scale.py", *sys.argv[1:]]),
            "baseline_rev": None if args.no_baseline else args.baseline,
            "interval_s": args.interval,
            "heartbeat_timeout_s": args.timeout,
            "this": current,
            "baseline": baseline,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
