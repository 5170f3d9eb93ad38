"""Launcher: ``trainguard launch`` side by side with ``torchrun``, the same job, one run.

2 "nodes" (agents on this machine, c10d rendezvous on loopback) x 2 plain-Python workers that
count steps every 50 ms (tests/launch/_workers.py; no torch import, so the numbers are the
launchers' own cost, not a framework's start-up). Per repeat and launcher, one worker is
SIGKILLed once the job runs, and the progress files are polled every few ms:

- respawn (trainguard launch, default options): kill -> the survivors' next step (they never
  stop), kill -> the respawned process starts, kill -> its first step (the world is back);
- escalation (trainguard launch ``--tg-respawns=0 --max-restarts=1``): kill -> every worker of
  the new generation made a step;
- torchrun ``--max-restarts=1``: kill -> every worker of the restarted attempt made a step;
- helper processes per node: processes of the job that are not workers, divided by the nodes.

Run: ``.venv/bin/python bench/launch.py [--repeats 3]``. The Wrapper rows (gloo + in-process
restart) are not here yet.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.launch._agents import Agents, leftovers, read_starts

from bench._common import print_table, summarize, write_results

NODES, NPROC, STEP = 2, 2, 0.05
VICTIM = 3  # a worker of node 1
WORLD = NODES * NPROC


class Progress:
    """Polls every rank's step counter; ``changes[rank]`` = wall times at which it moved."""

    def __init__(self, out: Path, period: float = 0.003) -> None:
        self.out, self.period = out, period
        self.changes: dict[int, list[float]] = {r: [] for r in range(WORLD)}
        self._last: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for rank in range(WORLD):
                try:
                    value = (self.out / f"progress-{rank}").read_text()
                except OSError:
                    continue
                if value and value != self._last.get(rank):
                    self._last[rank] = value
                    self.changes[rank].append(now)
            time.sleep(self.period)

    def first_after(self, rank: int, t: float) -> float | None:
        return next((c for c in self.changes[rank] if c > t), None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _helpers(run_id: str, out: Path) -> float:
    workers = {s["pid"] for s in read_starts(out)}
    return len([p for p in leftovers(run_id) if p not in workers]) / NODES


def _back(progress: Progress, out: Path, t_kill: float, ranks: range | list[int]) -> float:
    """Seconds from the kill until each of ``ranks`` made a step in a process started after
    the kill (the slowest rank)."""
    starts = read_starts(out)
    worst = 0.0
    for rank in ranks:
        started = max(s["time"] for s in starts if s["rank"] == rank)
        t = progress.first_after(rank, max(started, t_kill))
        if t is None:
            raise RuntimeError(f"rank {rank} made no step after the kill")
        worst = max(worst, t - t_kill)
    return worst


def scenario(tmp: Path, name: str, module: str, extra: list[str]) -> dict[str, float]:
    """One job: start, kill the victim, wait until it is back, stop, measure."""
    out = tmp / name
    out.mkdir(parents=True)
    progress = Progress(out)
    try:
        with Agents(
            tmp, nodes=NODES, nproc=NPROC, worker=["run", str(out)], module=module, extra=extra
        ) as job:
            job.wait_for(
                lambda: all(len(progress.changes[r]) >= 3 for r in range(WORLD)), what="steps"
            )
            helpers = _helpers(job.run_id, out)
            victim = next(s["pid"] for s in read_starts(out) if s["rank"] == VICTIM)
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            result = _measure(job, progress, out, t_kill, name)
            result["helpers_per_node"] = helpers
            result["survivors_restarted"] = len(
                {s["rank"] for s in read_starts(out) if s["time"] > t_kill and s["rank"] != VICTIM}
            )
            (out / "stop").touch()
            codes = job.wait(timeout=60)
            if any(codes):
                raise RuntimeError(f"{name}: agents exited {codes}\n{job.output()}")
    finally:
        progress.close()
    return result


def _measure(
    job: Agents, progress: Progress, out: Path, t_kill: float, name: str
) -> dict[str, Any]:
    if name == "respawn":
        new = job.wait_for(
            lambda: [s for s in read_starts(out) if s["incarnation"] == "1"], what="respawn"
        )[0]
        job.wait_for(lambda: progress.first_after(VICTIM, new["time"]), what="respawned step")
        survivors = [r for r in range(WORLD) if r != VICTIM]
        return {
            "survivors_next_step_s": _back(progress, out, t_kill, survivors),
            "respawned_started_s": new["time"] - t_kill,
            "respawned_back_s": _back(progress, out, t_kill, [VICTIM]),
        }

    def restarted() -> list[int]:  # ranks with a process started after the kill
        return sorted({s["rank"] for s in read_starts(out) if s["time"] > t_kill})

    job.wait_for(lambda: restarted() == list(range(WORLD)), what="restarted workers")
    job.wait_for(
        lambda: all(
            progress.first_after(r, max(s["time"] for s in read_starts(out) if s["rank"] == r))
            for r in range(WORLD)
        ),
        what="steps after the restart",
    )
    return {"all_back_s": _back(progress, out, t_kill, range(WORLD))}


SCENARIOS = [
    ("respawn", "trainguard.launch", []),
    ("escalation", "trainguard.launch", ["--tg-respawns=0", "--max-restarts=1"]),
    ("torchrun", "torch.distributed.run", ["--max-restarts=1"]),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    raw: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in SCENARIOS}
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-launch-"))
    try:
        for repeat in range(args.repeats):
            for name, module, extra in SCENARIOS:
                raw[name].append(scenario(tmp / f"{repeat}", name, module, extra))
                print(f"repeat {repeat} {name}: {raw[name][-1]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def stat(name: str, key: str) -> dict[str, float]:
        return summarize([r[key] for r in raw[name]])

    rows: list[tuple[str, dict[str, float] | None, dict[str, float]]] = [
        ("worker SIGKILL -> survivors' next step", stat("torchrun", "all_back_s"),
         stat("respawn", "survivors_next_step_s")),
        ("worker SIGKILL -> respawned process started", None,
         stat("respawn", "respawned_started_s")),
        ("worker SIGKILL -> respawned worker's first step", stat("torchrun", "all_back_s"),
         stat("respawn", "respawned_back_s")),
        ("whole-job restart -> every worker stepping", stat("torchrun", "all_back_s"),
         stat("escalation", "all_back_s")),
    ]  # fmt: skip
    table = [[label, _ms(t), _ms(g)] for label, t, g in rows]
    table.append(
        [
            "helper processes per node",
            f"{stat('torchrun', 'helpers_per_node')['max']:g}",
            f"{stat('respawn', 'helpers_per_node')['max']:g}",
        ]
    )
    table.append(
        [
            "survivor processes restarted",
            f"{stat('torchrun', 'survivors_restarted')['max']:g}",
            f"{stat('respawn', 'survivors_restarted')['max']:g}",
        ]
    )
    print_table(
        f"launcher, {NODES} nodes x {NPROC} plain-Python workers, {args.repeats} repeats "
        "(ms, p50 / max)",
        ["measure", "torchrun --max-restarts=1", "trainguard launch"],
        table,
    )
    summary = {f"{n}.{k}": stat(n, k) for n in raw for k in (raw[n][0] if raw[n] else {})}
    write_results(
        "launch",
        {"nodes": NODES, "nproc_per_node": NPROC, "step_s": STEP, "summary": summary, "raw": raw},
    )
    return 0


def _ms(s: dict[str, float] | None) -> str:
    if s is None:
        return "-"
    return f"{s['p50'] * 1e3:.0f} / {s['max'] * 1e3:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
