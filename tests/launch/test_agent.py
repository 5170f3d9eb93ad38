"""The agent with real processes: 2 agents ("nodes") x 2 plain-Python workers on localhost."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests._dist import process_with_pid
from tests.launch._agents import Agents, alive, leftovers, progress, read_starts
from trainguard import events

pytestmark = pytest.mark.timeout(60)


def test_a_killed_worker_is_respawned_alone_and_the_job_completes(tmp_path: Path) -> None:
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    with Agents(
        tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=[f"--tg-events-dir={ev}"]
    ) as job:
        first = job.wait_for(
            lambda: len(read_starts(out)) >= 4 and read_starts(out), what="4 starts"
        )
        assert sorted(s["rank"] for s in first) == [0, 1, 2, 3]
        assert {s["generation"] for s in first} == {"0"} and {s["incarnation"] for s in first} == {
            "0"
        }
        pids = {s["rank"]: s["pid"] for s in first}
        job.wait_for(lambda: progress(out, 2) >= 3, what="rank 2 progress")
        killed_at = progress(out, 2)
        os.kill(pids[2], signal.SIGKILL)
        again = job.wait_for(
            lambda: [s for s in read_starts(out) if s["incarnation"] == "1"], what="respawn"
        )
        assert [(s["rank"], s["local_rank"], s["generation"]) for s in again] == [(2, 0, "0")]
        job.wait_for(lambda: progress(out, 2) > killed_at + 2, what="progress after respawn")
        assert all(alive(pids[r]) for r in (0, 1, 3)), "a survivor lost its process"
        assert len(read_starts(out)) == 5  # nobody else was restarted
        (out / "stop").touch()
        assert job.wait() == [0, 0], job.output()
        assert leftovers(job.run_id) == []
    kinds = [(e["kind"], e.get("slot")) for e in events.read_events(ev)]
    died = kinds.index(("launch_worker_died", 2))
    assert kinds.index(("launch_respawned", 2)) > died
    assert kinds.count(("launch_generation", None)) == 2  # one per agent
    respawned = next(e for e in events.read_events(ev) if e["kind"] == "launch_respawned")
    assert respawned["rank"] == -2 and respawned["incarnation"] == 1  # agent of node 1
    assert respawned["worker_pid"] == again[0]["pid"]


def test_a_crash_loop_restarts_the_whole_job_in_a_new_generation(tmp_path: Path) -> None:
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    worker = ["run", str(out), "--steps=30", "--crash-gen=0", "--crash-rank=1"]
    extra = ["--max-restarts=1", "--tg-respawns=5", f"--tg-events-dir={ev}"]
    with Agents(tmp_path, nodes=2, nproc=2, worker=worker, extra=extra) as job:
        assert job.wait() == [0, 0], job.output()
        assert leftovers(job.run_id) == []
    starts = read_starts(out)
    gen0 = [s for s in starts if s["generation"] == "0"]
    gen1 = [s for s in starts if s["generation"] == "1"]
    # rank 1 crashed at start 3 times in a row (a crash loop) before its budget of 5 ran out
    assert sorted(s["incarnation"] for s in gen0 if s["rank"] == 1) == ["0", "1", "2"]
    assert sorted(s["rank"] for s in gen1) == [0, 1, 2, 3]
    assert {s["incarnation"] for s in gen1} == {"0"} and {s["restart_count"] for s in gen1} == {"1"}
    escalated = [e for e in events.read_events(ev) if e["kind"] == "launch_escalated"]
    assert escalated and escalated[0]["generation"] == 0 and "crash loop" in escalated[0]["reason"]
    generations = [
        e["generation"] for e in events.read_events(ev) if e["kind"] == "launch_generation"
    ]
    assert sorted(generations) == [0, 0, 1, 1]


def test_sigterm_to_a_launcher_ends_every_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)]) as job:
        starts = job.wait_for(
            lambda: len(read_starts(out)) >= 4 and read_starts(out), what="starts"
        )
        start = time.monotonic()
        job.signal(0, signal.SIGTERM)  # the agent that hosts both stores
        codes = job.wait(timeout=30)
        assert codes[0] != 0 and codes[1] != 0, job.output()
        assert time.monotonic() - start < 20
        assert not any(alive(s["pid"]) for s in starts)
        assert leftovers(job.run_id) == [], job.output()


def test_a_whole_job_restart_of_a_gloo_job_completes(tmp_path: Path) -> None:
    """2 x 2 gloo workers, rank 1 dies in generation 0, no respawn budget: the whole job restarts.
    With torch's shared agent store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0) the restarted
    attempt hangs or fails in init_process_group/all_reduce; the launcher's default avoids it."""
    out = tmp_path / "out"
    out.mkdir()
    worker = ["gloo", str(out), "--steps=3", "--crash-gen=0", "--crash-rank=1"]
    extra = ["--max-restarts=1", "--tg-respawns=0"]
    with Agents(tmp_path, nodes=2, nproc=2, worker=worker, extra=extra) as job:
        assert job.wait() == [0, 0], job.output()
        assert leftovers(job.run_id) == []
    starts = read_starts(out)
    assert sorted(s["rank"] for s in starts if s["generation"] == "1") == [0, 1, 2, 3]
    assert [(out / f"sum-{r}").read_text() for r in range(4)] == ["4"] * 4


