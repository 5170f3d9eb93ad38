"""Start N ``python -m trainguard.launch`` agents on this machine ("nodes" on localhost).

Each agent runs in a session of its own (``start_new_session``); its workers are in sessions
of their own too (torch starts them so), so every process of a job is found by the job's unique
run id, which each carries in its environment (``TG_TEST_RUN``) and, for the agents, on the
command line. Teardown kills every such process; :func:`leftovers` lists them (psutil-free: it
reads ``/proc``).

    with Agents(tmp_path, nodes=2, nproc=2, worker=["run", out]) as job:
        job.wait_for(lambda: ..., timeout=20)
        codes = job.wait(timeout=40)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests._dist import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).resolve().parent / "_workers.py")
#: small rendezvous timeouts: the c10d rendezvous of 2 local agents takes ~1 s.
RDZV_CONF = "join_timeout=30,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def leftovers(run_id: str) -> list[int]:
    """Pids of live processes (not zombies) whose environment or command line holds ``run_id``."""
    needle = run_id.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if (
                needle in (entry / "environ").read_bytes()
                or needle in (entry / "cmdline").read_bytes()
            ):
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def kill_all(run_id: str) -> list[int]:
    """SIGKILL every process of the run (and its process group); returns what was found."""
    found = leftovers(run_id)
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (exists and is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def progress(out: Path, rank: int) -> int:
    """The step count rank ``rank``'s ``run`` workers reached (see ``_workers.py``)."""
    try:
        return int((out / f"progress-{rank}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def read_starts(out: Path) -> list[dict[str, Any]]:
    """The workers' start records (see ``_workers.py``), in order."""
    path = out / "starts.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Agents:
    """``nodes`` agents of one job, each with ``nproc`` workers running ``_workers.py worker``.

    ``extra``: more launcher options (for every agent); ``env``: more environment variables.
    ``timeout``: hard limit for the whole job; :meth:`wait` and the ``with`` exit kill
    everything past it.
    """

    def __init__(
        self,
        tmp: Path,
        *,
        nodes: int,
        nproc: int,
        worker: Sequence[str],
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        module: str = "trainguard.launch",
        timeout: float = 50.0,
    ) -> None:
        self.tmp = tmp
        self.run_id = f"tgtest-{uuid.uuid4().hex[:12]}"
        self.port = free_port()
        self.deadline = time.monotonic() + timeout
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.env = dict(os.environ, TG_TEST_RUN=self.run_id, **(env or {}))
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT / "src"), str(ROOT), self.env.get("PYTHONPATH", "")) if p
        )
        self.nodes, self.nproc, self.module = nodes, nproc, module
        self.extra, self.worker = list(extra), list(worker)
        for node in range(nodes):
            self.add(host=node == 0)

    def add(self, *, host: bool = False, extra: Sequence[str] = ()) -> int:
        """Start one more agent of the job (``host``: it hosts the rendezvous store); returns
        its index in :attr:`procs` (a replacement node starts like this while the job runs)."""
        index = len(self.procs)
        cmd = [
            sys.executable,
            "-m",
            self.module,
            f"--nnodes={self.nodes}",
            f"--nproc-per-node={self.nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={self.run_id}",
            "--local-addr=127.0.0.1",
            f"--rdzv-conf=is_host={int(host)},{RDZV_CONF}",
            "--monitor-interval=0.05",
            *self.extra,
            *extra,
            WORKER,
            *self.worker,
        ]
        log = self.tmp / f"agent-{index}.log"
        self.logs.append(log)
        with open(log, "wb") as f:
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    env=self.env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=ROOT,
                )
            )
        return index

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def wait_for(self, cond: Callable[[], Any], *, timeout: float = 30.0, what: str = "") -> Any:
        """Poll ``cond`` until it returns something truthy; fail (with the logs) on timeout."""
        end = time.monotonic() + min(timeout, self.left())
        while time.monotonic() < end:
            value = cond()
            if value:
                return value
            if all(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what or cond}\n{self.output()}")

    def wait(self, timeout: float | None = None) -> list[int]:
        """Exit codes of the agents; kills everything and fails if they run past the limit."""
        end = time.monotonic() + (self.left() if timeout is None else min(timeout, self.left()))
        for p in self.procs:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"agents still running at the limit\n{self.output()}"
                ) from None
        return [int(p.returncode) for p in self.procs]

    def signal(self, node: int, sig: int) -> None:
        self.procs[node].send_signal(sig)

    def kill(self) -> list[int]:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        found = kill_all(self.run_id)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        return found

    def output(self) -> str:
        parts = []
        for i, log in enumerate(self.logs):
            text = log.read_text(errors="replace") if log.exists() else ""
            lines = [
                ln
                for ln in text.splitlines()
                if "OMP_NUM_THREADS" not in ln and "****" not in ln and "waitForInput" not in ln
            ]
            parts.append(f"--- agent {i} ---\n" + "\n".join(lines[-60:]))
        return "\n".join(parts)

    def __enter__(self) -> Agents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
