"""Fault detection latency, and the cost of progress tracking on a tight Python loop.

For each fault kind, ``--faults`` jobs of ``--ranks`` ranks (4 by default; one fault per job):
time from the fault to the last survivor re-entering the function, minus the timeout that
applies (soft_timeout for a GIL-released hang, hard_timeout for a GIL-held one,
heartbeat_timeout for a lost node, nothing for a death). Progress tracking: a tight Python
loop timed with and without the watchdog thread sampling it (best of ``--repeats``).
Run: ``.venv/bin/python bench/detection_latency.py [--ranks 4 8] [--faults 10]``;
``--merge`` keeps the last results file's entries that this run does not measure again;
``--tracking-only`` measures only the tracking cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._dist import run_ranks
from tests.restart import _faults

from bench._common import RESULTS, print_table, summarize, write_results

STEPS, FAULT_STEP = 8, 3
_T = _faults.TIMEOUTS  # soft 1 s, hard 3 s, grace 1 s, heartbeat interval 0.2 s
KINDS = {  # kind -> (fault, the timeout subtracted, overrides, target after the subtraction)
    "death": ("sigkill", 0.0, {}, 0.1),
    "soft_hang": ("sleep", _T["soft_timeout"], {}, 0.1),
    "gil_hang": ("gil", _T["hard_timeout"], {}, _T["termination_grace_time"] + 0.2),
    "lost_node": (
        "node",
        2.0,
        {"heartbeat_timeout": 2.0, "soft_timeout": 10.0, "hard_timeout": 20.0},
        0.2,
    ),
}


def one_fault(kind: str, world: int, victim: int) -> float | None:
    fault, timeout, overrides, _ = KINDS[kind]
    with tempfile.TemporaryDirectory() as out:
        results = run_ranks(
            _faults.fault_job,
            world,
            args=(STEPS, victim, FAULT_STEP, fault, out, overrides),
            timeout=300,
            allow_leftovers=True,
        )
        t_fault = float(Path(out, f"fault-{victim}").read_text())
    entered = [
        r.value["rounds"][-1]["entered"] for r in results if r.ok and len(r.value["rounds"]) > 1
    ]
    if len(entered) < world - 1:
        return None
    return max(entered) - t_fault - timeout


def tracking_cost(repeats: int, interval: float, n: int = 30_000_000) -> dict[str, float]:
    import threading

    from trainguard.restart.watchdog import Watchdog

    def loop() -> float:
        start = time.perf_counter()
        x = 0
        for i in range(n):
            x += i
        return time.perf_counter() - start

    off, on = [], []
    for i in range(repeats):
        if i % 2:  # alternate the order, so a drift of the machine's load favours neither
            off.append(loop())
        dog = Watchdog(
            thread_id=threading.get_ident(),
            state=lambda: (0, True, None),
            on_hang=lambda n, why: None,
            soft_timeout=60.0,
            interval=interval,
        )
        try:
            on.append(loop())
        finally:
            dog.close()
        if not i % 2:
            off.append(loop())
    ratios = sorted(b / a - 1 for a, b in zip(off, on, strict=True))
    return {
        "without_s": min(off),
        "with_s": min(on),
        "slowdown": min(on) / min(off) - 1,  # best against best
        "slowdown_median_pair": ratios[len(ratios) // 2],  # adjacent runs, median
        "repeats": repeats,
        "iterations": n,
        "interval_s": interval,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[4])
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tracking-only", action="store_true")
    parser.add_argument("--merge", action="store_true")
    args = parser.parse_args()
    # every 0.1 s (soft_timeout >= 2 s, the default 60 s included), every soft_timeout/20 below
    cost = {f"{iv:g}": tracking_cost(args.repeats, iv) for iv in (0.1, 0.05)}
    print_table(
        "progress tracking on a tight loop",
        ["sampling every s", "without s", "with s", "slowdown (best)", "slowdown (median pair)"],
        [
            [
                iv,
                c["without_s"],
                c["with_s"],
                f"{100 * c['slowdown']:.2f} %",
                f"{100 * c['slowdown_median_pair']:.2f} %",
            ]
            for iv, c in cost.items()
        ],
    )
    previous = {"latency": {}}
    if args.merge:  # keep the last results of what this run does not measure again
        previous = json.loads((RESULTS / "detection_latency.json").read_text())["results"]
    if args.tracking_only:
        write_results("detection_latency", {**previous, "tracking": cost})
        return 0
    rows, out = [], {"tracking": cost, "latency": dict(previous["latency"])}
    for world in args.ranks:
        for kind in args.kinds:
            values = []
            for i in range(args.faults):
                # not rank 0: its process group holds the store process, which a lost node takes along
                victim = 1 + i % (world - 1)
                value = one_fault(kind, world, victim)
                if value is not None:
                    values.append(value)
            s = summarize(values)
            target = KINDS[kind][3]
            met = {"p50": s["p50"] <= target, "max": s["max"] <= target}
            out["latency"][f"{kind}/{world}"] = {
                **s,
                "values": values,
                "subtracted_s": KINDS[kind][1],
                "target_s": target,
                "met": met,
                "faults": args.faults,
            }
            print(f"{kind} x{world}: {[round(v, 3) for v in values]}", flush=True)
    for key, e in out["latency"].items():
        verdict = ", ".join(f"{k} {'ok' if v else 'MISSED'}" for k, v in e["met"].items())
        kind, world = key.split("/")
        rows.append([kind, world, e["n"], e["p50"], e["p95"], e["max"], e["target_s"], verdict])
    print_table(
        "fault -> every survivor back in the function, minus the timeout (s)",
        ["kind", "ranks", "n", "p50", "p95", "max", "target", "verdict"],
        rows,
    )
    write_results("detection_latency", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
