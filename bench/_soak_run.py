"""Running the soak's processes: the reference run, then job segments until the job finishes.

A job segment is one set of ``ranks + spares`` fresh processes (:mod:`bench._soak_worker`)
with a new ``MASTER_PORT``. It ends when every process has exited: normally because the job
finished, else because the wrapper could not go on (no spare left after a rank left, or
``RetryLimitError``); then a new segment resumes from the newest checkpoint (a job-level
restart, which no launcher does for us yet). A segment in which no rank takes a step for
``stall`` seconds is a hang: its processes are killed and the soak fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import _soak_check as check
from bench._soak_plan import SoakConfig

REPO = Path(__file__).resolve().parent.parent
EXPECTED_ENDS = ("done", "idle", "retry-limit", "sidecar-lost")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(cfg: SoakConfig, segment: int) -> dict[str, str]:
    env = dict(os.environ)
    src = str(REPO / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), src, env.get("PYTHONPATH")) if p)
    env["SOAK_MARKER"] = cfg.marker
    env["TRAINGUARD_EVENTS_DIR"] = str(Path(cfg.out) / "events" / f"s{segment}")
    env["TRAINGUARD_JOB_ID"] = f"soak-{cfg.marker[:8]}-s{segment}"
    return env


def start(
    cfg: SoakConfig, args: list[str], log: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """Start ``python -m bench._soak_worker ARGS`` in a session of its own (its whole process
    group can be killed), its output appended to ``logs/LOG``."""
    logs = Path(cfg.out) / "logs"
    logs.mkdir(exist_ok=True)
    with open(logs / log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "bench._soak_worker", *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_all(procs: list[subprocess.Popen[bytes]], marker: str) -> list[int]:
    """SIGKILL our processes' groups, then any process still carrying the marker; their pids."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    left = check.marked_processes(marker)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def reference(cfg: SoakConfig, timeout: float) -> dict[str, Any]:
    """Run the fault-free reference; its digests (final, and at each disk-checkpoint step)."""
    env = child_env(cfg, -1)
    port = str(free_port())
    t0 = time.time()
    procs = [
        start(
            cfg,
            ["reference", str(Path(cfg.out) / "soak-config.json"), str(p), port],
            f"reference-p{p}.log",
            env,
        )
        for p in range(cfg.ranks)
    ]
    try:
        for proc in procs:
            proc.wait(timeout=max(timeout - (time.time() - t0), 1))
    except subprocess.TimeoutExpired:
        kill_all(procs, cfg.marker)
        raise RuntimeError(f"the reference run did not finish within {timeout:.0f} s") from None
    if any(p.returncode != 0 for p in procs):
        codes = [p.returncode for p in procs]
        raise RuntimeError(
            f"the reference run failed (exit codes {codes}); see {cfg.out}/logs/reference-p*.log"
        )
    found = [
        json.loads((Path(cfg.out) / "reference" / f"p{p}.json").read_text())
        for p in range(cfg.ranks)
    ]
    return {
        "final": {p: r["final"] for p, r in enumerate(found)},
        "disk_saves": {int(k): v for k, v in found[0]["disk_saves"].items()},
        "seconds": time.time() - t0,
    }


@dataclasses.dataclass
class Segment:
    """What one job segment did."""

    index: int
    started: float
    ended: float = 0.0
    results: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    exitcodes: dict[int, int | None] = dataclasses.field(default_factory=dict)
    hung: bool = False
    leftovers: list[int] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Every active rank number returned the trained parameters."""
        return sum(r["outcome"] == "done" for r in self.results.values()) > 0 and all(
            r["outcome"] in ("done", "idle") for r in self.results.values()
        )

    def unexpected(self) -> list[str]:
        """Ends that are no part of any fault's recovery (a process error, a hang)."""
        problems = [
            f"segment {self.index} process {p}: {r['outcome']}: {r.get('error', '')}"
            for p, r in sorted(self.results.items())
            if r["outcome"] not in EXPECTED_ENDS
        ]
        if self.hung:
            problems.append(f"segment {self.index}: no rank took a step for too long (a hang)")
        return problems


def _step_bytes(cfg: SoakConfig, segment: int) -> int:
    return sum(p.stat().st_size for p in (Path(cfg.out) / "steps").glob(f"s{segment}-p*.log"))


def run_segment(cfg: SoakConfig, index: int, *, stall: float, deadline: float) -> Segment:
    """Start one segment's processes and wait until all have exited (or a stall/deadline)."""
    env = child_env(cfg, index)
    port = str(free_port())
    config = str(Path(cfg.out) / "soak-config.json")
    seg = Segment(index, time.time())
    procs = [
        start(cfg, ["guarded", config, str(index), str(p), port], f"s{index}-p{p}.log", env)
        for p in range(cfg.world)
    ]
    (Path(cfg.out) / "steps").mkdir(exist_ok=True)
    seen, last_change = -1, time.monotonic()
    while any(p.poll() is None for p in procs):
        time.sleep(0.1)
        size = _step_bytes(cfg, index)
        if size != seen:
            seen, last_change = size, time.monotonic()
        if time.monotonic() - last_change > stall or time.monotonic() > deadline:
            seg.hung = True
            for proc in procs:  # every thread's stack into the process's log, then the kill
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGUSR2)
            time.sleep(1.0)
            kill_all(procs, cfg.marker)
            break
    seg.ended = time.time()
    seg.exitcodes = {p: proc.returncode for p, proc in enumerate(procs)}
    grace = time.monotonic() + 15  # the store server exits when the last client left
    while (left := check.marked_processes(cfg.marker)) and time.monotonic() < grace:
        time.sleep(0.2)
    if left:
        seg.leftovers = kill_all([], cfg.marker)
    for p in range(cfg.world):
        path = Path(cfg.out) / "results" / f"s{index}-p{p}.json"
        if path.exists():
            seg.results[p] = json.loads(path.read_text())
    return seg


def run_job(cfg: SoakConfig, *, stall: float, timeout: float, max_segments: int) -> list[Segment]:
    """Segments until the job finishes, something unexpected happens, or the limits hit."""
    deadline = time.monotonic() + timeout
    segments: list[Segment] = []
    while len(segments) < max_segments:
        seg = run_segment(cfg, len(segments), stall=stall, deadline=deadline)
        segments.append(seg)
        ends = sorted({r["outcome"] for r in seg.results.values()})
        print(
            f"  segment {seg.index}: {seg.ended - seg.started:6.1f} s, process ends {ends}, "
            f"exit codes {list(seg.exitcodes.values())}",
            flush=True,
        )
        if seg.finished or seg.unexpected() or seg.leftovers or time.monotonic() > deadline:
            break
    return segments