@pytest.mark.parametrize("warm", [0, 1])
def test_a_respawned_worker_logs_to_files_of_its_own_and_its_tee_reaches_the_console(
    tmp_path: Path, warm: int
) -> None:
    """Also when a warm worker (``--tg-warm-workers``) takes the respawn over."""
    out, logs, ev = tmp_path / "out", tmp_path / "logs", tmp_path / "events"
    out.mkdir()
    extra = [f"--log-dir={logs}", "--redirects=3", "--tee=3", f"--tg-warm-workers={warm}"]
    extra.append(f"--tg-events-dir={ev}")
    with Agents(tmp_path, nodes=1, nproc=2, worker=["run", str(out)], extra=extra) as job:
        first = job.wait_for(lambda: len(read_starts(out)) >= 2 and read_starts(out), what="starts")
        os.kill(next(s["pid"] for s in first if s["rank"] == 1), signal.SIGKILL)
        job.wait_for(lambda: len(read_starts(out)) >= 3, what="respawn")
        job.wait_for(lambda: "worker rank 1 incarnation 1" in job.output(), what="tee")
        (out / "stop").touch()
        assert job.wait() == [0], job.output()
    (attempt,) = logs.glob("*/attempt_0")
    assert "incarnation 0" in (attempt / "1" / "stdout.log").read_text()
    assert "incarnation 1" in (attempt / "1" / "inc_1" / "stdout.log").read_text()
    assert "incarnation 0" in (attempt / "0" / "stdout.log").read_text()
    assert not (attempt / "0" / "inc_1").exists()
    respawned = [e for e in events.read_events(ev) if e["kind"] == "launch_respawned"]
    assert [e["warm"] for e in respawned] == [bool(warm)]


def test_a_respawn_never_signals_the_process_that_reused_the_dead_workers_pid(
    tmp_path: Path,
) -> None:
    # the dead worker's pid goes to another process (leading a group of that id) during the
    # respawn's back-off: the agent's cleanup of the worker's group must not reach it
    out = tmp_path / "out"
    out.mkdir()
    extra = ["--tg-respawn-backoff=3"]
    with Agents(tmp_path, nodes=1, nproc=2, worker=["run", str(out)], extra=extra) as job:
        first = job.wait_for(lambda: len(read_starts(out)) >= 2 and read_starts(out))
        dead = next(s["pid"] for s in first if s["rank"] == 1)
        job.wait_for(lambda: progress(out, 1) >= 1, what="rank 1 progress")
        os.kill(dead, signal.SIGKILL)
        victim = process_with_pid(dead, time.monotonic() + 2.5)
        assert victim is not None, f"pid {dead} could not be had within the back-off"
        try:
            job.wait_for(
                lambda: [s for s in read_starts(out) if s["incarnation"] == "1"], what="respawn"
            )
            time.sleep(0.2)
            assert victim.poll() is None, f"the respawn killed pid {dead}'s new owner"
        finally:
            victim.kill()
            victim.wait()
        (out / "stop").touch()
        assert job.wait() == [0], job.output()
