"""A bad node on emulated hosts: what quarantine saves, and kill -> training again three ways.

3 hosts (network namespaces, ``tests/cluster/_hosts.py``; needs root) x 2 workers under
``trainguard launch``, the Wrapper with ``FillGaps`` + ``MaxActiveWorldSize(4)`` (2 spares, on
h3), gloo, the job of ``bench/_bad_node_job.py`` (a checkpoint every ``--ckpt`` steps, each
round resumes from it). Side by side, in one run:

- **bad node**: h2's active workers raise after ``--every`` steps of each round they are
  active in; ``--steps`` steps in all. Without quarantine (h2 stays in: a fault every round)
  and with ``--tg-quarantine-after 2 --tg-readmit never``. Faults suffered (rounds after the
  first), time lost (wall time from the first step to the last, minus the steps done once at
  the job's median step time), steps recomputed (steps run again after a fault), and, with
  quarantine, the time from the second fault (h2's last step) to the job training without h2
  (every active rank's first step in the round after).
- **kill**: active initial rank 2 (on h2) SIGKILLed; to training again (every active rank's
  first step at full size in a round after the kill; bench/warm_worker.py's measure): with an
  idle spare (active 4), a warm worker (active 6, ``--tg-warm-workers 1``) and a cold respawn
  (active 6).

Prints a table and writes ``bench/results/bad_node.json``.

    flock /tmp/tg-hosts.lock .venv/bin/python bench/bad_node.py [--steps 600] [--every 30]
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster._hosts import Cluster, Host, leftovers, unavailable  # noqa: E402
from tests.cluster._job import WORKER, HostJob, records  # noqa: E402

from bench._common import print_table, summarize, write_results  # noqa: E402
from trainguard.events import read_events  # noqa: E402

HB = ["--tg-heartbeat-interval=0.5", "--tg-heartbeat-timeout=5", "--tg-exit-barrier-timeout=20"]
JOB = str(ROOT / "bench" / "_bad_node_job.py")


class _Job(HostJob):
    """HostJob with bench/_bad_node_job.py as the workers' script."""

    def command(self, host: Host) -> list[str]:
        cmd = super().command(host)
        cmd[cmd.index(WORKER)] = JOB
        return cmd


def _job(c: Cluster, tmp: Path, worker: Sequence[str], extra: Sequence[str]) -> tuple[_Job, Path]:
    out = tmp / "out"
    out.mkdir()
    env = {"TRAINGUARD_EVENTS_DIR": str(tmp / "events"), "TRAINGUARD_HOST_NAME": "-"}
    flags = [*HB, "--max-restarts=0", *extra]
    job = _Job(c, tmp, nproc=2, worker=[str(out), *worker], extra=flags, env=env, timeout=900)
    return job, out


def bad_node(quarantine: bool, args: argparse.Namespace) -> dict[str, Any]:
    with TemporaryDirectory() as d, Cluster(Path(d), 3) as c:
        tmp = Path(d)
        extra = ["--tg-quarantine-after=2", "--tg-readmit=never"] if quarantine else []
        worker = [f"--steps={args.steps}", f"--step={args.step}", f"--every={args.every}"]
        job, out = _job(c, tmp, [*worker, f"--ckpt={args.ckpt}", "--active=4"], extra)
        job.start()
        codes = job.wait(timeout=args.limit)
        if set(codes.values()) != {0}:
            raise RuntimeError(f"the job failed: {codes}\n{job.output(30)}")
        steps = records(out / "steps.jsonl")
        results = sorted(p.read_text() for p in out.glob("result-*"))
        events = read_events(tmp / "events")
    lead = sorted((s for s in steps if s["rank"] == 0), key=lambda s: s["time"])
    unique = len({s["step"] for s in lead})
    pairs = itertools.pairwise(lead)
    gaps = [b["time"] - a["time"] for a, b in pairs if a["round"] == b["round"]]
    wall = lead[-1]["time"] - lead[0]["time"]
    row: dict[str, Any] = {
        "faults": max(s["round"] for s in steps),
        "wall_s": wall,
        "time_lost_s": wall - unique * statistics.median(gaps),
        "steps_recomputed": len(lead) - unique,
        "results": results,
        "quarantined": [e["quarantined_host"] for e in events if e["kind"] == "host_quarantined"],
        "blamed": [
            [e["fault_host"], e["fault_rank"], e["cause"]]
            for e in events
            if e["kind"] == "fault_attributed"
        ],
        "h2_steps_after_quarantine": None,
        "second_fault_to_without_h2_s": None,
    }
    if quarantine:
        bad = [s for s in steps if s["host"] == "h2"]
        second = max(s["time"] for s in bad if s["round"] == 1)
        after = [s for s in steps if s["round"] == 2]
        first = {}
        for s in sorted(after, key=lambda s: s["time"]):
            first.setdefault(s["rank"], s["time"])
        row["second_fault_to_without_h2_s"] = max(first.values()) - second
        row["h2_steps_after_quarantine"] = len([s for s in bad if s["round"] >= 2])
    return row


