"""In-process restart latency: fault raised -> every rank re-entered / first collective done.

Ranks 2, 4, 8 (processes on this machine), gloo, a loop of small all_reduce steps; 20 faults
at random ranks and steps. Baseline: starting fresh processes that import torch, init a gloo
group and finish one all_reduce (the least a job-level restart costs).
Run: ``.venv/bin/python bench/restart_latency.py [--ranks 2 4 8] [--faults 20]``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._dist import free_port, run_ranks

from bench import _restart_job
from bench._common import print_table, summarize, write_results

BASELINE = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(64); dist.all_reduce(t)
dist.destroy_process_group()
"""


def restart_run(
    world: int, faults: int, env: dict[str, str] | None = None
) -> dict[str, list[float]]:
    results = run_ranks(
        _restart_job.faulty_training,
        world,
        allow_leftovers=True,
        args=(faults, 1234 + world, world),
        timeout=600,
        env=env,
    )
    # A rank that gloo left blocked after an abort leaves the job (abort_timeout) and its
    # process ends: count it, and measure the rounds with the ranks that remain.
    values = [r.get() for r in results if r.ok]
    lost = [r.rank for r in results if not r.ok]
    reentry, first = [], []
    for n in range(faults):
        fault_times = [v["times"]["fault"][n] for v in values if n in v["times"]["fault"]]
        entered = [v["times"]["enter"].get(n + 1) for v in values]
        done = [v["times"]["first"].get(n + 1) for v in values]
        if not fault_times or None in entered or None in done:
            continue
        t_fault = min(fault_times)
        reentry.append(max(e for e in entered if e is not None) - t_fault)
        first.append(max(d for d in done if d is not None) - t_fault)
    return {"reentry": reentry, "first_collective": first, "lost_ranks": lost}


def baseline(world: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        port = free_port()
        start = time.monotonic()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", BASELINE],
                env={
                    "PATH": "/usr/bin:/bin",
                    "RANK": str(r),
                    "WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                },
            )
            for r in range(world)
        ]
        codes = [p.wait(timeout=300) for p in procs]
        if any(codes):
            raise RuntimeError(f"baseline processes failed: {codes}")
        out.append(time.monotonic() - start)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--faults", type=int, default=20)
    parser.add_argument("--baseline-repeats", type=int, default=3)
    args = parser.parse_args()
    results = {}
    rows = []
    for world in args.ranks:
        run = restart_run(world, args.faults)
        base = baseline(world, args.baseline_repeats)
        re, fc, bs = summarize(run["reentry"]), summarize(run["first_collective"]), summarize(base)
        results[str(world)] = {
            "fault_to_reentry_s": re,
            "fault_to_first_collective_s": fc,
            "fresh_processes_baseline_s": bs,
            "raw": {**run, "baseline": base},
        }
        rows.append(
            [
                world,
                re["p50"] * 1e3,
                re["p95"] * 1e3,
                re["max"] * 1e3,
                fc["p50"] * 1e3,
                fc["p95"] * 1e3,
                fc["p99"] * 1e3,
                fc["max"] * 1e3,
                bs["p50"] * 1e3,
                len(run["lost_ranks"]),
            ]
        )
    print_table(
        f"in-process restart, {args.faults} faults per run (ms)",
        [
            "ranks",
            "reentry p50",
            "p95",
            "max",
            "1st coll. p50",
            "p95",
            "p99",
            "max",
            "fresh procs p50",
            "ranks lost",
        ],
        rows,
    )
    write_results("restart_latency", {"faults": args.faults, "by_ranks": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
