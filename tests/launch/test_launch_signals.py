"""Signals and start-up failures of ``trainguard launch``, with real launcher processes.

- A SIGTERM that lands while the agent waits in a store call (its external coordination store
  is SIGSTOPped) still reaches the workers at once, and the launcher exits 75 after they saved.
- A run that nobody signalled has no preemption: no "SIGTERM: preemption" line, no
  ``launch_preempt`` event, neither at its end nor at a whole-job restart.
- A preemption of one node of two ends both launchers within 10 s, with status 75, and the
  requeued job resumes at the step saved.
- A start-up failure (a script that does not exist, a Wrapper's ``ConfigError``) ends the job
  at once, the error once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._dist import free_port
from tests.launch._agents import ROOT, Agents, alive, leftovers, progress, read_starts
from tests.restart._preempt_jobs import progress as preempt_progress
from trainguard import events
from trainguard.checkpoint import latest, load
from trainguard.restart.preempt import EXIT_PREEMPTED

pytestmark = pytest.mark.timeout(120)

PREEMPT_LINE = "SIGTERM: preemption"


def _kinds(ev: Path) -> list[str]:
    return [e["kind"] for e in events.read_events(ev)] if ev.exists() else []


def _store(port: int) -> subprocess.Popen[bytes]:
    """An external coordination store: a TCPStore server in a process (and session) of its own."""
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


def _term_times(out: Path, ranks: range) -> dict[int, float]:
    found = {}
    for rank in ranks:
        path = out / f"term-{rank}"
        if path.exists() and path.read_text():
            found[rank] = float(path.read_text())
    return found


# 1. a SIGTERM inside a store call -------------------------------------------------------------
def test_a_sigterm_inside_a_stalled_store_call_reaches_the_workers_and_exits_75(
    tmp_path: Path,
) -> None:
    """The agent's store calls stall (its coordination store is SIGSTOPped: every tick's
    escalation check waits for a reply up to the 20 s store timeout); a SIGTERM then lands
    inside that call. torch's handler raises its ``SignalException`` there, which the agent's
    ``except Exception`` around the call used to take for a store failure: the workers never
    got the signal and the fence later SIGKILLed them."""
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    port = free_port()
    extra = [
        f"--tg-store=127.0.0.1:{port}",
        "--tg-heartbeat-interval=0.5",
        "--tg-heartbeat-timeout=20",
        f"--tg-events-dir={ev}",
    ]
    store = _store(port)
    try:
        with Agents(tmp_path, nodes=1, nproc=2, worker=["term", str(out)], extra=extra) as job:
            job.wait_for(lambda: len(read_starts(out)) >= 2, what="2 workers")
            job.wait_for(lambda: "launch_generation" in _kinds(ev), what="the agent's store")
            time.sleep(0.5)
            store.send_signal(signal.SIGSTOP)
            time.sleep(1.5)  # the agent's tick (every 0.05 s) now waits in a store call
            sent = time.time()
            job.signal(0, signal.SIGTERM)
            try:
                terms = job.wait_for(
                    lambda: len(_term_times(out, range(2))) == 2 and _term_times(out, range(2)),
                    timeout=15,
                    what="both workers got the SIGTERM while the store stalls",
                )
            finally:
                store.send_signal(signal.SIGCONT)
            late = max(terms.values()) - sent
            print(f"SIGTERM -> both workers had it: {late:.2f} s (store stalled)")
            assert late < 3.0, late  # not after the 20 s store timeout
            assert job.wait(timeout=40) == [EXIT_PREEMPTED], job.output()
            text = job.output()
            assert "preempted; the workers saved their state" in text
            assert "did not answer (Process" not in text, text
            assert leftovers(job.run_id) == []
    finally:
        store.send_signal(signal.SIGCONT)
        store.kill()
        store.wait(5)
        assert store.stdout is not None
        store.stdout.close()
    assert "launch_preempt" in _kinds(ev)


# 2. no preemption nobody sent -----------------------------------------------------------------
def test_a_run_nobody_signalled_has_no_preemption(tmp_path: Path) -> None:
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    extra = [f"--tg-events-dir={ev}"]
    with Agents(
        tmp_path, nodes=1, nproc=2, worker=["run", str(out), "--steps=5"], extra=extra
    ) as job:
        assert job.wait(timeout=40) == [0], job.output()
        text = job.output()
    assert PREEMPT_LINE not in text, text
    assert "launch_preempt" not in _kinds(ev)


def test_a_whole_job_restart_is_no_preemption(tmp_path: Path) -> None:
    """Rank 1 dies in generation 0 with no respawn budget: torch's loop stops the other worker
    (with SIGTERM, through the agent's shutdown) and restarts the job; that is no preemption."""
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    worker = ["run", str(out), "--steps=40", "--crash-gen=0", "--crash-rank=1"]
    extra = ["--max-restarts=1", "--tg-respawns=0", f"--tg-events-dir={ev}"]
    with Agents(tmp_path, nodes=1, nproc=2, worker=worker, extra=extra) as job:
        assert job.wait(timeout=50) == [0], job.output()
        text = job.output()
    kinds = _kinds(ev)
    assert kinds.count("launch_generation") == 2, kinds
    assert PREEMPT_LINE not in text, text
    assert "launch_preempt" not in kinds


def test_a_sigterm_in_the_exit_barrier_of_a_finished_node_is_no_failure(tmp_path: Path) -> None:
    """Node 1's worker finished, its agent waits for node 0 in the exit barrier: a SIGTERM
    there ends the wait, with status 0 (its work is done) and no preemption."""
    out, ev = tmp_path / "out", tmp_path / "events"
    out.mkdir()
    worker = ["run", str(out), "--steps=3", "--endless-rank=0"]
    extra = [f"--tg-events-dir={ev}", "--tg-exit-barrier-timeout=60"]
    with Agents(tmp_path, nodes=2, nproc=1, worker=worker, extra=extra) as job:
        starts = job.wait_for(lambda: len(read_starts(out)) == 2 and read_starts(out))
        finished = next(s["pid"] for s in starts if s["rank"] == 1)
        job.wait_for(lambda: not alive(finished), what="rank 1 finished")
        time.sleep(1.0)  # its agent saw it on its next tick (0.05 s) and waits in the barrier
        assert job.procs[1].poll() is None and progress(out, 0) > 3
        sent = time.monotonic()
        job.signal(1, signal.SIGTERM)
        assert job.procs[1].wait(10) == 0, job.output()
        took = time.monotonic() - sent
        (out / "stop").touch()
        assert job.wait(timeout=30) == [0, 0], job.output()
        text = job.output()
    assert took < 5.0, took
    assert PREEMPT_LINE not in text, text
    assert "launch_preempt" not in _kinds(ev)


# 3. a preemption of one node of two ---------------------------------------------------------
STEPS = 400  # 0.02 s a step: far more than the test waits


def _two_nodes(tmp: Path, out: Path, name: str) -> Agents:
    folder = tmp / name
    folder.mkdir()
    return Agents(
        folder,
        nodes=2,
        nproc=1,
        worker=["preempt", str(out), f"--steps={STEPS}"],
        extra=["--tg-exit-barrier-timeout=30"],
        timeout=100,
    )


@pytest.mark.parametrize("node", [1, 0], ids=["non-host", "store-host"])
def test_a_preemption_of_one_node_ends_every_launcher_within_10_s_with_75(
    tmp_path: Path, node: int
) -> None:
    """Two launchers on one host (``--nnodes 2`` on loopback), one worker each; only launcher
    ``node`` gets the SIGTERM. Every rank stops at one step and saves it; both launchers exit
    75 within 10 s of the signal (the other one used to wait out its 30 s exit barrier)."""
    out = tmp_path / "out"
    out.mkdir()
    with _two_nodes(tmp_path, out, "first") as job:
        job.wait_for(
            lambda: all(any(p["step"] >= 12 for p in preempt_progress(out, r)) for r in (0, 1)),
            timeout=60,
            what="both ranks past step 12",
        )
        sent = time.monotonic()
        job.signal(node, signal.SIGTERM)
        exits = [0.0, 0.0]
        while not all(exits) and time.monotonic() - sent < 40:
            for i, p in enumerate(job.procs):
                if not exits[i] and p.poll() is not None:
                    exits[i] = time.monotonic() - sent
            time.sleep(0.05)
        codes = job.wait(timeout=5)
        print(f"SIGTERM to launcher {node} -> exits after {exits[0]:.1f} s and {exits[1]:.1f} s")
        assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], job.output()
        assert max(exits) < 10.0, (exits, job.output())
        assert leftovers(job.run_id) == []
    newest = latest(out / "ckpt")
    assert newest is not None
    stop = load(newest, rank=0)["step"]
    assert stop > 12
    assert [max(p["step"] for p in preempt_progress(out, r)) for r in (0, 1)] == [stop - 1] * 2
    if node == 0:
        return  # the requeued job's resume is the same either way: once is enough

    with _two_nodes(tmp_path, out, "second") as job:  # requeued: resumes at the saved step
        job.wait_for(
            lambda: all(
                any(p["step"] >= stop + 2 for p in preempt_progress(out, r)) for r in (0, 1)
            ),
            timeout=60,
            what="both ranks resumed",
        )
        job.kill()
    for rank in (0, 1):
        steps = [p["step"] for p in preempt_progress(out, rank)]
        resumed = steps[steps.index(stop - 1) + 1]
        assert resumed == stop, steps  # the first step of the second job is the one saved


