"""Launcher: ``trainguard launch`` side by side with ``torchrun``, the same jobs, one run.

Run: ``.venv/bin/python bench/launch.py [--repeats 3]`` (~4-6 min with 3 repeats on a shared
2-core machine). Prints two tables (p50 / max over the repeats, ms) and writes
bench/results/launch.json. Times are wall-clock: a worker's ``time.time()`` at a step or start
minus the bench's ``time.time()`` just before the fault; every launcher runs its agents with
``--monitor-interval=0.05`` and c10d rendezvous on loopback (tests/launch/_agents.py).

Plain-Python workers (tests/launch/_workers.py ``run``: no torch import, so the numbers are
the launchers' own cost): 2 "nodes" (agents) x 2 workers counting steps every 50 ms; per repeat
and launcher, rank 3 is SIGKILLed once the job runs and the progress files are polled:

- respawn (trainguard launch, default options): kill -> the survivors' next step (they never
  stop), kill -> the respawned process starts, kill -> its first step (the world is back);
- escalation (trainguard launch ``--tg-respawns=0 --max-restarts=1``): kill -> every worker of
  the new generation made a step;
- torchrun ``--max-restarts=1``: kill -> every worker of the restarted attempt made a step;
- helper processes per node: processes of the job that are not workers, divided by the nodes.

Wrapper job (``_workers.py wrapper``: gloo, :class:`trainguard.restart.Wrapper` with
``FillGaps`` + ``MaxActiveWorldSize(active)``, a step every 20 ms; rows in
bench/_launch_wrapper.py); "training again" = the first step (an all_reduce done) of the next
restart round on every active rank:

1. worker SIGKILL -> every survivor training again, with an idle spare (1 node x 3 workers, 2
   active; the survivor and the spare step in the next round). torchrun ``--max-restarts=1``,
   same job: it stops everyone and restarts; kill -> both active ranks of the new processes
   stepping.
2. worker SIGKILL -> respawned worker admitted, no spare (1 node x 2 workers, 2 active): kill ->
   the respawned process's start record; -> its start-up done (torch and trainguard imported,
   ``OUT/ready.jsonl``); -> the first step of the first round of world size 2 that includes it.
   Target: at most 1 s after its start-up.
3. node lost (2 nodes x 2 workers, all 4 active so that the lost node holds active ranks;
   ``--tg-heartbeat-interval 0.2 --tg-heartbeat-timeout 2``): node 1's agent process group and
   its workers' (each in a session of its own) SIGKILLed -> the survivors' ``launch_node_lost``
   event, and -> ranks 0 and 1 training again in a world of 2. Target: heartbeat timeout + 300 ms.
4. whole-job restart (1 node x 3 workers, 2 active; generation 0 raises in every round, the
   Wrapper gives up and asks the launcher to restart the job): the ``launch_escalated`` event
   -> generation 1's processes started, -> both active ranks stepping. Compared with torchrun's
   restart of row 1 (from the SIGKILL).
5. helper processes per node with the Wrapper job (1 x 3), by kind from their command lines:
   agent, node watcher (``trainguard.restart.sidecar``; none under the agent), the Wrapper's
   store process (one per job, started by rank 0, ``trainguard.coord._server``).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.launch._agents import Agents, leftovers, read_starts

from bench import _launch_wrapper
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


def scenario(tmp: Path, *, name: str, module: str, extra: list[str]) -> dict[str, Any]:
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
WRAPPER: dict[str, Callable[[Path], dict[str, Any]]] = {
    "w_spare": _launch_wrapper.spare,
    "w_torchrun": _launch_wrapper.torchrun,
    "w_respawn": _launch_wrapper.respawn,
    "w_node": _launch_wrapper.node,
    "w_escalation": _launch_wrapper.escalation,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    started = time.monotonic()
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in SCENARIOS}
    raw.update({name: [] for name in WRAPPER})
    failed: dict[str, list[str]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-launch-"))
    jobs: list[tuple[str, Callable[[Path], dict[str, Any]]]] = [
        (name, functools.partial(scenario, name=name, module=module, extra=extra))
        for name, module, extra in SCENARIOS
    ]
    jobs += list(WRAPPER.items())
    for repeat in range(args.repeats):
        for name, run in jobs:
            try:
                raw[name].append(run(tmp / f"{repeat}"))
            except (AssertionError, RuntimeError, ValueError) as e:  # one failed run, go on
                why = str(e).splitlines()[0]
                failed.setdefault(name, []).append(why)
                print(f"repeat {repeat} {name}: FAILED ({why}); files in {tmp}", flush=True)
                continue
            print(f"repeat {repeat} {name}: {raw[name][-1]}", flush=True)
    if not failed:
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started

    def stat(name: str, key: str) -> dict[str, float]:
        return summarize([r[key] for r in raw[name]])

    _plain_table(stat, args.repeats)
    _wrapper_table(raw, stat, args.repeats)
    for name, whys in failed.items():
        print(f"FAILED runs of {name} (left out of the table): {len(whys)}: {whys}")
    print(
        f"\n{os.cpu_count()} CPUs shared with other jobs (load average {load:.2f} at the start); "
        f"the whole bench took {elapsed:.0f} s. Command: "
        f"python bench/launch.py --repeats {args.repeats}"
    )
    summary = {
        f"{n}.{k}": stat(n, k)
        for n in raw
        for k, v in (raw[n][0] if raw[n] else {}).items()
        if isinstance(v, (int, float))
    }
    write_results(
        "launch",
        {
            "command": f"python bench/launch.py --repeats {args.repeats}",
            "load_average_at_start": load,
            "elapsed_s": elapsed,
            "plain": {"nodes": NODES, "nproc_per_node": NPROC, "step_s": STEP},
            "wrapper": {
                "step_s": _launch_wrapper.STEP,
                "heartbeat_interval_s": _launch_wrapper.HEARTBEAT_INTERVAL,
                "heartbeat_timeout_s": _launch_wrapper.HEARTBEAT_TIMEOUT,
            },
            "summary": summary,
            "failed": failed,
            "raw": raw,
        },
    )
    return 0


Stat = Callable[[str, str], dict[str, float]]


def _plain_table(stat: Stat, repeats: int) -> None:
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
        f"launcher, {NODES} nodes x {NPROC} plain-Python workers, {repeats} repeats "
        "(ms, p50 / max)",
        ["measure", "torchrun --max-restarts=1", "trainguard launch"],
        table,
    )


def _wrapper_table(raw: dict[str, list[dict[str, Any]]], stat: Stat, repeats: int) -> None:
    w = _launch_wrapper
    timeout_ms = w.HEARTBEAT_TIMEOUT * 1e3
    respawn = raw["w_respawn"]
    margin = summarize([r["admitted_s"] - r["respawn_ready_s"] for r in respawn])
    rows: list[tuple[str, dict[str, float] | None, dict[str, float], str]] = [
        ("worker SIGKILL -> every survivor training again (1x3, spare)",
         stat("w_torchrun", "all_back_s"), stat("w_spare", "survivors_back_s"), "<= 300"),
        ("worker SIGKILL -> respawned process started (1x2, no spare)", None,
         stat("w_respawn", "respawn_started_s"), "-"),
        ("worker SIGKILL -> respawned process's start-up done (imports)", None,
         stat("w_respawn", "respawn_ready_s"), "-"),
        ("worker SIGKILL -> world back to 2 with the respawned worker", None,
         stat("w_respawn", "admitted_s"), "<= start-up + 1000"),
        ("  the same, from the respawned process's start-up done", None, margin, "<= 1000"),
        ("node lost -> its loss detected (2x2, 4 active)", None,
         stat("w_node", "detected_s"), f"heartbeat timeout {timeout_ms:.0f}"),
        ("node lost -> survivors training again (2x2, 4 active)", None,
         stat("w_node", "survivors_back_s"), f"<= {timeout_ms + 300:.0f}"),
        ("whole-job restart -> new processes started (1x3)", stat("w_torchrun", "started_s"),
         stat("w_escalation", "started_s"), "-"),
        ("whole-job restart -> training again (1x3)", stat("w_torchrun", "all_back_s"),
         stat("w_escalation", "all_back_s"), "<= torchrun's"),
    ]  # fmt: skip
    table = [[label, _ms(t), _ms(g), target] for label, t, g, target in rows]
    table.append(
        [
            "helper processes per node (1x3)",
            _kinds(raw["w_torchrun"]),
            _kinds(raw["w_spare"]),
            "1 agent",
        ]
    )
    print_table(
        f"launcher, Wrapper job (gloo, in-process restart, FillGaps + MaxActiveWorldSize), "
        f"{repeats} repeats (ms, p50 / max)",
        ["measure", "torchrun --max-restarts=1", "trainguard launch", "target"],
        table,
    )


def _kinds(runs: list[dict[str, Any]]) -> str:
    """The most helper processes per node of each kind over the runs, e.g. "1 agent + 1 store"."""
    most: dict[str, float] = {}
    for run in runs:
        for kind, n in run["helpers"].items():
            most[kind] = max(most.get(kind, 0.0), n)
    return " + ".join(
        f"{most[k]:g} {k}" for k in ("agent", "sidecar", "store", "other") if k in most
    )


def _ms(s: dict[str, float] | None) -> str:
    if s is None:
        return "-"
    if not s["n"]:
        return "failed"
    return f"{s['p50'] * 1e3:.0f} / {s['max'] * 1e3:.0f}"


if __name__ == "__main__":
    raise SystemExit(main())
