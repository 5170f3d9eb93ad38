"""Faults on emulated hosts: how long until the survivors train again, and until the job is whole.

3 hosts (network namespaces on a bridge, see ``tests/cluster/_hosts.py``; needs root) x 2
workers. trainguard: ``trainguard launch`` with the Wrapper (``FillGaps`` +
``MaxActiveWorldSize(4)``: 2 spares), node heartbeat every 0.5 s, timeout 3 s. Baseline, in the
same run: ``torchrun --nnodes=2:3 --max-restarts=3`` with the same rendezvous settings and plain
gloo workers (what a torchrun job does on a fault: every worker restarts).

Measured per scenario (wall clock, from the fault to the first step a worker logs):

- ``host death``: every process of h2 SIGKILLed; to the survivors' first step of a new round
  (trainguard) or a new restart (torchrun);
- ``partition``: h2's link down for ``--cut`` seconds; to the survivors' first step without it
  (torchrun: its workers hang in a collective until gloo's timeout; measured up to
  ``--limit`` seconds);
- ``heal``: after the partition; to h2's workers started again and imported (trainguard: they
  rejoin as newcomers; the job has all 6 workers again).

Prints a table and writes ``bench/results/multihost.json``.

    sudo .venv/bin/python bench/multihost.py [--repeats 1] [--cut 12] [--limit 60]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster._hosts import Cluster, leftovers, unavailable  # noqa: E402
from tests.cluster._job import HostJob, records  # noqa: E402

HB = ["--tg-heartbeat-interval=0.5", "--tg-heartbeat-timeout=3", "--tg-exit-barrier-timeout=20"]


def _first_step_after(out: Path, t: float, *, newer_round: int) -> float | None:
    times = [
        s["time"]
        for s in records(out / "steps.jsonl")
        if s["time"] >= t and s["round"] >= newer_round
    ]
    return min(times) if times else None


def _wait(cond: Any, limit: float) -> Any:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    return None


def _job(c: Cluster, tmp: Path, kind: str) -> tuple[HostJob, Path]:
    out = tmp / "out"
    out.mkdir()
    if kind == "trainguard":
        worker = ["wrapper", str(out), "--active=4", "--steps=100000", "--step=0.1"]
        job = HostJob(c, tmp, nproc=2, worker=worker, extra=[*HB, "--max-restarts=0"], timeout=600)
    else:
        worker = ["gloo", str(out), "--steps=100000", "--step=0.1", "--log-steps"]
        job = HostJob(
            c,
            tmp,
            nproc=2,
            worker=worker,
            extra=["--max-restarts=3"],
            module="torch.distributed.run",
            nodes="2:3",
            timeout=600,
            # torch's shared agent store hangs a gloo job's restart (stale keys of the old
            # attempt); its own opt-out gives torchrun its best case
            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        )
    return job, out


def _running(out: Path) -> bool:
    return len({s["rank"] for s in records(out / "steps.jsonl") if s["step"] >= 3}) >= 4


def _started(c: Cluster, tmp: Path, kind: str) -> tuple[HostJob, Path, int]:
    """The job running on every rank; its newest round (restart count under torchrun)."""
    job, out = _job(c, tmp, kind)
    job.start()
    if not _wait(lambda: _running(out), 120):
        raise RuntimeError(f"{kind} did not start\n{job.output()}")
    return job, out, max(s["round"] for s in records(out / "steps.jsonl"))


def host_death(kind: str, limit: float) -> dict[str, Any]:
    with TemporaryDirectory() as d, Cluster(Path(d), 3) as c:
        job, out, rounds = _started(c, Path(d), kind)
        t = time.time()
        c.kill_host(c.hosts[1])
        got = _wait(lambda: _first_step_after(out, t, newer_round=rounds + 1), limit)
        if got is None:
            print(f"{kind}: no step after the host death within {limit:g} s\n{job.output(15)}")
        return {"training_again_s": None if got is None else got - t}


def partition(kind: str, cut: float, limit: float) -> dict[str, Any]:
    with TemporaryDirectory() as d, Cluster(Path(d), 3) as c:
        job, out, rounds = _started(c, Path(d), kind)
        t = time.time()
        c.cut(c.hosts[1])
        got = _wait(lambda: _first_step_after(out, t, newer_round=rounds + 1), max(cut, limit) - 1)
        time.sleep(max(0.0, cut - (time.time() - t)))
        c.heal(c.hosts[1])
        healed = time.time()
        row: dict[str, Any] = {"training_again_s": None if got is None else got - t}
        if kind == "trainguard":

            def back() -> list[float] | None:
                ready = sorted(
                    r["time"] for r in records(out / "ready.jsonl") if r["time"] > healed
                )
                return ready if len(ready) >= 2 else None

            ready = _wait(back, limit)
            if ready is None:
                print(f"{kind}: h2's workers not back within {limit:g} s\n{job.output(25)}")
            row["heal_to_workers_back_s"] = None if ready is None else ready[1] - healed
        return row


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cut", type=float, default=12.0, help="seconds of partition")
    parser.add_argument("--limit", type=float, default=60.0, help="longest wait per phase")
    parser.add_argument("--systems", nargs="+", default=["trainguard", "torchrun"])
    parser.add_argument("--scenarios", nargs="+", default=["host death", "partition"])
    args = parser.parse_args()
    if (why := unavailable()) is not None:
        print(f"skipped: {why}")
        return 0
    rows: dict[str, dict[str, list[float | None]]] = {}
    for _ in range(args.repeats):
        for kind in args.systems:
            for name, fn in (
                ("host death", lambda k=kind: host_death(k, args.limit)),
                ("partition", lambda k=kind: partition(k, args.cut, args.limit)),
            ):
                if name not in args.scenarios:
                    continue
                result = fn()
                for key, value in result.items():
                    rows.setdefault(f"{kind} | {name} | {key}", {}).setdefault("v", []).append(
                        value
                    )
    table = {k: _median(v["v"]) for k, v in rows.items()}
    print(f"{'system | scenario | measure':<62} {'median s':>9}")
    for key, value in table.items():
        shown = "-" if value is None else f"{value:.2f}"
        if value is None and "torchrun | partition" in key:
            shown = f">{args.limit:g}"
        print(f"{key:<62} {shown:>9}")
    result = {
        "bench": "multihost",
        "hosts": 3,
        "workers_per_host": 2,
        "heartbeat_timeout_s": 3,
        "cut_s": args.cut,
        "limit_s": args.limit,
        "repeats": args.repeats,
        "machine": platform.platform(),
        "results": rows,
        "median": table,
    }
    path = ROOT / "bench" / "results" / "multihost.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    assert not leftovers(), leftovers()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
