"""What the framework tests share: the fault plan, the two runs of a job, the assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy

from tests._dist import RankResult

WORKER = str(Path(__file__).resolve().parent / "_launched_trainer.py")
STEPS = 16  # 4 epochs of 4 steps: 16 samples, batch 2 per rank, 2 ranks
EVERY = 4  # a local checkpoint per epoch
RAISE_AT = (0, 0, 6)  # (round, process, step): resume from step 4
KILL_AT = (1, 1, 10)  # resume from step 8, the spare (process 2) takes rank 1
TIMEOUTS: dict[str, Any] = {
    "barrier_timeout": 90,
    "completion_timeout": 90,
    "soft_timeout": 60.0,
    "hard_timeout": 90.0,
    "termination_grace_time": 1.0,
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 30.0,
    "max_rounds": 4,
}


class JobBase:
    """The wrapped function of a framework test, with this process's memory across rounds:
    subclasses define ``__call__(call)`` and append one dict per round to ``rounds``."""

    def __init__(self, out: Path, faults: bool) -> None:
        self.out = out
        self.faults = faults
        self.rounds: list[dict[str, Any]] = []


def run_both(make_job: Callable[[Path, bool], Any], out: str, ports: tuple[int, int]) -> Any:
    """One process: the reference run, then the run with faults, of the job ``make_job`` builds
    (each under a Wrapper of its own, on a store port of its own); results, rounds, threads."""
    import trainguard.restart as tr
    from trainguard.integrations._round import release_round

    os.environ["TG_PROCESS"] = os.environ["RANK"]
    results: dict[str, Any] = {}
    for (name, faults), port in zip((("reference", False), ("faulty", True)), ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        path = Path(out) / name
        path.mkdir(exist_ok=True)
        job = make_job(path, faults)
        options = {**TIMEOUTS, "finalize": release_round}
        options.update(rank_filter=tr.MaxActiveWorldSize(2), rank_assignment=tr.FillGaps())
        final = tr.Wrapper(**options)(job)()
        release_round(strict=True)
        results[name] = {"final": final, "rounds": job.rounds}
    results["threads"] = [t.name for t in threading.enumerate()]
    return results


def check_fault_run(
    results: list[RankResult], out: Path, steps: int, resumed: tuple[int, int] = (4, 8)
) -> dict[str, Any]:
    """The run with faults went as planned, and ended with the reference's weights.

    Process 0 raised at step 6 of round 0 (round 1 resumed from ``resumed[0]``: step 4 from a
    local checkpoint, 6 from live state), process 1 was SIGKILLed at step 10 of round 1, and
    the spare (process 2) took rank 1 in round 2, which resumed from ``resumed[1]`` (8, or 10
    from live state) and ended at ``steps``. Returns process 0's values."""
    after_raise, after_kill = resumed
    assert (out / "faulty" / "killed").exists(), "the victim was not killed"
    assert results[1].exitcode == -9, results[1]
    values = {r.rank: r.get() for r in results if r.rank != 1}
    first, spare = values[0], values[2]
    rounds = [(r["round"], r["rank"], r["resumed"]) for r in first["faulty"]["rounds"]]
    want = [(0, 0, None), (1, 0, after_raise), (2, 0, after_kill)]
    assert rounds == want, first["faulty"]["rounds"]
    assert first["faulty"]["rounds"][-1]["step"] == steps
    spare_rounds = [(r["round"], r["rank"], r["resumed"]) for r in spare["faulty"]["rounds"]]
    assert spare_rounds == [(2, 1, after_kill)], spare["faulty"]["rounds"]
    assert spare["reference"]["rounds"] == []  # a spare that never trained
    assert [r["step"] for r in first["reference"]["rounds"]] == [steps]
    for final in (first["faulty"]["final"], spare["faulty"]["final"]):
        assert sorted(final) == sorted(first["reference"]["final"])
        for key, value in first["reference"]["final"].items():
            assert numpy.array_equal(final[key], value), f"{key} differs from the reference"
    for value in values.values():
        assert not [t for t in value["threads"] if t != "MainThread"], value["threads"]
    return first


def launch_job(out: Path, faults: bool, job: str) -> dict[int, list[dict[str, Any]]]:
    """Run the ``job`` ("transformers" or "lightning") of ``_launched_trainer.py`` under
    ``trainguard launch`` (3 workers); every process's records, by process."""
    from tests.launch._agents import ROOT, kill_all, leftovers

    out.mkdir()
    run_id = f"tgtest-{uuid.uuid4().hex[:12]}"
    env = dict(os.environ, TG_TEST_RUN=run_id, TRAINGUARD_EVENTS_DIR=str(out / "events"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "trainguard.launch", "--standalone", "--nproc-per-node=3"]
    cmd += ["--max-restarts=1", "--monitor-interval=0.05", WORKER, str(out), str(int(faults)), job]
    try:
        done = subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=200, check=False
        )
    finally:
        killed = kill_all(run_id)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    assert not killed and leftovers(run_id) == []
    records: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("result-*.json")):
        record = json.loads(path.read_text())
        records.setdefault(record["process"], []).append(record)
    return records