# 4. start-up failures end the job at once ---------------------------------------------------
def _launch(
    tmp_path: Path, script: str, nproc: int
) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard",
            "launch",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--monitor-interval=0.05",
            script,
        ],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    return proc, time.monotonic() - start


def test_a_script_that_does_not_exist_ends_the_job_at_once(tmp_path: Path) -> None:
    proc, took = _launch(tmp_path, str(tmp_path / "no_such_train.py"), 2)
    print(f"missing script: exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode != 0
    assert took < 20.0, took  # the launcher's import (5-9 s on this loaded machine)
    output = proc.stdout + proc.stderr
    assert "starting workers" not in output and "Traceback" not in output, output
    assert output.count("no_such_train.py") == 1, output
    assert "does not exist" in output


def test_a_wrappers_config_error_ends_the_job_at_once_with_the_error_once(tmp_path: Path) -> None:
    script = tmp_path / "bad_timeouts.py"
    script.write_text(
        "import os, pathlib\n"
        "pathlib.Path(f'start-{os.getpid()}').touch()\n"
        "import trainguard.restart as tr\n"
        "@tr.Wrapper(soft_timeout=30, hard_timeout=10)\n"
        "def train(call: tr.CallWrapper) -> None:\n"
        "    pass\n"
        "train()\n"
    )
    proc, took = _launch(tmp_path, str(script), 1)
    output = proc.stdout + proc.stderr
    print(f"ConfigError: exit {proc.returncode} after {took:.1f} s")
    assert proc.returncode == 1, output
    assert len(list(tmp_path.glob("start-*"))) == 1, output  # never respawned or restarted
    assert output.count("Traceback") == 1, output  # the worker's, once
    assert output.count("must be shorter than hard_timeout") == 1, output
    assert "the job cannot start: a worker raised ConfigError" in output
    assert PREEMPT_LINE not in output
    assert took < 20.0, took


@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        (["no_such.py"], "training script 'no_such.py' does not exist"),
        (["--no-python", "no-such-command-tg"], "command 'no-such-command-tg' does not exist"),
        (["-m", "no_such_module"], None),  # only the workers' sys.path can tell
        (["--no-python", "true"], None),
    ],
)
def test_missing_script_names_what_cannot_start(argv: list[str], missing: str | None) -> None:
    from trainguard.launch.cli import build_parser, missing_script

    found = missing_script(build_parser().parse_args(argv))
    assert (found is None) == (missing is None), found
    if missing is not None:
        assert found is not None and missing in found


