"""Warm workers (``--tg-warm-workers``) with real launchers, Wrapper workers and gloo.

A kill with no idle spare is served by the process the agent started ahead: its pid existed
before the kill, it sees the dead worker's identity, the job trains again at full size and ends
with the right result, sooner than a cold process gets past its imports. Nothing is left after
the launcher exits, nor after the launcher is SIGKILLed (the warm process dies with it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.launch import _agents
from tests.launch._agents import Agents, alive, leftovers, read_starts
from trainguard import events
from trainguard.errors import ConfigError
from trainguard.launch import LaunchOptions
from trainguard.launch._compat import WorkerLaunch
from trainguard.launch._warm import entry
from trainguard.launch._warmboot import script_imports

pytestmark = pytest.mark.timeout(120)


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _job(tmp_path: Path, *more: str) -> tuple[Agents, Path, Path]:
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    job = Agents(
        tmp_path,
        nodes=1,
        nproc=2,
        worker=["wrapper", str(out), "--active=2", "--steps=30", "--step=0.1"],
        extra=["--max-restarts=1", "--tg-warm-workers=1", *more],
        env={"TRAINGUARD_EVENTS_DIR": str(ev)},
        timeout=110,
    )
    return job, out, ev


def _agent_events(ev: Path, kind: str) -> list[dict[str, Any]]:
    if not ev.exists():
        return []
    return [e for e in events.read_events(ev) if e["kind"] == kind and e["rank"] < 0]


def _warm_ready(job: Agents, ev: Path) -> int:
    """The pid of a warm process whose imports are done."""
    ready = job.wait_for(
        lambda: _agent_events(ev, "launch_warm_ready"), timeout=60, what="a warm worker ready"
    )
    pid = int(ready[0]["worker_pid"])
    assert alive(pid)
    return pid


def test_a_kill_without_a_spare_is_served_by_the_warm_worker(tmp_path: Path) -> None:
    job, out, ev = _job(tmp_path)
    with job:
        warm = _warm_ready(job, ev)
        job.wait_for(
            lambda: sum(1 for s in _lines(out / "steps.jsonl") if s["step"] >= 3) >= 2,
            timeout=60,
            what="round 0 steps on both ranks",
        )
        first = {s["rank"]: s for s in read_starts(out)}
        killed = time.time()
        os.kill(first[1]["pid"], signal.SIGKILL)
        back = job.wait_for(
            lambda: [s for s in _lines(out / "steps.jsonl") if s["round"] >= 1],
            timeout=40,
            what="round 1",
        )
        assert {s["world"] for s in back} == {2}  # the job trains again at full size
        assert job.wait() == [0], job.output()
        assert leftovers(job.run_id) == []  # the new warm process too
    # the respawn is the warm process, started before the kill, with rank 1's identity
    again = [s for s in read_starts(out) if s["incarnation"] == "1"]
    assert [(s["pid"], s["rank"], s["local_rank"], s["generation"]) for s in again] == [
        (warm, 1, 1, "0")
    ]
    started = [e for e in _agent_events(ev, "launch_warm_started") if e["worker_pid"] == warm]
    assert started and started[0]["time"] < killed
    respawned = _agent_events(ev, "launch_respawned")
    assert [(e["worker_pid"], e["warm"]) for e in respawned] == [(warm, True)]
    assert len(_agent_events(ev, "launch_warm_started")) == 2  # a new one after the takeover
    # past its imports: ready sooner after the kill than any cold start got past them
    ready = {r["pid"]: r["time"] for r in _lines(out / "ready.jsonl")}
    cold = min(ready[s["pid"]] - s["time"] for s in first.values())
    assert ready[warm] - killed < cold, (ready[warm] - killed, cold)
    # the right result: the last round ran its 30 steps on both ranks, sums of 2
    steps = _lines(out / "steps.jsonl")
    last = [s for s in steps if s["round"] == max(x["round"] for x in steps)]
    assert sorted(s["step"] for s in last)[-2:] == [29, 29]
    assert {s["sum"] for s in last} == {2}
    results = sorted(p.read_text() for p in out.glob("result-*"))
    assert results == ["2", "2"], results


def test_the_warm_worker_dies_with_a_killed_launcher(tmp_path: Path) -> None:
    job, _out, ev = _job(tmp_path)
    with job:
        warm = _warm_ready(job, ev)
        os.kill(job.procs[0].pid, signal.SIGKILL)  # the agent alone; its workers live on
        job.procs[0].wait(10)
        end = time.monotonic() + 10
        while alive(warm) and time.monotonic() < end:
            time.sleep(0.05)
        assert not alive(warm), "the warm worker outlived its agent"


def test_a_whole_job_restart_ends_the_warm_workers_and_starts_new_ones(tmp_path: Path) -> None:
    """Rank 1 crash-loops in generation 0, its respawns served warm; the whole job restarts:
    the generation's warm processes end with it, generation 1 gets its own."""
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    worker = ["run", str(out), "--steps=1000", "--crash-gen=0", "--crash-rank=1"]
    extra = ["--max-restarts=1", "--tg-respawns=5", "--tg-warm-workers=1", f"--tg-events-dir={ev}"]
    with Agents(tmp_path, nodes=1, nproc=2, worker=worker, extra=extra) as job:

        def generation_1() -> bool:
            starts = [s for s in read_starts(out) if s["generation"] == "1"]
            escalated = _agent_events(ev, "launch_escalated")
            started = _agent_events(ev, "launch_warm_started")
            return (
                len(starts) == 2 and bool(escalated) and started[-1]["time"] > escalated[0]["time"]
            )

        job.wait_for(generation_1, timeout=90, what="generation 1 and its warm worker")
        escalated = _agent_events(ev, "launch_escalated")
        started = _agent_events(ev, "launch_warm_started")
        before = {e["worker_pid"] for e in started if e["time"] < escalated[0]["time"]}
        after = {e["worker_pid"] for e in started} - before
        assert len(before) == 3 and len(after) == 1  # the first, one per takeover; generation 1's
        respawned = _agent_events(ev, "launch_respawned")
        (unused,) = before - {e["worker_pid"] for e in respawned}
        assert not alive(unused)  # generation 0's last one ended with its generation
        assert all(alive(pid) for pid in after)
        (out / "stop").touch()
        assert job.wait() == [0], job.output()
        assert leftovers(job.run_id) == []
    assert [e["warm"] for e in respawned] == [True, True]  # incarnations 1 and 2 of rank 1
    assert "crash loop" in escalated[0]["reason"]


