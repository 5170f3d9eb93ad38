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
from tests.launch._agents import ROOT, Agents, leftovers, read_starts
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _progress(out: Path, rank: int) -> int:
    try:
        return int((out / f"progress-{rank}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _events(ev: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in events.read_events(ev) if e["kind"] == kind] if ev.exists() else []


def _kill_node(job: Agents, node: int, pids: list[int]) -> float:
    """SIGKILL agent ``node``'s process group and its workers' (``pids``); returns when."""
    killed = time.time()
    os.killpg(job.procs[node].pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    job.procs[node].wait(5)
    return killed


def _started(job: Agents, out: Path) -> dict[int, int]:
    """Wait for the 4 first workers and some progress of each; their pids by rank."""
    starts = job.wait_for(lambda: len(read_starts(out)) >= 4 and read_starts(out), what="starts")
    job.wait_for(lambda: all(_progress(out, r) >= 2 for r in range(4)), what="progress")
    return {s["rank"]: s["pid"] for s in starts}


def _lost(job: Agents, ev: Path, killed: float) -> dict[str, Any]:
    (lost,) = job.wait_for(lambda: _events(ev, "launch_node_lost"), timeout=TIMEOUT + 10)
    detect = lost["time"] - killed
    print(f"node lost -> survivors' agent informed: {detect:.2f} s (timeout {TIMEOUT} s)")
    assert detect <= TIMEOUT + 1.0, detect
    return lost


def test_a_lost_node_is_counted_out_and_the_survivors_finish(tmp_path: Path) -> None:
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    extra = [*NODES, f"--tg-events-dir={ev}"]
    with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=extra) as job:
        pids = _started(job, out)
        killed = _kill_node(job, 1, [pids[2], pids[3]])
        lost = _lost(job, ev, killed)
        assert (lost["node"], lost["ranks"], lost["rank"]) == (1, [2, 3], -1)  # agent 0 saw it
        before = _progress(out, 0)
        job.wait_for(lambda: _progress(out, 0) > before + 3, what="survivors go on")
        assert _alive(pids[0]) and _alive(pids[1]), "a survivor lost its process"
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
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    extra = [*NODES, f"--tg-events-dir={ev}"]
    with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=extra) as job:
        pids = _started(job, out)
        killed = _kill_node(job, 1, [pids[2], pids[3]])
        _lost(job, ev, killed)
        started = time.monotonic()
        job.add()  # a replacement node, same options
        new = job.wait_for(
            lambda: [s for s in read_starts(out) if s["pid"] not in pids.values()] or None,
            what="replacement workers",
        )
        job.wait_for(lambda: len(read_starts(out)) >= 6, what="both replacement workers")
        new = read_starts(out)[4:]
        print(f"replacement agent start -> its workers started: {time.monotonic() - started:.2f} s")
        assert sorted((s["rank"], s["local_rank"]) for s in new) == [(2, 0), (3, 1)]
        assert {s["generation"] for s in new} == {"0"}  # the running generation, no restart
        assert all(int(s["incarnation"]) >= 1 for s in new)
        (back,) = job.wait_for(lambda: _events(ev, "launch_node_back"), what="node 1 back")
        assert (back["node"], back["rank"]) == (1, -1)
        progress = _progress(out, 2)
        job.wait_for(lambda: _progress(out, 2) > progress + 3, what="replacement progress")
        assert _alive(pids[0]) and _alive(pids[1]), "a survivor lost its process"
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
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    port = free_port()
    extra = [*NODES, f"--tg-events-dir={ev}", f"--tg-store=127.0.0.1:{port}"]
    store = _store(port)  # before the agents: they connect right after their rendezvous
    try:
        with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=extra) as job:
            pids = _started(job, out)
            killed = _kill_node(job, 0, [pids[0], pids[1]])  # it hosted the rendezvous store
            lost = _lost(job, ev, killed)
            assert (lost["node"], lost["ranks"], lost["rank"]) == (0, [0, 1], -2)
            before = _progress(out, 2)
            job.wait_for(lambda: _progress(out, 2) > before + 3, what="survivors go on")
            assert _alive(pids[2]) and _alive(pids[3]), "a survivor lost its process"
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


def test_a_node_declared_lost_while_only_slow_restarts_the_whole_job(tmp_path: Path) -> None:
    """Agent 1 is stopped (SIGSTOP) past the heartbeat timeout while its workers run on: agent
    0 counts its ranks out; when it runs again it finds itself declared lost, stops its workers
    and asks for a whole-job restart, which completes in generation 1."""
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    extra = [*NODES, f"--tg-events-dir={ev}", "--max-restarts=1"]
    with Agents(tmp_path, nodes=2, nproc=2, worker=["run", str(out)], extra=extra) as job:
        _started(job, out)
        job.procs[1].send_signal(signal.SIGSTOP)
        try:
            job.wait_for(lambda: _events(ev, "launch_node_lost"), timeout=TIMEOUT + 10)
        finally:
            job.procs[1].send_signal(signal.SIGCONT)
        job.wait_for(
            lambda: len([s for s in read_starts(out) if s["generation"] == "1"]) == 4,
            what="generation 1",
        )
        (out / "stop").touch()
        assert job.wait(timeout=30) == [0, 0], job.output()
        assert leftovers(job.run_id) == []
    (escalated, *_) = _events(ev, "launch_escalated")
    assert escalated["rank"] == -2 and "declared lost" in escalated["reason"], escalated
    starts = read_starts(out)
    assert sorted(s["rank"] for s in starts if s["generation"] == "1") == [0, 1, 2, 3]