KILLS: dict[str, tuple[int, list[str]]] = {
    "idle spare": (4, []),
    "warm worker": (6, ["--tg-warm-workers=1"]),
    "cold respawn": (6, []),
}


def _wait(cond: Any, limit: float, what: str, job: HostJob) -> Any:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}\n{job.output(30)}")


def kill(name: str, args: argparse.Namespace) -> dict[str, Any]:
    active, extra = KILLS[name]
    with TemporaryDirectory() as d, Cluster(Path(d), 3) as c:
        tmp = Path(d)
        worker = ["--steps=0", f"--step={args.step}", "--every=0", f"--active={active}"]
        job, out = _job(c, tmp, worker, extra)
        (out / "hold").touch()
        job.start()

        def stepping() -> bool:
            got = {s["rank"] for s in records(out / "steps.jsonl") if s["step"] >= 5}
            return len(got) >= active

        _wait(stepping, 180, "the job training", job)
        if name == "warm worker":
            _wait(
                lambda: [
                    e
                    for e in read_events(tmp / "events")
                    if e["kind"] == "launch_warm_ready" and e["host"] == "h2"
                ],
                120,
                "h2's warm worker ready",
                job,
            )
        before = max(s["round"] for s in records(out / "steps.jsonl"))
        (victim,) = {s["pid"] for s in records(out / "starts.jsonl") if s["rank"] == 2}
        t_kill = time.time()
        os.kill(int(victim), signal.SIGKILL)

        def again() -> dict[int, float] | None:
            first: dict[int, float] = {}
            for s in records(out / "steps.jsonl"):
                if s["round"] > before and s["world"] == active and s["time"] > t_kill:
                    first.setdefault(s["rank"], s["time"])
            return first if len(first) == active else None

        first = _wait(again, 120, "training again", job)
        (out / "hold").unlink()
        job.wait(timeout=120)
        respawned = [e for e in read_events(tmp / "events") if e["kind"] == "launch_respawned"]
    return {
        "training_again_s": max(first.values()) - t_kill,
        "respawn_warm": [bool(e.get("warm")) for e in respawned],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--ckpt", type=int, default=20)
    parser.add_argument("--step", type=float, default=0.02, help="sleep per step (s)")
    parser.add_argument("--limit", type=float, default=600.0, help="longest job (s)")
    parser.add_argument("--no-kills", action="store_true", help="only the bad-node rows")
    parser.add_argument("--kill-repeats", type=int, default=3, help="repeats of each kill path")
    args = parser.parse_args()
    if (why := unavailable()) is not None:
        print(f"skipped: {why}")
        return 0
    started = time.monotonic()
    rows = {
        label: bad_node(q, args) for label, q in (("no quarantine", False), ("quarantine", True))
    }
    for label, row in rows.items():
        print(f"  {label}: {row}", flush=True)
    kills: dict[str, list[dict[str, Any]]] = {name: [] for name in KILLS}
    for repeat in range(0 if args.no_kills else args.kill_repeats):
        for name in KILLS:  # interleaved: the same load for each path
            kills[name].append(kill(name, args))
            print(f"  kill {repeat}, {name}: {kills[name][-1]}", flush=True)
    again = {k: summarize([r["training_again_s"] for r in v]) for k, v in kills.items() if v}
    print_table(
        f"bad node (h2 raises after {args.every} steps of each round it is active in), "
        f"{args.steps} steps, 3 hosts x 2 workers, 4 active",
        ["run", "faults", "time lost s", "steps recomputed", "wall s", "2nd fault -> without h2 s"],
        [
            [k, r["faults"], r["time_lost_s"], r["steps_recomputed"], r["wall_s"],
             r["second_fault_to_without_h2_s"] or "-"]
            for k, r in rows.items()
        ],
    )  # fmt: skip
    if again:
        print_table(
            f"kill of an active worker on h2 -> training again (s, p50 / max of "
            f"{args.kill_repeats})",
            ["path", "training again s", "respawns warm"],
            [
                [k, f"{a['p50']:.2f} / {a['max']:.2f}", [r["respawn_warm"] for r in kills[k]]]
                for k, a in again.items()
            ],
        )
        ratio = again["warm worker"]["p50"] / again["idle spare"]["p50"]
        print(f"warm / idle spare (p50): {ratio:.2f} (issue target <= 2)")
    took = time.monotonic() - started
    print(f"\n{took:.0f} s in all")
    write_results(
        "bad_node",
        {"args": vars(args), "bad_node": rows, "kill": kills, "kill_stats": again, "seconds": took, "hosts": 3,
         "workers_per_host": 2, "active": 4},
    )  # fmt: skip
    assert not leftovers(), leftovers()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
