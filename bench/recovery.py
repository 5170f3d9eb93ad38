"""Fast recovery: fault -> training again (every active rank finished one step of the new round).

Runs ``trainguard demo`` (the demo model: persistent checkpointers, local replicated checkpoints
restored from memory, hot spares) with a schedule of injected faults of one kind, and reads each
fault's *training again* time from the run's report (``report.json``: the fault's moment to the
latest end of the next round's first step; see :mod:`trainguard.report._reinit`), with its
re-initialization split (process group, checkpointer, checkpoint load and its source). A hang's
time is reported minus ``--soft-timeout`` (what it costs beyond the detection it asked for).

Fault kinds: exception; hang (a GIL-releasing sleep); kill (SIGKILL, a spare takes the rank: one
spare per kill, so at most ``--kills`` per run); lostdir (a rank's local root deleted, its part
comes from a peer). Side by side, in the same run:

- (a) job-level restart: fresh processes that import torch, init a gloo group and do one
  all_reduce (the least a job-level restart costs, no checkpoint load: a lower bound);
- (b) ``torchrun --max-restarts=1``: rank 1 of a running Wrapper job SIGKILLed -> both active
  ranks of the restarted attempt stepping (bench/_launch_wrapper.py ``torchrun``).

Not covered here (left out for time; see the issue): the 256 MiB-per-rank model (the demo's
model has a fixed size).
Run: ``.venv/bin/python bench/recovery.py [--ranks 4 8] [--faults 10] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _launch_wrapper
from bench._common import print_table, summarize, write_results
from bench.restart_latency import baseline

KINDS = ("exception", "hang", "kill", "lostdir")
SOFT_TIMEOUT = 1.0
EVERY = 12  # steps between two faults (a local checkpoint every 5 steps)


def schedule(kind: str, count: int, ranks: int) -> tuple[str, int]:
    """``KIND@STEP:RANK,...`` for ``count`` faults, and the steps the run needs."""
    faults = [f"{kind}@{EVERY * (k + 1) + 3}:{1 + k % (ranks - 1)}" for k in range(count)]
    return ",".join(faults), EVERY * (count + 1) + 5


def demo_run(kind: str, count: int, ranks: int, tmp: Path) -> list[dict[str, Any]]:
    """One demo run with ``count`` faults of ``kind``; each fault's report entry."""
    faults, steps = schedule(kind, count, ranks)
    out = tmp / f"{kind}-{ranks}"
    spares = count if kind == "kill" else 1
    cmd = [sys.executable, "-m", "trainguard", "demo", "--ranks", str(ranks)]
    cmd += ["--spares", str(spares), "--steps", str(steps), "--faults", faults]
    cmd += ["--out", str(out), "--local-every", "5", "--disk-every", "1000"]
    cmd += ["--soft-timeout", str(SOFT_TIMEOUT), "--timeout", "280"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"demo failed ({done.returncode}): {done.stdout[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    return [f for f in report["faults"] if f.get("training_again") is not None]


def measure(kind: str, count: int, ranks: int, tmp: Path, kills: int) -> dict[str, Any]:
    found: list[dict[str, Any]] = []
    left = count
    while left > 0:
        n = min(left, kills) if kind == "kill" else left
        found += demo_run(kind, n, ranks, tmp)
        left -= n
    cut = SOFT_TIMEOUT if kind == "hang" else 0.0
    again = [f["training_again"] - cut for f in found]
    parts = {
        part: summarize([f["reinit"].get(part, 0.0) for f in found])["p50"]
        for part in ("process_group", "checkpointer", "checkpoint_load", "other")
    }
    first = summarize([f["first_step"] for f in found])["p50"]
    sources = sorted({s for f in found for s in (f.get("load_source") or "").split("+") if s})
    return {
        "training_again_s": summarize(again),
        "reinit_p50_s": parts,
        "first_step_p50_s": first,
        "sources": sources,
        "raw": found,
    }


def torchrun_baseline(tmp: Path, repeats: int) -> list[float]:
    return [_launch_wrapper.torchrun(tmp / f"torchrun-{i}")["all_back_s"] for i in range(repeats)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--faults", type=int, default=10, help="faults per kind and rank count")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--kills", type=int, default=5, help="kills (spares) per demo run")
    parser.add_argument("--baseline-repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 ranks, 3 faults, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.faults, args.baseline_repeats = [4], 3, 1
    results: dict[str, Any] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="tg-recovery-") as name:
        tmp = Path(name)
        for ranks in args.ranks:
            job = summarize(baseline(ranks, args.baseline_repeats))
            results[f"job_restart_{ranks}"] = job
            for kind in args.kinds:
                got = measure(kind, args.faults, ranks, tmp, args.kills)
                results[f"{kind}_{ranks}"] = got
                s, p = got["training_again_s"], got["reinit_p50_s"]
                rows.append(
                    [kind, ranks, s["n"], s["p50"] * 1e3, s["p95"] * 1e3, s["max"] * 1e3]
                    + [p[k] * 1e3 for k in ("process_group", "checkpointer", "checkpoint_load")]
                    + [got["first_step_p50_s"] * 1e3, "+".join(got["sources"]) or "-"]
                    + [job["p50"] / s["p50"] if s["p50"] > 0 else float("nan")]
                )
        torchrun = summarize(torchrun_baseline(tmp, args.baseline_repeats))
        results["torchrun_max_restarts_2"] = torchrun
    headers = ["fault", "ranks", "n", "p50", "p95", "max", "pg p50", "ckpt setup", "load"]
    headers += ["1st step", "source", "x vs job restart"]
    print_table("fault -> training again (ms; hang: minus soft_timeout)", headers, rows)
    names = [f"job_restart_{r}" for r in args.ranks] + ["torchrun_max_restarts_2"]
    base_rows = [[k, results[k]["p50"] * 1e3, results[k]["max"] * 1e3] for k in names]
    print_table("baselines (ms)", ["baseline", "p50", "max"], base_rows)
    write_results("recovery", {"faults": args.faults, "soft_timeout": SOFT_TIMEOUT, **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
