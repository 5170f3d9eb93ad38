"""Kill -> training again: an idle spare, a warm worker, a cold respawn, side by side, one run.

Run: ``.venv/bin/python bench/warm_worker.py [--repeats 3]`` (~3-5 min with 3 repeats on a
shared 2-core machine). Prints a table (p50 / max over the repeats, ms) and writes
bench/results/warm_worker.json.

The job is bench/_launch_wrapper.py's: ``tests/launch/_workers.py wrapper`` (gloo,
:class:`trainguard.restart.Wrapper` with ``FillGaps`` + ``MaxActiveWorldSize(2)``, a step every
20 ms, ``OUT/hold`` present so that no round ends on its own), one node, 2 active ranks. Per
repeat and scenario, initial rank 1 (active) is SIGKILLed once both active ranks step:

- spare: 3 workers (one idle spare), default options: the spare takes the dead rank's place;
- warm: 2 workers (no spare), ``--tg-warm-workers 1``, killed once the warm process reported
  its imports done (``launch_warm_ready``): the respawn is that process;
- cold: 2 workers (no spare), default options: the respawn is a new process.

"training again" = the latest, over the 2 active ranks, of each one's first step in a round
of world size 2 that began after the kill (the round number is higher than any before it).
Also: kill -> the respawned process's start record (``_workers.py``'s, after argument parsing),
and -> its start-up done (``OUT/ready.jsonl``: torch and trainguard imported). Wall-clock:
the workers' ``time.time()`` minus the bench's just before the kill.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.launch._agents import read_starts

from bench._common import print_table, summarize, write_results
from bench._launch_wrapper import VICTIM, Job, _events, _records

SCENARIOS: dict[str, tuple[int, tuple[str, ...]]] = {
    "spare": (3, ()),
    "warm": (2, ("--tg-warm-workers=1",)),
    "cold": (2, ()),
}
ACTIVE = 2


def one(tmp: Path, name: str, repeat: int) -> dict[str, Any]:
    nproc, extra = SCENARIOS[name]
    with Job(tmp, f"{name}-{repeat}", nproc=nproc, active=ACTIVE, extra=extra) as job:
        job.running(ACTIVE)
        warm_pid = None
        if name == "warm":
            ready = job.wait_for(lambda: _events(job.ev, "launch_warm_ready"), "warm ready")
            warm_pid = int(ready[0]["worker_pid"])
        before = max(s["round"] for s in job.steps())
        victim = job.pid(VICTIM)
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)

        def again() -> dict[int, float] | None:
            first: dict[int, float] = {}
            for s in job.steps():
                if s["round"] > before and s["world"] == ACTIVE and s["time"] > t_kill:
                    first.setdefault(s["rank"], s["time"])
            return first if len(first) == ACTIVE else None

        first = job.wait_for(again, "training again", timeout=90)
        respawn = job.wait_for(
            lambda: [s for s in read_starts(job.out) if s["incarnation"] == "1"], "respawn"
        )[0]
        ready = job.wait_for(
            lambda: [r for r in _records(job.out / "ready.jsonl") if r["pid"] == respawn["pid"]],
            "respawn ready",
        )[0]
    return {
        "training_again": max(first.values()) - t_kill,
        "respawn_start": respawn["time"] - t_kill,
        "respawn_ready": ready["time"] - t_kill,
        "warm_pid_served": warm_pid is not None and respawn["pid"] == warm_pid,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-warm-"))
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name in SCENARIOS}
    try:
        for repeat in range(args.repeats):
            for name in SCENARIOS:  # interleaved: the same load for each
                raw[name].append(one(tmp, name, repeat))
                print(f"  repeat {repeat} {name}: {raw[name][-1]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stats = {
        name: {
            key: summarize([r[key] for r in runs])
            for key in ("training_again", "respawn_start", "respawn_ready")
        }
        for name, runs in raw.items()
    }
    rows = []
    for name in SCENARIOS:
        s = stats[name]
        rows.append(
            [
                name,
                *(f"{s[k]['p50'] * 1e3:.0f} / {s[k]['max'] * 1e3:.0f}" for k in s),
            ]
        )
    print_table(
        f"kill -> (ms, p50 / max over {args.repeats}), 1 node, 2 active ranks, one run",
        ["path", "training again", "respawn started", "respawn past imports"],
        rows,
    )
    served = all(r["warm_pid_served"] for r in raw["warm"])
    ratio = stats["warm"]["training_again"]["p50"] / stats["spare"]["training_again"]["p50"]
    print(f"\nwarm respawn was the warm process every time: {served}")
    print(f"warm / spare, training again (p50): {ratio:.2f} (target <= 2)")
    write_results(
        "warm_worker",
        {"repeats": args.repeats, "raw": raw, "stats": stats, "warm_over_spare": ratio},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
