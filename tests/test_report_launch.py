"""trainguard report on runs under ``trainguard launch``: the agents' events (negative ranks, no
round), launcher deaths as detections, whole-job restarts, admissions; a real launcher run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_report import PNG_SIGNATURE, _rows_add_up, ev, steps
from trainguard import report
from trainguard.events import EventLog

ROOT = Path(__file__).resolve().parent.parent


def agent(time: float, kind: str, node: int = 0, **fields: Any) -> dict:
    """An event of node ``node``'s agent: rank ``-1 - node``, no round, its own pid."""
    return {"time": time, "kind": kind, "rank": -1 - node, "round": None, "pid": 50, **fields}


def _sigkill_run() -> list[dict]:
    """3 ranks, rank 2 an idle spare; rank 1 (pid 101) SIGKILLed during step 4: rank 0's
    collective fails first, then the agent sees the exit and its service writes rank_gone."""
    events = [agent(-1.0, "launch_generation", generation=0, node=0, nodes=1, store="h:1")]
    events += [ev(0.0, "round_start", r, rank_in_round=r if r < 2 else None) for r in range(3)]
    events += steps(2, 0, 0, 3, 1.0)  # steps end at 2..5
    events.append(ev(5.5, "fault", 0, error="RuntimeError: Connection reset by peer", type="E"))
    events += [ev(5.6, "abort", r, duration=0.05, cause="fault", fault_rank=0) for r in (0, 2)]
    events += [ev(5.7, "round_start", r, 1) for r in (0, 2)]
    # the exit is noticed after the survivors began round 1: still round 0's death
    events.append(agent(5.72, "launch_worker_died", slot=1, worker_pid=101, exit_code=-9,
                        incarnation=0))  # fmt: skip
    events.append({"time": 5.73, "kind": "rank_gone", "rank": None, "round": None, "pid": 50,
                   "duration": 0.001, "gone_rank": 1, "gone_round": 0,
                   "cause": "killed by signal SIGKILL"})  # fmt: skip
    events.append(agent(5.74, "launch_respawned", slot=1, worker_pid=107, incarnation=1,
                        seconds=0.02))  # fmt: skip
    events += [ev(7.0 + s, "train_step", r, 1, step=4 + s, duration=1.0) for s in range(3)
               for r in (0, 2)]  # fmt: skip
    events += [ev(9.5, "complete", r, 1) for r in (0, 2)]
    return events


def test_sigkill_under_the_launcher_is_one_fault_of_the_dead_rank() -> None:
    rep = report.analyze(_sigkill_run())
    assert rep.ranks == [0, 1, 2]  # the agent (rank -1) is no training rank
    assert rep.rounds == 2 and len(rep.faults) == 1
    fault = rep.faults[0]
    # the survivor's collective error came first, but the death is the cause
    assert (fault.round, fault.kind, fault.rank) == (0, "rank gone", 1)
    assert fault.cause == "killed by signal SIGKILL"
    assert fault.phases["abort"] == pytest.approx(0.1)  # 5.5 -> the last abort end at 5.6
    assert fault.phases["barrier"] == pytest.approx(0.1)  # -> round 1 at 5.7
    assert fault.phases["reinit"] == pytest.approx(0.3)  # -> first step start at 6.0
    assert rep.productive == pytest.approx(7.0) and rep.wall == pytest.approx(9.5)
    _rows_add_up(rep)
    assert [r["kind"] for r in rep.launcher] == [
        "launch_generation",
        "launch_worker_died",
        "launch_respawned",
    ]
    table = report.format_table(rep)
    assert "3 ranks, 2 rounds" in table and "fault 1: round 0, rank gone on rank 1" in table
    assert "launcher: 1 generation, 1 worker death, 1 respawn, 0 whole-job restarts" in table
    assert "node 0: rank 1 (incarnation 0, pid 101) died: killed by signal SIGKILL" in table
    assert "node 0: rank 1 respawned as incarnation 1 (pid 107) 0.020 s after its death" in table


def test_launcher_death_alone_is_a_detection() -> None:
    """Without the service's rank_gone, the agent's own launch_worker_died names the fault."""
    events = [e for e in _sigkill_run() if e["kind"] not in ("rank_gone", "fault")]
    fault = report.analyze(events).faults[0]
    assert (fault.kind, fault.rank, fault.cause) == ("worker died", 1, "killed by signal SIGKILL")
    assert fault.phases["detection"] == 0.0 and fault.round == 0


def test_no_launcher_section_without_launcher_events() -> None:
    events = [ev(0.0, "round_start"), ev(1.0, "train_step", step=0, duration=1.0)]
    rep = report.analyze(events)
    assert rep.launcher == [] and "launcher" not in report.format_table(rep)


