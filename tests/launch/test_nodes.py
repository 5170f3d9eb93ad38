"""Whole nodes with real processes: 2 agents ("nodes") x 2 plain-Python workers on localhost.

A node is lost when its agent's process group and its workers (each in a session of its own)
are SIGKILLed. Heartbeat every 0.2 s, a node silent for 2 s is lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests._dist import free_port
from tests.launch._agents import ROOT, Agents, alive, leftovers, progress, read_starts
from trainguard import events

pytestmark = pytest.mark.timeout(90)

INTERVAL, TIMEOUT = 0.2, 2.0
#: long enough that a survivor that waited for the lost node in the exit barrier fails the test
EXIT_BARRIER = 60.0
NODES = [
    f"--tg-heartbeat-interval={INTERVAL}",
    f"--tg-heartbeat-timeout={TIMEOUT}",
    f"--tg-exit-barrier-timeout={EXIT_BARRIER}",
]


def _events(ev: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in events.read_events(ev) if e["kind"] == kind] if ev.exists() else []


def _job(tmp_path: Path, *more: str) -> tuple[Path, Path, list[str]]:
    """The workers' output folder, the event log folder and the launcher options."""
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    return out, ev, [*NODES, f"--tg-events-dir={ev}", *more]


def _started(job: Agents, out: Path) -> dict[int, int]:
    """Wait for the 4 first workers and some progress of each; their pids by rank."""
    starts = job.wait_for(lambda: len(read_starts(out)) >= 4 and read_starts(out), what="starts")
    job.wait_for(lambda: all(progress(out, r) >= 2 for r in range(4)), what="progress")
    return {s["rank"]: s["pid"] for s in starts}


def _lose(job: Agents, ev: Path, node: int, pids: dict[int, int]) -> dict[str, Any]:
    """SIGKILL agent ``node``'s process group and its 2 workers' (each in a session of its
    own); the ``launch_node_lost`` event, which must come within the timeout + 1 s."""
    killed = time.time()
    os.killpg(job.procs[node].pid, signal.SIGKILL)
    for rank in (2 * node, 2 * node + 1):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pids[rank], signal.SIGKILL)
    job.procs[node].wait(5)
    (lost,) = job.wait_for(lambda: _events(ev, "launch_node_lost"), timeout=TIMEOUT + 10)
    detect = lost["time"] - killed
    print(f"node lost -> survivors' agent informed: {detect:.2f} s (timeout {TIMEOUT} s)")
    assert detect <= TIMEOUT + 1.0, detect
    assert (lost["node"], lost["ranks"]) == (node, [2 * node, 2 * node + 1])
    return lost


def _go_on(job: Agents, out: Path, pids: dict[int, int], ranks: tuple[int, ...]) -> None:
    """``ranks`` make progress, their first processes still run."""
    before = progress(out, ranks[0])
    job.wait_for(lambda: progress(out, ranks[0]) > before + 3, what=f"ranks {ranks} go on")
    assert all(alive(pids[r]) for r in ranks), "a survivor lost its process"


def test_a_lost_node_is_counted_out_and_the_survivors_finish(tmp_path: Path) -> None:
    out, ev, extra = _job(tmp_path)
    with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=extra) as job:
        pids = _started(job, out)
        assert _lose(job, ev, 1, pids)["rank"] == -1  # agent 0 saw it
        _go_on(job, out, pids, (0, 1))
        (out / "stop").touch()
        stopped = time.monotonic()
        assert job.wait(timeout=30) == [0, -signal.SIGKILL], job.output()
        waited = time.monotonic() - stopped
        assert waited < 10, f"the survivor waited {waited:.1f} s for the lost node"
        assert len(read_starts(out)) == 4  # nobody was restarted
        assert leftovers(job.run_id) == []


