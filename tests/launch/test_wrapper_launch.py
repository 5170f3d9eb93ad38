"""End to end: in-process restart (the Wrapper, gloo) under ``trainguard launch``.

The agent respawns a killed worker alone; its sidecar service writes the death notice, so the
survivors restart in-process at once; the respawned process joins the running job at a round
boundary. No process but the agent watches the workers (no sidecar processes).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.launch._agents import Agents, leftovers, read_starts
from trainguard import events

pytestmark = pytest.mark.timeout(120)


def _steps(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _job(
    tmp_path: Path, nproc: int, active: int, steps: int, *more: str
) -> tuple[Agents, Path, Path]:
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    worker = ["wrapper", str(out), f"--active={active}", f"--steps={steps}", "--step=0.1", *more]
    job = Agents(
        tmp_path,
        nodes=1,
        nproc=nproc,
        worker=worker,
        extra=["--max-restarts=1"],
        env={"TRAINGUARD_EVENTS_DIR": str(ev)},
        timeout=110,
    )
    return job, out, ev


def _running(job: Agents, out: Path) -> None:
    """Until two active ranks made 3 steps of round 0."""
    job.wait_for(
        lambda: sum(1 for s in _steps(out) if s["round"] == 0 and s["step"] >= 3) >= 2,
        timeout=60,
        what="round 0 steps on both active ranks",
    )


def _joining(ev: Path) -> bool:
    return ev.exists() and any(e["kind"] == "join_wait" for e in events.read_events(ev))


def _sidecar_processes(run_id: str) -> list[int]:
    found = []
    for pid in leftovers(run_id):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"trainguard.restart.sidecar" in cmdline:
            found.append(pid)
    return found


def test_a_killed_active_worker_is_replaced_by_the_spare_and_rejoins(tmp_path: Path) -> None:
    job, out, ev = _job(tmp_path, nproc=3, active=2, steps=30)
    with job:
        _running(job, out)
        assert _sidecar_processes(job.run_id) == []  # the agent watches its workers itself
        pids = {s["rank"]: s["pid"] for s in read_starts(out)}
        victim = next(s["initial"] for s in _steps(out) if s["round"] == 0 and s["initial"] != 0)
        (out / "hold").touch()  # the job goes on until the respawn is waiting to join
        killed = time.time()
        os.kill(pids[victim], signal.SIGKILL)
        back = job.wait_for(
            lambda: [s for s in _steps(out) if s["round"] >= 1 and s["pid"] != pids[victim]],
            timeout=30,
            what="a round after the kill",
        )
        recovered = min(s["time"] for s in back) - killed
        assert recovered < 8.0, f"survivors took {recovered:.2f} s (soft_timeout is 10 s)"
        assert {s["world"] for s in back} == {2}
        job.wait_for(lambda: _joining(ev), timeout=60, what="the respawn waiting to join")
        (out / "hold").unlink()
        assert job.wait() == [0], job.output()
        assert leftovers(job.run_id) == []
    starts = read_starts(out)
    again = [s for s in starts if s["incarnation"] == "1"]
    assert [s["rank"] for s in again] == [victim]
    for s in starts:  # the survivors kept their processes
        if s["rank"] != victim:
            assert s["pid"] == pids[s["rank"]]
    # the world is at its size (2 active): the respawn waits as a would-be spare for the next
    # round boundary, never forcing one; the job ending ends its wait
    waits = [e for e in events.read_events(ev) if e["kind"] == "join_wait"]
    assert waits and {(e["rank"], e["admit"]) for e in waits} == {(victim, False)}, waits
    results = {p.name: p.read_text() for p in out.glob("result-*")}
    assert sorted(results.values()) == ["2", "2", "spare"], results


@pytest.mark.parametrize("victim", [0, 1])
def test_without_a_spare_the_survivors_wait_for_the_respawned_worker(
    tmp_path: Path, victim: int
) -> None:
    """Rank 0 too: its store process (the rounds' stores) outlives it, although the agent
    kills the dead worker's process group before the respawn."""
    job, out, ev = _job(tmp_path, nproc=2, active=2, steps=30)
    with job:
        _running(job, out)
        pids = {s["rank"]: s["pid"] for s in read_starts(out)}
        os.kill(pids[victim], signal.SIGKILL)
        back = job.wait_for(
            lambda: [s for s in _steps(out) if s["round"] >= 1], timeout=40, what="round 1"
        )
        assert {s["world"] for s in back} == {2}  # the world is back to its full size
        assert job.wait() == [0], job.output()
        assert leftovers(job.run_id) == []
    steps = _steps(out)
    last = max(s["round"] for s in steps)
    final = {s["initial"]: s["pid"] for s in steps if s["round"] == last}
    survivor = 1 - victim
    assert final[survivor] == pids[survivor] and final[victim] != pids[victim]
    assert sorted(s["step"] for s in steps if s["round"] == last)[-2:] == [29, 29]
    kinds = [e["kind"] for e in events.read_events(ev)]
    assert kinds.index("launch_worker_died") < kinds.index("launch_respawned")
    assert "launch_admitted" in kinds


def test_a_job_the_wrapper_cannot_recover_restarts_whole_in_a_new_generation(
    tmp_path: Path,
) -> None:
    """Generation 0 fails the same way every round: the Wrapper gives up (RetryLimitError) and
    asks the launcher for a whole-job restart; generation 1 completes."""
    job, out, ev = _job(tmp_path, 2, 2, 5, "--raise-gen=0")
    with job:
        assert job.wait() == [0], job.output()
        assert leftovers(job.run_id) == []
    starts = read_starts(out)
    assert sorted((s["generation"], s["rank"]) for s in starts) == [
        ("0", 0),
        ("0", 1),
        ("1", 0),
        ("1", 1),
    ]
    steps = _steps(out)
    assert steps and {s["world"] for s in steps} == {2}
    assert len([s for s in steps if s["step"] == 4]) == 2  # generation 1 ran to the end
    escalated = [e for e in events.read_events(ev) if e["kind"] == "launch_escalated"]
    assert escalated and "RetryLimitError" in escalated[0]["reason"], escalated


def test_a_worker_hung_holding_the_gil_is_killed_by_its_agent(tmp_path: Path) -> None:
    """No Python thread of that worker runs: its agent kills it at hard_timeout, respawns it,
    and the others go on with the spare."""
    job, out, ev = _job(tmp_path, 3, 2, 40, "--gil-hang-rank=1", "--hard-timeout=4")
    with job:
        pids = job.wait_for(lambda: len(read_starts(out)) >= 3 and read_starts(out), what="starts")
        hung = next(s["pid"] for s in pids if s["rank"] == 1)
        assert job.wait() == [0], job.output()
        assert leftovers(job.run_id) == []
    died = [e for e in events.read_events(ev) if e["kind"] == "launch_worker_died"]
    assert [(e["slot"], e["worker_pid"]) for e in died] == [(1, hung)], died
    kills = [e for e in events.read_events(ev) if e["kind"] == "hard_timeout"]
    assert [e["killed_rank"] for e in kills] == [1], kills  # by the agent's service
    steps = _steps(out)
    assert {s["world"] for s in steps if s["round"] >= 1} == {2}
    assert 2 in {s["initial"] for s in steps if s["round"] >= 1}  # the spare moved in