def test_whole_job_restart_rounds_stay_apart() -> None:
    """Generation 0 runs rounds 0 and 1, escalates; generation 1 begins again at round 0."""
    events = [agent(-0.5, "launch_generation", generation=0, nodes=1)]
    events += [ev(0.0, "round_start", r) for r in range(2)] + steps(2, 0, 0, 1, 0.0)
    events.append(ev(2.5, "fault", 1, error="ValueError: x", type="ValueError"))
    events += [ev(3.0, "round_start", r, 1) for r in range(2)] + steps(2, 1, 2, 3, 3.0)
    events.append(ev(5.5, "fault", 1, 1, error="ValueError: x", type="ValueError"))
    events.append(agent(5.6, "launch_escalated", reason="unrecoverable", generation=0))
    events.append(agent(6.0, "launch_generation", generation=1, nodes=1))
    events += [ev(7.0, "round_start", r, 0) for r in range(2)]
    events += steps(2, 0, 2, 5, 8.0)  # steps 2..5 again, from the checkpoint of step 1
    events += [ev(12.5, "complete", r, 0) for r in range(2)]
    rep = report.analyze(events)
    assert rep.rounds == 3 and [f.round for f in rep.faults] == [0, 1]
    restart = rep.faults[1]
    assert restart.kind == "exception (ValueError) -> whole-job restart"
    assert restart.cause.endswith("unrecoverable") and restart.recomputed_steps == 2
    assert restart.phases["barrier"] == pytest.approx(7.0 - 5.5)
    assert rep.steps_kept == 6 and rep.recomputed_steps == 2
    assert any("generation 1" in note and "from 2" in note for note in rep.notes)
    _rows_add_up(rep)
    assert "whole-job restart of generation 0: unrecoverable" in report.format_table(rep)


def test_admission_is_named_and_launcher_events_from_real_files(tmp_path: Path) -> None:
    """Real files: the agent's log (rank -1), its service's (rank None) and a worker's; round 0
    ends to admit respawned rank 1, which writes launch_admitted in round 1."""
    events = [ev(0.0, "round_start", 0), ev(1.0, "train_step", 0, step=0, duration=0.5)]
    events += [ev(1.2, "abort", 0, duration=0.1, cause="admit", fault_rank=1)]
    events += [ev(1.4, "round_start", r, 1) for r in (0, 1)]
    events += [ev(1.4, "launch_admitted", 1, 1, duration=0.9, incarnation=1, waited=0.9)]
    events += [ev(2.0, "train_step", r, 1, step=1, duration=0.5) for r in (0, 1)]
    with open(tmp_path / "events-h-1.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    with EventLog(tmp_path, rank=-1) as log:  # the agent's own events, as the launcher writes
        log.emit("launch_generation", generation=0, node=0, nodes=1, store="h:1")
        log.emit("launch_node_lost", node=1, ranks=[2, 3], generation=0)
        log.emit("launch_node_back", node=1, generation=0)
    rep = report.load(tmp_path)
    assert rep.ranks == [0, 1] and rep.faults[0].kind == "admission"
    assert rep.faults[0].rank == 1
    kinds = [r["kind"] for r in rep.launcher]
    assert kinds[0] == "launch_admitted" and "launch_node_back" in kinds
    table = report.format_table(rep)
    assert "rank 1 (incarnation 1) admitted in round 1 after waiting 0.900 s" in table
    assert "node 0: node 1 lost (ranks [2, 3]), generation 0" in table
    pytest.importorskip("matplotlib")
    from trainguard.report._plot import plot_timeline

    plot_timeline(
        events + _sigkill_run(), report.analyze(events + _sigkill_run()), tmp_path / "t.png"
    )
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_SIGNATURE


def test_real_launch_crash_loop_and_whole_job_restart(tmp_path: Path) -> None:
    """A real ``trainguard launch``: rank 1 of generation 0 exits 3 at every start, so the
    slot crash-loops, the launcher restarts the job in generation 1, which completes."""
    out, events_dir = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    env = dict(os.environ, TRAINGUARD_EVENTS_DIR=str(events_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    cmd = [sys.executable, "-m", "trainguard.launch", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "1", "--monitor-interval", "0.05"]
    cmd += [str(ROOT / "tests/launch/_workers.py"), "run", str(out), "--steps", "2"]
    cmd += ["--step", "0.01", "--crash-gen", "0", "--crash-rank", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    rep = report.load(events_dir)
    assert rep.ranks == [] and rep.faults == []  # plain workers write no events of their own
    kinds = [r["kind"] for r in rep.launcher]
    assert kinds.count("launch_generation") == 2 and kinds.count("launch_escalated") == 1
    assert kinds.count("launch_worker_died") >= 2 and "launch_respawned" in kinds
    table = report.format_table(rep)
    assert "launcher: 2 generations" in table and "died: exit code 3" in table
    assert "whole-job restart of generation 0: crash loop" in table