def test_a_replacement_node_takes_the_lost_nodes_ranks_and_the_job_completes(
    tmp_path: Path,
) -> None:
    out, ev, extra = _job(tmp_path)
    with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=extra) as job:
        pids = _started(job, out)
        _lose(job, ev, 1, pids)
        started = time.monotonic()
        job.add()  # a replacement node, same options
        job.wait_for(lambda: len(read_starts(out)) >= 6, what="the replacement's workers")
        print(f"replacement agent start -> its workers started: {time.monotonic() - started:.2f} s")
        new = read_starts(out)[4:]
        assert sorted((s["rank"], s["local_rank"]) for s in new) == [(2, 0), (3, 1)]
        assert {s["generation"] for s in new} == {"0"}  # the running generation, no restart
        assert all(int(s["incarnation"]) >= 1 for s in new)
        (back,) = job.wait_for(lambda: _events(ev, "launch_node_back"), what="node 1 back")
        assert (back["node"], back["rank"]) == (1, -1)
        _go_on(job, out, {**pids, 2: new[0]["pid"], 3: new[1]["pid"]}, (2, 3, 0, 1))
        (out / "stop").touch()
        assert job.wait(timeout=30) == [0, -signal.SIGKILL, 0], job.output()
        assert leftovers(job.run_id) == []
    (generation,) = [e for e in _events(ev, "launch_generation") if e["replacement"]]
    assert (generation["node"], generation["generation"], generation["rank"]) == (1, 0, -2)


def _store(port: int) -> subprocess.Popen[bytes]:
    """An external coordination store: a TCPStore server in a process of its own."""
    code = (
        "import time, torch.distributed as d; "
        f"s = d.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False, "
        "use_libuv=True); print('ready', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True, cwd=ROOT
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def test_agent_0_lost_with_an_external_store_the_others_go_on(tmp_path: Path) -> None:
    port = free_port()
    out, ev, extra = _job(tmp_path, f"--tg-store=127.0.0.1:{port}")
    store = _store(port)  # before the agents: they connect right after their rendezvous
    try:
        with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=extra) as job:
            pids = _started(job, out)
            assert _lose(job, ev, 0, pids)["rank"] == -2  # it hosted the rendezvous store
            _go_on(job, out, pids, (2, 3))
            (out / "stop").touch()
            stopped = time.monotonic()
            assert job.wait(timeout=30) == [-signal.SIGKILL, 0], job.output()
            assert time.monotonic() - stopped < 10
            assert len(read_starts(out)) == 4
    finally:
        store.kill()
        store.wait(5)
        assert store.stdout is not None
        store.stdout.close()


def _slow_node(job: Agents, ev: Path) -> None:
    """Stop agent 1 (SIGSTOP) past the heartbeat timeout while its workers run on, until agent 0
    counted its ranks out; then let it run again."""
    job.procs[1].send_signal(signal.SIGSTOP)
    try:
        job.wait_for(lambda: _events(ev, "launch_node_lost"), timeout=TIMEOUT + 10)
    finally:
        job.procs[1].send_signal(signal.SIGCONT)


def test_a_node_declared_lost_while_only_slow_rejoins_without_restarting_the_job(
    tmp_path: Path,
) -> None:
    """When agent 1 runs again it finds itself declared lost: it stops its workers and takes
    its place again as a new node (its workers are newcomers, incarnation 1); the job is not
    restarted (it used to ask for a whole-job restart: a slow node ended every rank's work)."""
    out, ev, extra = _job(tmp_path, "--max-restarts=1")
    with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=extra) as job:
        _started(job, out)
        _slow_node(job, ev)
        job.wait_for(
            lambda: len([s for s in read_starts(out) if s["incarnation"] == "1"]) == 2,
            what="node 1's workers again, as newcomers",
        )
        (out / "stop").touch()
        assert job.wait(timeout=30) == [0, 0], job.output()
        assert leftovers(job.run_id) == []
    assert _events(ev, "launch_escalated") == []
    (evicted,) = _events(ev, "launch_evicted")
    assert evicted["rank"] == -2 and evicted["then"] == "rejoin"
    assert [e["rank"] for e in _events(ev, "launch_rejoined")] == [-2]
    starts = read_starts(out)
    assert {s["generation"] for s in starts} == {"0"}
    assert sorted(s["rank"] for s in starts if s["incarnation"] == "1") == [2, 3]


def test_a_node_declared_lost_leaves_with_status_3_when_told_to(tmp_path: Path) -> None:
    out, ev, extra = _job(tmp_path, "--max-restarts=1", "--tg-on-evicted=exit")
    with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=extra) as job:
        starts = _started(job, out)
        _slow_node(job, ev)
        job.wait_for(lambda: job.procs[1].poll() is not None, what="node 1 leaving")
        assert job.procs[1].returncode == 3, job.output()
        assert "this node left the job" in job.output()
        (out / "stop").touch()
        assert job.wait(timeout=30) == [0, 3], job.output()
        assert leftovers(job.run_id) == []
    assert _events(ev, "launch_escalated") == []
    assert not any(alive(pid) for pid in starts.values())