_PARENT = """
import os, subprocess, sys, time
ready = int(sys.argv[1])
command = [sys.executable, "-u", "-m", "trainguard.launch._warmboot", str(os.getpid())]
subprocess.Popen([*command, str(ready), "script", sys.argv[2]], pass_fds=(ready,),
                 stdin=subprocess.PIPE, start_new_session=True)
os.close(ready)
time.sleep(60)
"""


def test_a_warm_worker_still_importing_dies_with_its_parent() -> None:
    """The parent-death signal, not the end of its stdin (read only after the imports): the
    warm process never got past its imports."""
    read, write = os.pipe()
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(write), _agents.WORKER],
        pass_fds=(write,),
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    os.close(write)
    time.sleep(0.3)  # the warm process runs, importing torch (seconds)
    parent.kill()
    parent.wait()
    os.set_blocking(read, True)
    try:
        assert os.read(read, 1) == b"", "the warm process finished its imports: no death signal"
    finally:  # the end of the file: every holder of the write end (the warm process) exited
        os.close(read)


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_the_warm_worker_runs_as_the_dead_worker_would_have_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_module: bool
) -> None:
    """The same environment (but the incarnation and its error file), ``sys.argv`` and
    ``sys.path[0]`` as the slot's cold first process, for ``script.py`` and ``-m module``."""
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    extra = ["--tg-warm-workers=1", f"--tg-events-dir={ev}"]
    if as_module:
        monkeypatch.setattr(_agents, "WORKER", "tests.launch._workers")
        extra.append("-m")
    worker = ["run", str(out), "--dump-env", "--steps=400"]
    with Agents(tmp_path, nodes=1, nproc=2, worker=worker, extra=extra) as job:
        warm = _warm_ready(job, ev)
        first = {s["rank"]: s["pid"] for s in read_starts(out)}
        os.kill(first[1], signal.SIGKILL)
        job.wait_for(lambda: (out / "env-1-1.json").exists(), what="the respawn's env")
        (out / "stop").touch()
        assert job.wait() == [0], job.output()
        assert leftovers(job.run_id) == []
    assert [s["pid"] for s in read_starts(out) if s["incarnation"] == "1"] == [warm]
    cold = json.loads((out / "env-1-0.json").read_text())
    hot = json.loads((out / "env-1-1.json").read_text())
    assert hot["argv"] == cold["argv"] and hot["path0"] == cold["path0"]
    if as_module:
        assert cold["argv"][0].endswith("_workers.py")  # as python -m has it
    changed = {
        k for k in cold["env"].keys() | hot["env"].keys() if cold["env"].get(k) != hot["env"].get(k)
    }
    assert changed == {"TRAINGUARD_INCARNATION", "TORCHELASTIC_ERROR_FILE"}, changed
    assert hot["env"]["RANK"] == "1" and hot["env"]["LOCAL_RANK"] == "1"
    assert hot["env"]["TORCHELASTIC_ERROR_FILE"].endswith("/1/inc_1/error.json")


def test_warm_workers_are_off_for_a_command_they_cannot_run() -> None:
    def launch(*args: str, entrypoint: str = sys.executable, numa: object = None) -> Any:
        return entry(WorkerLaunch(entrypoint, args, {}, "", "", "", numa))

    assert launch("-u", "train.py", "--lr", "1") == ("script", "train.py")
    assert launch("-u", "-m", "pkg.train") == ("module", "pkg.train")
    assert launch("-u", "-X", "dev", "train.py") is None  # an interpreter option we do not run
    assert launch("./train.sh", entrypoint="/bin/bash") is None  # --no-python
    assert launch("-u", "train.py", numa=object()) is None  # --numa-binding wraps the command
    with pytest.raises(ConfigError, match="--tg-warm-workers"):
        LaunchOptions(warm_workers=-1)


def test_the_warm_worker_prefetches_the_scripts_top_level_imports(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import os, json\nfrom torch import nn\nfrom . import local\ndef f():\n    import late\n"
    )
    assert script_imports(str(script)) == ["os", "json", "torch"]
    assert script_imports(str(tmp_path / "missing.py")) == []