def test_the_signal_watch_notes_raises_again_forwards_sigterm_once_and_restores() -> None:
    """In this process: the watch replaces a Python handler, notes the first signal, raises
    torch's SignalException for it (and again on reraise), calls ``forward`` once for SIGTERM
    from its thread, and restores the wake-up descriptor and ends its thread on close."""
    import os
    import threading

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from trainguard.launch._signals import SignalWatch

    forwarded: list[str] = []
    done = threading.Event()

    def forward() -> None:
        forwarded.append(threading.current_thread().name)
        done.set()

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    for s in before:
        signal.signal(s, lambda *_: None)  # torch's handler would be here
    watch = SignalWatch(forward)
    try:
        watch.install()
        watch.reraise()  # nothing received: nothing raised
        assert not watch.preempted()  # torch's own shutdown (SIGTERM): no preemption
        with pytest.raises(SignalException):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(1)
        assert watch.received == signal.SIGUSR1 and not forwarded
        assert not watch.preempted()  # a SIGUSR1 is no preemption
        with pytest.raises(SignalException):
            watch.reraise()
        with pytest.raises(SignalException):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert done.wait(5) and forwarded == ["trainguard-agent-signals"]
        assert watch.preempted() and watch.received == signal.SIGUSR1  # the first one
        with pytest.raises(SignalException):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        time.sleep(0.2)
        assert forwarded == ["trainguard-agent-signals"]  # once
    finally:
        watch.close()
        for s, handler in before.items():
            signal.signal(s, handler)
    assert signal.set_wakeup_fd(-1) == -1  # restored (pytest set none)
    assert not any(t.name == "trainguard-agent-signals" for t in threading.enumerate())
