"""Save on preemption: SIGTERM to every process of a job -> its state durable, in seconds.

Two ranks of a :class:`trainguard.restart.Wrapper` job (``tests/_dist.py``: each rank leads
a process group with its store server, sidecar and checkpoint writer) hold ``--mib`` MiB of
state each. Once both made a plain ``AsyncCheckpointer`` save of that state (``save`` +
``wait``, timed: the baseline, same run, same state), every process of both groups gets
SIGTERM, as Slurm's ``scancel --signal=TERM`` delivers it. Measured: from the signal to the
moment the last rank's durable checkpoint of the agreed step was committed (``call.preempted``
-> save -> wait; the local checkpoint of the step is saved at the same time, its end is shown
too), and the part of it before the ranks agreed on the step. Baselines: the plain durable save
and a plain local save of the same state, both warm (each checkpointer saved once before).
Each row repeats this ``--repeats`` times (median shown, every run in the JSON).

Run: ``.venv/bin/python bench/preempt.py [--mib 64 256] [--repeats 3]``; writes
``bench/results/preempt.json``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._dist import RankGroup

from bench._common import print_table, write_results
from bench._preempt_job import job


def one(mib: int, tmp: Path) -> dict[str, Any]:
    out = tmp / f"run-{mib}-{time.monotonic_ns()}"
    out.mkdir()
    kwargs = {"mib": mib, "steps": 100_000, "plain_at": 3, "step_time": 0.05}
    with RankGroup(job, 2, args=(str(out),), kwargs=kwargs, timeout=600) as group:
        group.start()
        group.wait_until(lambda: all((out / f"ready-{r}").exists() for r in (0, 1)), timeout=300)
        time.sleep(0.3)
        sent = time.time()
        for rank in (0, 1):
            group.kill(rank, signal.SIGTERM, whole_group=True)
        results = group.join()
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1)]
    preempted = [r.exc_type for r in results]
    return {
        "mib": mib,
        "sigterm_to_durable_s": max(r["durable_at"] for r in ranks) - sent,
        "sigterm_to_agreed_s": max(r["stop_at"] for r in ranks) - sent,
        "sigterm_to_local_s": max(r["local_at"] for r in ranks) - sent,
        "plain_save_s": max(r["plain_s"] for r in ranks),
        "plain_local_save_s": max(r["plain_local_s"] for r in ranks),
        "stop_steps": sorted({r["stop_step"] for r in ranks}),
        "ended_with": preempted,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="tg-preempt-") as tmp:
        for mib in args.mib:
            found = [one(mib, Path(tmp)) for _ in range(args.repeats)]
            runs += found

            def med(key: str, found: list[dict[str, Any]] = found) -> float:
                return statistics.median(r[key] for r in found)

            durable, plain = med("sigterm_to_durable_s"), med("plain_save_s")
            agreed, local = med("sigterm_to_agreed_s"), med("sigterm_to_local_s")
            plain_local = med("plain_local_save_s")
            rows.append([mib, agreed, durable, plain, durable / plain, local, plain_local])
    print_table(
        "SIGTERM to every process -> state durable (2 ranks, median; the local checkpoint is "
        "saved at the same time)",
        [
            "MiB/rank",
            "->agreed s",
            "->durable s",
            "plain save s",
            "ratio",
            "->local s",
            "plain local s",
        ],
        rows,
    )
    write_results("preempt", {"rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
